"""The ledger protocol for one tool call, as an I/O-free generator.

The generator yields *requests* (read an entry, write an entry with its event, run the
pre-check, run the tool) and receives their answers; the drivers of :mod:`._sync` and
:mod:`._async` carry the requests out for both agent forms, the undo of an effect and the
settling of an orphan. This keeps one copy of the rules, and lets tests drive the protocol
step by step.
"""

from __future__ import annotations

import contextlib
import json
import platform
import socket
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TypeGuard

from langgraph.errors import GraphBubbleUp

from taskpilots_graph.checkpointers._rows import MAX_RESULT_BYTES, dump_json, dump_json_unchecked
from taskpilots_graph.drift import (
    brief_value,
    detect_drift,
    is_placeholder,
    placeholder,
    result_digest,
    unserialisable,
)
from taskpilots_graph.engine._call import CallContext
from taskpilots_graph.errors import (
    ConfigurationError,
    EffectInProgress,
    LedgerConflict,
    LockBackendUnavailable,
    PrecheckError,
    ResultDrifted,
    ThreadBusy,
)
from taskpilots_graph.events import Event, EventKind, EventRecord, prepare_event
from taskpilots_graph.failures import Failure, classify, failure_payload
from taskpilots_graph.ledger import (
    PAUSED,
    RUNNER,
    CommittedEffect,
    Done,
    LedgerEntry,
    LedgerStatus,
    NotDone,
    PrecheckOutcome,
    SideEffectUncertain,
    Step,
    Unknown,
    args_digest,
    next_step,
    runner_of,
    step_after_precheck,
)
from taskpilots_graph.tools import Invocation

__all__ = [
    "AwaitOwner",
    "Awaited",
    "CallContext",
    "CallOutcome",
    "CheckArgs",
    "FindPrevious",
    "FindRepeat",
    "Protocol",
    "ReadEntry",
    "RunPrecheck",
    "RunTool",
    "WriteEntry",
    "WriteEvent",
    "in_flight",
    "latest_successes",
    "may_have_reached_service",
    "repeat_note",
    "run_call",
    "settle_orphan",
    "stand_in",
]

UNSERIALISABLE_FLAG = "result_unserialisable"
"""Flag in ``LedgerEntry.extra``: the tool returned a value that cannot be serialised at all
(a cyclic structure, an object whose ``str()`` raises); the entry's result is a placeholder
text saying so and why (:func:`taskpilots_graph.drift.placeholder`). ``result_reduced`` is
set too."""

SUMMARY_CHARS = 2048
"""Raw responses and errors are truncated to this many characters in events."""
RESULT_CHARS = 256
"""Bound on a successful result in its event: a summary of what came back. The ledger keeps
a side effect's whole result, and the checkpoint writes the one the model saw."""


def _library_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("taskpilots-graph")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


ENVIRONMENT: dict[str, str] = {
    "library_version": _library_version(),
    "python_version": platform.python_version(),
    "host": socket.gethostname(),
}
"""Recorded with every failure: where it happened."""

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


@dataclass(frozen=True, slots=True)
class CallOutcome:
    """How a call ended: a result (fresh or recorded), or the tool's exception classified."""

    result: Any = None
    error: BaseException | None = None
    failure: Failure | None = None
    replayed: bool = False
    repeat_of: str | None = None  # the key of the committed effect a caught repeat returned
    refused: bool = False  # the business lock could not be taken: nothing was written or run


@dataclass(frozen=True, slots=True)
class CheckArgs:
    """Validate the arguments against the tool's schema (``tools.check_args``).

    Answered with ``None``, or with the schema's error thrown in: the body never ran, so
    the call fails as "not sent" without a ledger entry.
    """

    args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FindRepeat:
    """The thread's earliest committed effect of ``tool`` with these canonical arguments.

    Answered with a :class:`~taskpilots_graph.ledger.CommittedEffect` or ``None``
    (``RecoveryAPI.committed_effect``).
    """

    thread_id: str
    tool: str
    args_digest: str


@dataclass(frozen=True, slots=True)
class ReadEntry:
    key: str


@dataclass(frozen=True, slots=True)
class FindPrevious:
    """The ``tool_succeeded`` payload of the call's latest earlier execution, or ``None``
    (asked before a call that may have run before, to compare its result: drift)."""

    thread_id: str
    key: str
    tool_call_id: str | None


