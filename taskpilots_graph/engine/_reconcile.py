"""Settling an effect of unknown outcome with the tool's pre-check, executing nothing.

Asked when a call may have reached the service without its outcome on record (a failure
after it may have been sent, an intent whose run stopped): ``Done`` commits the effect
with its proof, an answer that makes running again unsafe marks the entry ``uncertain``
for a person, and the rest leaves the key to be executed again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from taskpilots_graph.engine._call import CallContext
from taskpilots_graph.engine._records import brief, call_event, now, recordable, result_extra
from taskpilots_graph.engine._requests import Asks, CallOutcome, RunPrecheck, WriteEntry, WriteEvent
from taskpilots_graph.errors import PrecheckError
from taskpilots_graph.events import EventKind, EventRecord
from taskpilots_graph.ledger import (
    Done,
    LedgerEntry,
    LedgerStatus,
    NotDone,
    PrecheckOutcome,
    SideEffectUncertain,
    Step,
    Unknown,
    step_after_precheck,
)

__all__ = ["reconcile", "settle_orphan", "uncertain"]


def uncertain(ctx: CallContext, reason: str) -> SideEffectUncertain:
    """The error that stops the call's step for a person, saying why."""
    return SideEffectUncertain(key=ctx.key, tool=ctx.tool, thread_id=ctx.thread_id, reason=reason)


def _moved(entry: LedgerEntry, event: EventRecord, **changes: Any) -> WriteEntry:
    """Write ``entry`` with ``changes``, expecting it still as it was read."""
    moved = replace(entry, updated_at=now(), **changes)
    return WriteEntry(moved, (entry.status, entry.attempt), event)


def _ask_precheck(ctx: CallContext) -> Asks[PrecheckOutcome | PrecheckError | None]:
    """The pre-check's answer about the call's key (``None``: the tool has none).

    An answer that is none of ``Done``, ``NotDone``, ``Unknown`` (``None``, a string, ...)
    comes back as a :class:`~taskpilots_graph.errors.PrecheckError` naming the tool and
    what was returned: a broken pre-check tells nothing, so the callers fail closed (the
    entry goes ``uncertain``, to a person), whatever the tool declares, and never execute.
    """
    assert ctx.spec is not None
    if ctx.spec.precheck is None:
        return None
    outcome = yield RunPrecheck(ctx.key, dict(ctx.args), ctx)
    if not isinstance(outcome, Done | NotDone | Unknown):
        return PrecheckError(ctx.tool, outcome)
    return outcome


def _commit_found(ctx: CallContext, entry: LedgerEntry, found: Done) -> Asks[CallOutcome]:
    """Commit an effect the pre-check found performed, with its proof; nothing runs."""
    result, reduced = recordable(found.result)
    proof, proof_reduced = recordable(found.proof)
    extra: dict[str, Any] = {
        **entry.extra,
        "reconciled": "precheck_done",
        "result_reduced": reduced or proof_reduced,
    }
    event = call_event(ctx, EventKind.EFFECT_RECONCILED, outcome="done", proof=brief(proof))
    yield _moved(
        entry,
        event,
        status=LedgerStatus.COMMITTED,
        result=result,
        proof=proof,
        extra=result_extra(extra, result, False),
    )
    return CallOutcome(result=result, replayed=True)


def _mark_uncertain(
    ctx: CallContext,
    entry: LedgerEntry,
    why: str,
    outcome: PrecheckOutcome | PrecheckError | None,
) -> Asks[str]:
    """Mark an effect nobody can confirm ``uncertain``; returns the reason (for a person)."""
    if outcome is None:
        reason = why + "; it has no pre-check"
    elif isinstance(outcome, PrecheckError):
        reason = f"{why}; the pre-check is broken ({type(outcome).__name__}: {outcome})"
    else:
        told = outcome.reason if isinstance(outcome, Unknown) else ""
        reason = why + "; the pre-check could not tell" + (f" ({told})" if told else "")
    event = call_event(ctx, EventKind.EFFECT_UNCERTAIN, reason=reason)
    yield _moved(entry, event, status=LedgerStatus.UNCERTAIN)
    return reason


def reconcile(ctx: CallContext, entry: LedgerEntry, why: str) -> Asks[CallOutcome | None]:
    """Ask the pre-check about an effect of unknown outcome.

    Returns the outcome when the question is settled without executing (``Done``), ``None``
    when executing again with the same key is safe, and raises
    :class:`SideEffectUncertain` otherwise (after marking the entry uncertain).
    """
    assert ctx.spec is not None
    outcome = yield from _ask_precheck(ctx)
    if isinstance(outcome, PrecheckError):
        raise uncertain(ctx, (yield from _mark_uncertain(ctx, entry, why, outcome))) from outcome
    if isinstance(outcome, Done):
        return (yield from _commit_found(ctx, entry, outcome))
    if step_after_precheck(outcome, ctx.spec) is Step.ESCALATE:
        raise uncertain(ctx, (yield from _mark_uncertain(ctx, entry, why, outcome)))
    label = "not_done" if isinstance(outcome, NotDone) else "unknown_idempotent"
    yield WriteEvent(call_event(ctx, EventKind.EFFECT_RECONCILED, outcome=label))
    return None


def settle_orphan(ctx: CallContext, entry: LedgerEntry) -> Asks[str]:
    """Reconcile an intent whose run stopped, from the ledger alone, executing nothing.

    The rules of :func:`~._protocol.run_call`'s reconcile branch, except where they would
    execute again (the pre-check says ``NotDone``, or an idempotent tool's outcome is
    unknown): nothing runs here; the entry is closed ``failed`` (not sent, or possibly sent
    and safe to repeat under its key), so a later call of the same key goes by the usual
    rules. Used where no graph step will reach the call again (new input on the thread, a
    thread with no checkpoint). Returns ``done``, ``not_done``, ``unknown_idempotent`` or
    ``uncertain``.
    """
    assert ctx.spec is not None
    outcome = yield from _ask_precheck(ctx)
    if isinstance(outcome, Done):
        yield from _commit_found(ctx, entry, outcome)
        return "done"
    if (
        isinstance(outcome, PrecheckError)
        or step_after_precheck(outcome, ctx.spec) is Step.ESCALATE
    ):
        yield from _mark_uncertain(
            ctx, entry, "the run stopped before recording the outcome", outcome
        )
        return "uncertain"
    not_done = isinstance(outcome, NotDone)
    label = "not_done" if not_done else "unknown_idempotent"
    error = {
        "type": "NotPerformed" if not_done else "OutcomeUnknown",
        "message": "the run stopped before the effect; the pre-check found no trace"
        if not_done
        else "the run stopped mid-call and nothing can tell whether it was performed",
        "maybe_sent": not not_done,
    }
    event = call_event(ctx, EventKind.EFFECT_RECONCILED, outcome=label)
    yield _moved(entry, event, status=LedgerStatus.FAILED, error=error)
    return label
