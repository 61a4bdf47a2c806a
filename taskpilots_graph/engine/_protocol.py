"""The ledger protocol for one tool call, as an I/O-free generator.

The generator yields *requests* (:mod:`._requests`: read an entry, write an entry with its
event, run the pre-check, run the tool) and receives their answers; the drivers of
:mod:`._drive` carry the requests out for both agent forms, the undo of an effect and the
settling of an orphan. This keeps one copy of the rules, and lets tests drive the protocol
step by step. What a call records is built in :mod:`._records`; an effect of unknown
outcome is settled in :mod:`._reconcile`.
"""

from __future__ import annotations

import socket
from dataclasses import replace
from typing import Any

from langgraph.errors import GraphBubbleUp

from taskpilots_graph.drift import detect_drift
from taskpilots_graph.engine._call import CallContext
from taskpilots_graph.engine._reconcile import reconcile, uncertain
from taskpilots_graph.engine._records import (
    brief,
    call_event,
    failure_event,
    now,
    recordable,
    result_extra,
    stand_in,
    success_payload,
    tool_content,
)
from taskpilots_graph.engine._requests import (
    Asks,
    Awaited,
    AwaitOwner,
    CallOutcome,
    CheckArgs,
    FindRepeat,
    Protocol,
    ReadEntry,
    RunTool,
    WriteEntry,
    WriteEvent,
    in_flight,
)
from taskpilots_graph.errors import (
    EffectInProgress,
    LedgerConflict,
    LockBackendUnavailable,
    ResultDrifted,
    ThreadBusy,
)
from taskpilots_graph.events import EventKind
from taskpilots_graph.failures import classify
from taskpilots_graph.ledger import (
    PAUSED,
    RUNNER,
    CommittedEffect,
    LedgerEntry,
    LedgerStatus,
    Step,
    args_digest,
    next_step,
    runner_of,
)
from taskpilots_graph.tools import Invocation

__all__ = ["may_have_reached_service", "repeat_note", "run_call", "writes_intent"]

# Raised before any connection existed: the request cannot have left the process. Nothing
# else is assumed: a ValueError, KeyError, TypeError or ValidationError may as well come
# from parsing the reply of a service that already acted.
_BEFORE_CONNECTING: tuple[type[BaseException], ...] = (ConnectionRefusedError, socket.gaierror)


def may_have_reached_service(
    exc: BaseException, not_sent: tuple[type[BaseException], ...] = ()
) -> bool:
    """Whether a call that raised ``exc`` from its body may have performed its effect.

    Conservative: possibly sent unless the exception says otherwise with a boolean
    ``maybe_sent`` attribute, its type is one the tool declared ``not_sent``
    (``side_effect(not_sent=...)``), or it is a connection error raised before a
    connection existed. Arguments rejected by the tool's schema never get here: the
    protocol checks them before the intent (:class:`CheckArgs`).
    """
    declared = getattr(exc, "maybe_sent", None)
    if isinstance(declared, bool):
        return declared
    return not isinstance(exc, (*_BEFORE_CONNECTING, *not_sent))


_EXISTS = CallOutcome(error=LedgerConflict("the key already has a ledger entry"))
"""Internal marker: the optimistic intent found an entry under the key."""


def run_call(ctx: CallContext) -> Protocol:
    """The protocol for one call; see :mod:`taskpilots_graph.ledger` for the rules."""
    if ctx.spec is None:
        return (yield from _pure_call(ctx))
    rejected = yield from _check_args(ctx)
    if rejected is not None:
        return rejected
    if not ctx.spec.repeatable:
        # A model that lost sight of a result re-plans the effect under a new tool-call id,
        # hence a new key: only the thread's committed effects can tell it was done.
        earlier: CommittedEffect | None = yield FindRepeat(
            ctx.thread_id, ctx.tool, args_digest(ctx.args)
        )
        if earlier is not None:
            return (yield from _repeat(ctx, earlier))
    entry: LedgerEntry | None
    if not writes_intent(ctx):
        entry = yield ReadEntry(ctx.key, ctx.thread_id)
        if entry is None:
            return (yield from _execute(ctx, None))
    else:
        # Most calls are new: write the intent straight away; only when an entry already
        # holds the key is it read and reconciled. Saves a read on every fresh side effect.
        fresh = yield from _execute(ctx, None)
        if fresh is not _EXISTS:
            return fresh
        entry = yield ReadEntry(ctx.key)
    if in_flight(entry):
        # A live intent is never reconciled: its owner may be performing it right now.
        entry = yield from _await_owner(ctx, entry)
    step = next_step(entry)
    if entry is not None and step is Step.RETURN_RECORDED:
        return (yield from _replayed(ctx, entry))
    if entry is not None and step is Step.ESCALATE:
        raise uncertain(ctx, "it was marked uncertain earlier and awaits a person")
    if entry is not None and step is Step.PRECHECK:
        settled = yield from reconcile(ctx, entry, "the previous attempt did not record a result")
        if settled is not None:
            return settled
    return (yield from _execute(ctx, entry))