def latest_successes(events: Iterable[Event]) -> dict[tuple[Any, Any], Mapping[str, Any]]:
    """The latest ``tool_succeeded`` payload of each (key, tool-call id) in ``events``."""
    latest: dict[tuple[Any, Any], Mapping[str, Any]] = {}
    for event in events:
        if event.kind is EventKind.TOOL_SUCCEEDED and not event.superseded:
            latest[(event.payload.get("key"), event.payload.get("tool_call_id"))] = event.payload
    return latest


@dataclass(frozen=True, slots=True)
class WriteEntry:
    """Write the entry and its event durably, together with any events buffered so far."""

    entry: LedgerEntry
    expect: tuple[LedgerStatus, int] | None
    event: EventRecord
    may_ride: bool = False
    """A commit whose loss the tool settles itself (idempotent, or with a pre-check): it
    may be written in the transaction of its task's ``put_writes`` instead of its own."""


@dataclass(frozen=True, slots=True)
class WriteEvent:
    """Record an event that needs no durability of its own (flushed with the next write)."""

    event: EventRecord


@dataclass(frozen=True, slots=True)
class RunPrecheck:
    """Ask the call's pre-check about its key (``call``: whose spec holds the pre-check)."""

    key: str
    args: dict[str, Any]
    call: CallContext | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class RunTool:
    """Run the tool; ``effect``: a side effect, whose thread lease and business lock are
    checked just before it runs."""

    invocation: Invocation
    effect: bool = True


@dataclass(frozen=True, slots=True)
class AwaitOwner:
    """Wait while the runner that wrote this ``intended`` entry may still be performing it.

    The driver checks the entry's thread lease (``thread:<entry.thread_id>``): held by
    another runner than the current one, the effect is in progress elsewhere, so it
    re-reads the entry until it leaves ``intended`` or the lease is gone, at most for its
    timeout. It answers :class:`Awaited`.
    """

    entry: LedgerEntry


@dataclass(frozen=True, slots=True)
class Awaited:
    """What waiting for an intent's owner found.

    Attributes:
        entry: The entry as last read (``None`` if it was deleted meanwhile).
        holder: The owner's lease holder that was waited for; ``None`` when nobody else
            held the lease (an orphan intent, or the current runner's own).
        waited: Seconds spent waiting.
        timed_out: The owner still held its lease and the entry was still ``intended``.
    """

    entry: LedgerEntry | None
    holder: str | None = None
    waited: float = 0.0
    timed_out: bool = False


Request = (
    CheckArgs
    | FindRepeat
    | FindPrevious
    | ReadEntry
    | AwaitOwner
    | WriteEntry
    | WriteEvent
    | RunPrecheck
    | RunTool
)
Protocol = Generator[Request, Any, CallOutcome]


def _now() -> datetime:
    return datetime.now(UTC)