def writes_intent(ctx: CallContext) -> bool:
    """Whether a new call of ``ctx`` writes its intent before the tool runs.

    Not for an idempotent tool under its default key and without a business lock, whose
    step's checkpoint is on disk before it runs (``ctx.step_durable``). That checkpoint
    already names the call (its tool-call id, hence its key), and the service answers a
    repeated key with the first outcome: a call lost between the tool and its commit is
    settled by running it again under the same key, and "may have started" buys nothing the
    ledger read before the call does not. Its first write is then the commit, with the
    call's events: one durable write per effect instead of two.

    Kept otherwise: a checkpoint that may not be durable leaves the model's decision (and
    so the key) to the intent's transaction; a ``key=`` may be shared by other threads,
    whose runs must find the call on record and wait for it, as must a business lock's
    next holder; and a non-idempotent effect must be told "never started" from "may have
    started".
    """
    spec = ctx.spec
    if spec is None or not spec.idempotent or not ctx.step_durable:
        return True
    return spec.key is not None or spec.lock is not None


def _check_args(ctx: CallContext) -> Asks[CallOutcome | None]:
    """Fail the call as "not sent" if the tool's schema rejects its arguments.

    Checked before the intent, so that an error raised later, while the tool runs, is
    known to come from its body, where it may follow the effect.
    """
    try:
        yield CheckArgs(dict(ctx.args))
    except GraphBubbleUp:
        raise
    except Exception as exc:
        return (yield from _unrecorded(ctx, exc, False, ctx.attempt))
    return None


def repeat_note(earlier: CommittedEffect) -> str:
    """What the model reads instead of a second execution of a committed effect."""
    entry = earlier.entry
    call = f" (tool call {entry.tool_call_id})" if entry.tool_call_id else ""
    return (
        f"already done at step {earlier.step}: {tool_content(entry.result)}\n"
        f"[{entry.tool} with these arguments was already performed in this thread{call}; "
        "it was not performed again. This is its recorded result.]"
    )


def _repeat(ctx: CallContext, earlier: CommittedEffect) -> Protocol:
    """A side effect asked for again after it was committed in the thread."""
    entry = earlier.entry
    if entry.key == ctx.key:
        # This very call committed before (a retry, a replayed step): its recorded result,
        # as the reconcile rules would give it, one failed insert and one read sooner.
        return (yield from _replayed(ctx, entry))
    yield WriteEvent(
        call_event(
            ctx,
            EventKind.REPEAT_CAUGHT,
            args=dict(ctx.args),
            earlier_key=entry.key,
            earlier_tool_call_id=entry.tool_call_id,
            step=earlier.step,
            result=brief(entry.result),
        )
    )
    return CallOutcome(result=repeat_note(earlier), replayed=True, repeat_of=entry.key)


def _await_owner(ctx: CallContext, entry: LedgerEntry) -> Asks[LedgerEntry | None]:
    """Wait for the owner of a live intent; the entry to go on with.

    Committed meanwhile: the recorded result follows. Owner gone with the entry still
    intended: an orphan, reconciled as usual. Still in progress when the wait ends:
    :class:`~taskpilots_graph.errors.EffectInProgress`, and nothing runs here.
    """
    awaited: Awaited = yield AwaitOwner(entry)
    if awaited.holder is None:
        return awaited.entry
    found = awaited.entry
    yield WriteEvent(
        call_event(
            ctx,
            EventKind.INTENT_AWAITED,
            owner_thread=runner_of(entry),
            holder=awaited.holder,
            waited_s=round(awaited.waited, 3),
            outcome="in_progress"
            if awaited.timed_out
            else (str(found.status) if found is not None else "deleted"),
        )
    )
    if awaited.timed_out:
        raise EffectInProgress(
            ctx.key, tool=ctx.tool, owner_thread=runner_of(entry), holder=awaited.holder
        )
    return found


def _replayed(ctx: CallContext, entry: LedgerEntry) -> Protocol:
    """The result the ledger recorded for this very call, returned without executing."""
    yield WriteEvent(call_event(ctx, EventKind.TOOL_SKIPPED, reason=f"already {entry.status}"))
    return CallOutcome(result=entry.result, replayed=True)


def _unrecorded(
    ctx: CallContext, exc: Exception, maybe_sent: bool, attempt: int, refused: bool = False
) -> Protocol:
    """A failure that leaves no ledger entry (rejected arguments, a refused lock, a pure
    tool): classified, and recorded as its event alone."""
    failure = classify(exc, ctx.rules)
    yield WriteEvent(failure_event(ctx, failure, maybe_sent, attempt))
    return CallOutcome(error=exc, failure=failure, refused=refused)


def _pure_call(ctx: CallContext) -> Protocol:
    """A tool without side effects: run it, record its events, compare its result."""
    attempt = ctx.attempt
    inv = Invocation(ctx.key, attempt, ctx.thread_id, ctx.tool_call_id, ctx.tool)
    yield WriteEvent(call_event(ctx, EventKind.TOOL_INVOKED, args=dict(ctx.args), attempt=attempt))
    try:
        result = yield RunTool(inv, effect=False)
    except GraphBubbleUp:
        raise  # an interrupt inside the tool: LangGraph control flow, not a failure
    except Exception as exc:
        return (yield from _unrecorded(ctx, exc, may_have_reached_service(exc), attempt))
    result = stand_in(result)
    success = success_payload(ctx, result)
    yield WriteEvent(call_event(ctx, EventKind.TOOL_SUCCEEDED, attempt=attempt, **success))
    return (yield from _compared(ctx, result, recordable(result)[0]))


def _compared(ctx: CallContext, result: Any, recorded: Any) -> Protocol:
    """The outcome of a successful call, after comparing it with the call's earlier result.

    A drift is recorded as an event; for a high-risk tool the step then stops for a
    person (:class:`~taskpilots_graph.drift.ResultDrifted`, keeping ``recorded``).
    """
    if ctx.previous is None:
        return CallOutcome(result=result)
    drift = detect_drift(ctx.previous, result, comparator=ctx.drift_comparator)
    if drift is None:
        return CallOutcome(result=result)
    yield WriteEvent(call_event(ctx, EventKind.RESULT_DRIFTED, confirm=ctx.confirm_drift, **drift))
    if not ctx.confirm_drift:
        return CallOutcome(result=result)
    exc = ResultDrifted(tool=ctx.tool, tool_call_id=ctx.tool_call_id, drift=drift, result=recorded)
    return CallOutcome(error=exc, failure=classify(exc))