def _truncate(text: str, limit: int = SUMMARY_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def recordable(result: Any) -> tuple[Any, bool]:
    """The JSON value the ledger keeps for a result, and whether it had to be reduced.

    A value the store accepts as it is (JSON, at most :data:`MAX_RESULT_BYTES` once encoded
    the way the store encodes it) is kept; anything else is kept as its text, cut until its
    encoding fits: the effect happened and must be committed whatever the tool returned. A
    value that has no text either (cyclic, ``str()`` raises) is kept as its placeholder.
    """
    with contextlib.suppress(ConfigurationError):
        dump_json(result, what="result")
        return result, False
    text = stand_in(result)
    if not isinstance(text, str):
        try:
            text = str(text)
        except Exception as exc:
            text = placeholder(result, f"{type(exc).__name__} from str()")
    while len(encoded := dump_json_unchecked(text)) > MAX_RESULT_BYTES:
        # Escapes make the encoding longer than the text: keep the share that fits.
        text = text[: max(0, len(text) * MAX_RESULT_BYTES // len(encoded) - 1)]
    return text, True


def stand_in(result: Any) -> Any:
    """``result`` itself, or its placeholder text when it cannot be serialised at all.

    Applied to a tool's result as soon as the tool returns, so that the ledger, the events,
    the drift digest and the model's message all carry the same faithful text instead of
    failing (after the effect happened) on a value nothing can encode.
    """
    why = unserialisable(result)
    return result if why is None else placeholder(result, why)


def _result_extra(extra: Mapping[str, Any], recorded: Any, reduced: bool) -> Mapping[str, Any]:
    """The entry's ``extra`` for a recorded result: flagged when it had to be reduced."""
    if is_placeholder(recorded):
        return {**extra, "result_reduced": True, UNSERIALISABLE_FLAG: True}
    return {**extra, "result_reduced": True} if reduced else extra


def _brief(value: Any) -> Any:
    """``value`` itself when its JSON fits an event summary, else its truncated text."""
    with contextlib.suppress(TypeError, ValueError):
        if len(dump_json_unchecked(value)) <= SUMMARY_CHARS:
            return value
    return _truncate(str(value))


def _event(ctx: CallContext, kind: EventKind, **payload: Any) -> EventRecord:
    body = {"tool": ctx.tool, "key": ctx.key, "tool_call_id": ctx.tool_call_id, **payload}
    return prepare_event(
        ctx.thread_id, kind, body, checkpoint_id=None, checkpoint_ns=ctx.checkpoint_ns
    )


def _failed_event(
    ctx: CallContext, failure: Failure, maybe_sent: bool, attempt: int
) -> EventRecord:
    # The complete failure context, so the log alone explains what happened.
    return _event(
        ctx,
        EventKind.TOOL_FAILED,
        args=dict(ctx.args),
        attempt=attempt,
        maybe_sent=maybe_sent,
        failure=failure_payload(failure),
        at=_now().isoformat(),
        **ENVIRONMENT,
    )


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
        entry = yield ReadEntry(ctx.key)
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
        yield WriteEvent(_event(ctx, EventKind.TOOL_SKIPPED, reason=f"already {entry.status}"))
        return CallOutcome(result=entry.result, replayed=True)
    if entry is not None and step is Step.ESCALATE:
        raise _uncertain(ctx, "it was marked uncertain earlier and awaits a person")
    if entry is not None and step is Step.PRECHECK:
        settled = yield from _reconcile(ctx, entry, "the previous attempt did not record a result")
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


def _check_args(ctx: CallContext) -> Generator[Request, Any, CallOutcome | None]:
    """Fail the call as "not sent" if the tool's schema rejects its arguments.

    Checked before the intent, so that an error raised later, while the tool runs, is
    known to come from its body, where it may follow the effect.
    """
    try:
        yield CheckArgs(dict(ctx.args))
    except GraphBubbleUp:
        raise
    except Exception as exc:
        failure = classify(exc, ctx.rules)
        yield WriteEvent(_failed_event(ctx, failure, False, ctx.attempt))
        return CallOutcome(error=exc, failure=failure)
    return None


def repeat_note(earlier: CommittedEffect) -> str:
    """What the model reads instead of a second execution of a committed effect."""
    entry = earlier.entry
    result = entry.result
    # As the tool's own answer would read (``executor.tool_content``).
    text = (
        result if isinstance(result, str) else json.dumps(result, default=str, ensure_ascii=False)
    )
    call = f" (tool call {entry.tool_call_id})" if entry.tool_call_id else ""
    return (
        f"already done at step {earlier.step}: {text}\n"
        f"[{entry.tool} with these arguments was already performed in this thread{call}; "
        "it was not performed again. This is its recorded result.]"
    )


def _repeat(ctx: CallContext, earlier: CommittedEffect) -> Protocol:
    """A side effect asked for again after it was committed in the thread."""
    entry = earlier.entry
    if entry.key == ctx.key:
        # This very call committed before (a retry, a replayed step): its recorded result,
        # as the reconcile rules would give it, one failed insert and one read sooner.
        yield WriteEvent(_event(ctx, EventKind.TOOL_SKIPPED, reason=f"already {entry.status}"))
        return CallOutcome(result=entry.result, replayed=True)
    yield WriteEvent(
        _event(
            ctx,
            EventKind.REPEAT_CAUGHT,
            args=dict(ctx.args),
            earlier_key=entry.key,
            earlier_tool_call_id=entry.tool_call_id,
            step=earlier.step,
            result=_brief(entry.result),
        )
    )
    return CallOutcome(result=repeat_note(earlier), replayed=True, repeat_of=entry.key)


def in_flight(entry: LedgerEntry | None) -> TypeGuard[LedgerEntry]:
    """Whether ``entry`` is an intent whose call may still be running (not one paused on an
    ``interrupt()``, which its own thread continues)."""
    return (
        entry is not None and entry.status is LedgerStatus.INTENDED and not entry.extra.get(PAUSED)
    )


def _await_owner(
    ctx: CallContext, entry: LedgerEntry
) -> Generator[Request, Any, LedgerEntry | None]:
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
        _event(
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


def _pure_call(ctx: CallContext) -> Protocol:
    attempt = ctx.attempt
    inv = Invocation(ctx.key, attempt, ctx.thread_id, ctx.tool_call_id, ctx.tool)
    yield WriteEvent(_event(ctx, EventKind.TOOL_INVOKED, args=dict(ctx.args), attempt=attempt))
    try:
        result = yield RunTool(inv, effect=False)
    except GraphBubbleUp:
        raise  # an interrupt inside the tool: LangGraph control flow, not a failure
    except Exception as exc:
        failure = classify(exc, ctx.rules)
        yield WriteEvent(_failed_event(ctx, failure, may_have_reached_service(exc), attempt))
        return CallOutcome(error=exc, failure=failure)
    result = stand_in(result)
    success = _success(ctx, result)
    yield WriteEvent(_event(ctx, EventKind.TOOL_SUCCEEDED, attempt=attempt, **success))
    return (yield from _compared(ctx, result, recordable(result)[0]))


def _success(ctx: CallContext, result: Any) -> dict[str, Any]:
    """The payload of a ``tool_succeeded`` event: a summary, and a digest of the whole
    result so that a later run of the same call can tell whether it drifted."""
    try:
        text = str(result)
    except Exception as exc:  # e.g. a member whose repr() raises, though JSON could hold it
        text = placeholder(result, f"{type(exc).__name__} from str()")
    payload: dict[str, Any] = {
        "result": _truncate(text, RESULT_CHARS),
        "digest": result_digest(result),
    }
    if is_placeholder(result):
        payload[UNSERIALISABLE_FLAG] = True
    if ctx.keeps_value:
        payload["value"] = brief_value(result)
    return payload


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
    yield WriteEvent(_event(ctx, EventKind.RESULT_DRIFTED, confirm=ctx.confirm_drift, **drift))
    if not ctx.confirm_drift:
        return CallOutcome(result=result)
    exc = ResultDrifted(tool=ctx.tool, tool_call_id=ctx.tool_call_id, drift=drift, result=recorded)
    return CallOutcome(error=exc, failure=classify(exc))


def _ask_precheck(
    ctx: CallContext,
) -> Generator[Request, Any, PrecheckOutcome | PrecheckError | None]:
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


def _commit_found(ctx: CallContext, entry: LedgerEntry, found: Done) -> Protocol:
    """Commit an effect the pre-check found performed, with its proof; nothing runs."""
    result, reduced = recordable(found.result)
    proof, proof_reduced = recordable(found.proof)
    extra: dict[str, Any] = {
        **entry.extra,
        "reconciled": "precheck_done",
        "result_reduced": reduced or proof_reduced,
    }
    done = replace(
        entry,
        status=LedgerStatus.COMMITTED,
        result=result,
        proof=proof,
        updated_at=_now(),
        extra=_result_extra(extra, result, False),
    )
    event = _event(ctx, EventKind.EFFECT_RECONCILED, outcome="done", proof=_brief(proof))
    yield WriteEntry(done, (entry.status, entry.attempt), event)
    return CallOutcome(result=result, replayed=True)


def _mark_uncertain(
    ctx: CallContext,
    entry: LedgerEntry,
    why: str,
    outcome: PrecheckOutcome | PrecheckError | None,
) -> Generator[Request, Any, str]:
    """Mark an effect nobody can confirm ``uncertain``; returns the reason (for a person)."""
    if outcome is None:
        reason = why + "; it has no pre-check"
    elif isinstance(outcome, PrecheckError):
        reason = f"{why}; the pre-check is broken ({type(outcome).__name__}: {outcome})"
    else:
        told = outcome.reason if isinstance(outcome, Unknown) else ""
        reason = why + "; the pre-check could not tell" + (f" ({told})" if told else "")
    marked = replace(entry, status=LedgerStatus.UNCERTAIN, updated_at=_now())
    yield WriteEntry(
        marked,
        (entry.status, entry.attempt),
        _event(ctx, EventKind.EFFECT_UNCERTAIN, reason=reason),
    )
    return reason


def _reconcile(
    ctx: CallContext, entry: LedgerEntry, why: str
) -> Generator[Request, Any, CallOutcome | None]:
    """Ask the pre-check about an effect of unknown outcome.

    Returns the outcome when the question is settled without executing (``Done``), ``None``
    when executing again with the same key is safe, and raises
    :class:`SideEffectUncertain` otherwise (after marking the entry uncertain).
    """
    assert ctx.spec is not None
    outcome = yield from _ask_precheck(ctx)
    if isinstance(outcome, PrecheckError):
        raise _uncertain(ctx, (yield from _mark_uncertain(ctx, entry, why, outcome))) from outcome
    if isinstance(outcome, Done):
        return (yield from _commit_found(ctx, entry, outcome))
    if step_after_precheck(outcome, ctx.spec) is Step.ESCALATE:
        raise _uncertain(ctx, (yield from _mark_uncertain(ctx, entry, why, outcome)))
    label = "not_done" if isinstance(outcome, NotDone) else "unknown_idempotent"
    yield WriteEvent(_event(ctx, EventKind.EFFECT_RECONCILED, outcome=label))
    return None


def settle_orphan(ctx: CallContext, entry: LedgerEntry) -> Generator[Request, Any, str]:
    """Reconcile an intent whose run stopped, from the ledger alone, executing nothing.

    The rules of :func:`run_call`'s reconcile branch, except where they would execute
    again (the pre-check says ``NotDone``, or an idempotent tool's outcome is unknown):
    nothing runs here; the entry is closed ``failed`` (not sent, or possibly sent and
    safe to repeat under its key), so a later call of the same key goes by the usual
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
    failed = replace(
        entry,
        status=LedgerStatus.FAILED,
        error={
            "type": "NotPerformed" if not_done else "OutcomeUnknown",
            "message": "the run stopped before the effect; the pre-check found no trace"
            if not_done
            else "the run stopped mid-call and nothing can tell whether it was performed",
            "maybe_sent": not not_done,
        },
        updated_at=_now(),
    )
    event = _event(ctx, EventKind.EFFECT_RECONCILED, outcome=label)
    yield WriteEntry(failed, (entry.status, entry.attempt), event)
    return label


def _execute(ctx: CallContext, entry: LedgerEntry | None) -> Protocol:
    now = _now()
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
            created_at=now,
            updated_at=now,
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
            updated_at=now,
            extra=_runner_extra(entry, ctx.thread_id),
        )
        expect = (entry.status, entry.attempt)
    invoked = _event(ctx, EventKind.TOOL_INVOKED, args=dict(ctx.args), attempt=attempt)
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
        failure = classify(exc, ctx.rules)
        yield WriteEvent(_failed_event(ctx, failure, False, attempt))
        return CallOutcome(error=exc, failure=failure, refused=True)
    inv = Invocation(ctx.key, attempt, ctx.thread_id, ctx.tool_call_id, ctx.tool)
    try:
        result = yield RunTool(inv)
    except GraphBubbleUp:
        # The tool paused on interrupt(). LangGraph re-runs it from its first line when the
        # interrupt is answered, so that re-run is the same call continuing, not a crash
        # to reconcile: mark the entry, keep it intended, and let the interrupt through.
        paused = replace(intended, extra={**intended.extra, PAUSED: True}, updated_at=_now())
        yield WriteEntry(paused, written, _event(ctx, EventKind.TOOL_PAUSED))
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
        updated_at=_now(),
        extra=_result_extra(intended.extra, recorded, reduced),
    )
    succeeded = _event(ctx, EventKind.TOOL_SUCCEEDED, attempt=attempt, **_success(ctx, result))
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
    failed = replace(intended, status=LedgerStatus.FAILED, error=info, updated_at=_now())
    event = _failed_event(ctx, failure, maybe_sent, intended.attempt)
    yield WriteEntry(failed, written, event)
    if maybe_sent:
        settled = yield from _reconcile(
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


def _uncertain(ctx: CallContext, reason: str) -> SideEffectUncertain:
    return SideEffectUncertain(key=ctx.key, tool=ctx.tool, thread_id=ctx.thread_id, reason=reason)