def _execute(ctx: CallContext, entry: LedgerEntry | None) -> Protocol:
    at = now()
    attempt = (entry.attempt if entry is not None else 0) + 1
    if entry is None:
        intended = LedgerEntry(
            key=ctx.key,
            thread_id=ctx.thread_id,
            checkpoint_ns=ctx.checkpoint_ns,
            tool=ctx.tool,
            tool_call_id=ctx.tool_call_id,
            status=LedgerStatus.INTENDED,
            args=ctx.args,
            args_digest=args_digest(ctx.args),
            attempt=attempt,
            created_at=at,
            updated_at=at,
            lock=ctx.spec.lock(dict(ctx.args)) if ctx.spec and ctx.spec.lock else None,
            extra=dict(ctx.extra or {}),
        )
        expect = None
    else:
        intended = replace(
            entry,
            status=LedgerStatus.INTENDED,
            attempt=attempt,
            error=None,
            updated_at=at,
            extra=_runner_extra(entry, ctx.thread_id),
        )
        expect = (entry.status, entry.attempt)
    invoked = call_event(ctx, EventKind.TOOL_INVOKED, args=dict(ctx.args), attempt=attempt)
    # ``written``: what the entry's next write expects to find (None: nothing on record).
    written: tuple[LedgerStatus, int] | None = (LedgerStatus.INTENDED, attempt)
    try:
        if entry is None and not writes_intent(ctx):
            written = None
            yield WriteEvent(invoked)  # rides with the commit
        else:
            yield WriteEntry(intended, expect, invoked)
    except LedgerConflict:
        if expect is not None:
            raise  # another run moved an entry we had read: stop, never execute twice
        return _EXISTS
    except (LockBackendUnavailable, ThreadBusy) as exc:
        # The driver could not take the call's business lock: nothing written, nothing run,
        # nothing sent. Classified like any failure (an unreachable backend is an outage, a
        # lock held elsewhere transient), so the router waits or escalates per policy.
        return (yield from _unrecorded(ctx, exc, False, attempt, refused=True))
    inv = Invocation(ctx.key, attempt, ctx.thread_id, ctx.tool_call_id, ctx.tool)
    try:
        result = yield RunTool(inv)
    except GraphBubbleUp:
        # The tool paused on interrupt(). LangGraph re-runs it from its first line when the
        # interrupt is answered, so that re-run is the same call continuing, not a crash
        # to reconcile: mark the entry, keep it intended, and let the interrupt through.
        paused = replace(intended, extra={**intended.extra, PAUSED: True}, updated_at=now())
        yield WriteEntry(paused, written, call_event(ctx, EventKind.TOOL_PAUSED))
        raise
    except Exception as exc:
        return (yield from _failed(ctx, intended, written, exc))
    # Whatever came back, the effect happened: a value nothing can encode is committed as
    # its placeholder (flagged), never left ``intended`` by a failing encoder.
    result = stand_in(result)
    recorded, reduced = recordable(result)
    committed = replace(
        intended,
        status=LedgerStatus.COMMITTED,
        result=recorded,
        updated_at=now(),
        extra=result_extra(intended.extra, recorded, reduced),
    )
    succeeded = call_event(
        ctx, EventKind.TOOL_SUCCEEDED, attempt=attempt, **success_payload(ctx, result)
    )
    try:
        # A lost commit of an idempotent tool or one with a pre-check is settled on resume
        # (re-run, or asked), so it may ride its task's writes instead of costing a commit.
        # Not under a business lock: the lock is released when the call ends, and the next
        # holder (another thread, maybe another process) must find the effect committed.
        settles = ctx.spec is not None and (ctx.spec.idempotent or ctx.spec.precheck is not None)
        settles = settles and not committed.lock
        yield WriteEntry(committed, written, succeeded, may_ride=settles)
    except LedgerConflict as exc:
        # Our call did run: say so, the entry's other writer must not be told otherwise.
        raise LedgerConflict(ctx.key, performed=True) from exc
    return (yield from _compared(ctx, result, recorded))


def _failed(
    ctx: CallContext,
    intended: LedgerEntry,
    written: tuple[LedgerStatus, int] | None,
    exc: Exception,
) -> Protocol:
    assert ctx.spec is not None
    maybe_sent = may_have_reached_service(exc, ctx.spec.not_sent)
    failure = classify(exc, ctx.rules)
    info = {"type": failure.error_type, "message": failure.message, "maybe_sent": maybe_sent}
    failed = replace(intended, status=LedgerStatus.FAILED, error=info, updated_at=now())
    event = failure_event(ctx, failure, maybe_sent, intended.attempt)
    yield WriteEntry(failed, written, event)
    if maybe_sent:
        settled = yield from reconcile(
            ctx, failed, f"the call failed with {type(exc).__name__} after it may have been sent"
        )
        if settled is not None:
            return settled
    return CallOutcome(error=exc, failure=failure)


def _runner_extra(entry: LedgerEntry, thread_id: str) -> dict[str, Any]:
    """The entry's ``extra`` for executing it again from ``thread_id``: the pause flag
    goes, and the runner is named when it is not the entry's own thread, so that others
    wait for this run (its thread lease) rather than reconcile a live intent."""
    extra = {k: v for k, v in entry.extra.items() if k not in (PAUSED, RUNNER)}
    if thread_id != entry.thread_id:
        extra[RUNNER] = thread_id
    return extra
