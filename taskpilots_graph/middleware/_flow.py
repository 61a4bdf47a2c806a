"""What :class:`RecoveryMiddleware` does with one tool call, as an I/O-free generator.

The flow wraps the ledger protocol of :mod:`taskpilots_graph.engine._protocol` (which it
drives unchanged) with the recovery decisions of :func:`~taskpilots_graph.decide_recovery`
and the takeover of a person. It yields requests; the engine's drivers carry them out, with
the middleware's own requests (:mod:`._requests`) handed to
:mod:`taskpilots_graph.middleware._tool_hooks`.

A takeover calls LangGraph's ``interrupt()`` inside the tool node. On resume the node runs
again from its first line, so the flow runs again from its start: ledger facts keep that
safe (a committed effect is returned, an uncertain one escalates without executing), and a
decision applied once is recorded on the ledger entry with the ordinal of its interrupt in
the task, so it is never applied twice.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from langchain_core.messages import ToolMessage
from langgraph.prebuilt.tool_node import ToolCallRequest

from taskpilots_graph import _clock
from taskpilots_graph.engine import CallContext, CallOutcome, run_call
from taskpilots_graph.engine._recovery import decide_next, failure_signature, transition_events
from taskpilots_graph.engine._requests import FindPrevious, ReadEntry, WriteEntry, WriteEvent
from taskpilots_graph.engine._run import run_finished
from taskpilots_graph.engine._takeover import decided_by, decision_recorded, ledger_move
from taskpilots_graph.errors import ConfigurationError, ResultDrifted, ToolWaiting
from taskpilots_graph.events import EventKind
from taskpilots_graph.failures import Failure, classify, failure_payload
from taskpilots_graph.ledger import LedgerEntry, SideEffectUncertain
from taskpilots_graph.middleware._call_state import DECIDED_MARK, FAILURE_MARK, Answer, CallState
from taskpilots_graph.middleware._requests import (
    Ask,
    Compensate,
    EndRun,
    ErrorAnswer,
    Flush,
    PassThrough,
    ReadAsked,
    ReadLedger,
    RecordDecision,
    Settings,
    Sleep,
    UseTool,
)
from taskpilots_graph.nodes._context import RunContext, decision_record
from taskpilots_graph.nodes.router import describe
from taskpilots_graph.nodes.takeover import build_request
from taskpilots_graph.recovery import Action
from taskpilots_graph.takeover import parse_decision

__all__ = ["DECISIONS", "Flow", "tool_flow"]

DECISIONS = "middleware_decisions"
"""Key in ``LedgerEntry.extra``: ``{task namespace: decisions applied}`` (see the module)."""

SKIPPED = "Skipped by a person; do not call it again."
ABANDONED = (
    "Abandoned by a person: committed side effects were undone where possible. "
    "Do not call any more tools; tell the user the task was stopped."
)

Flow = Generator[Any, Any, Answer]


def tool_flow(
    settings: Settings,
    request: ToolCallRequest,
    ctx: RunContext,
    *,
    task_ns: str,
    answers: int = 0,
    resumed: bool = False,
) -> Flow:
    """The flow of one tool call; returns the answer for the model.

    Args:
        settings: Policies and jitter source.
        request: The tool call as the tool node built it.
        ctx: Thread, namespace and durability of the run.
        task_ns: The tool task's own checkpoint namespace (unique per task).
        answers: How many of the task's questions to a person are answered (the task runs
            again after a takeover): they are applied first, without calling the tool on
            the way back to them, as the recovery agent applies a decision.
        resumed: The run continues a stopped one (``tp.resume``): the call may have run
            before, so its result is compared with the earlier one.
    """
    tools = {t.name: t for t in getattr(request.runtime, "tools", None) or ()}
    if request.tool is not None:
        tools.setdefault(request.tool.name, request.tool)
    state = CallState(
        request=request,
        ctx=ctx,
        task_ns=task_ns,
        tools=tools,
        using=request.tool_call["name"],
        args=dict(request.tool_call["args"]),
    )
    if state.using not in tools:
        # Not ours to handle: the tool node answers an unknown tool with an error message.
        answer: Answer = yield PassThrough(request)
        return answer
    if answers:
        asked: list[dict[str, Any]] = yield ReadAsked(ctx.thread_id, state.call_id, task_ns)
        for earlier in asked[:answers]:
            state.using, state.args = earlier["using"], dict(earlier["args"])
            state.attempts, state.tried = int(earlier["attempts"]), list(earlier["tried"])
            call_ctx = state.context(settings.policy(state.using))
            settled = yield from _decide(state, call_ctx, earlier, Ask({}, None))
            if settled is not None:
                return settled
        # More answers than questions on record (they were lost): the slow way back.
        state.answered = answers > len(asked)
    recorded = False
    while True:
        call_ctx = state.context(settings.policy(state.using))
        if (state.attempts or resumed) and not state.answered:
            # The call may have run before (a retry, a resumed run): its result is compared
            # with the earlier one, as the recovery agent's executor does (drift). Not on
            # the way back to a person's answer: the earlier result is then this task's own.
            found = yield FindPrevious(ctx.thread_id, call_ctx.key, call_ctx.tool_call_id)
            call_ctx = replace(call_ctx, previous=found)
        if call_ctx.spec is not None and not ctx.input_stored and not recorded:
            recorded = True
            yield from _record_decision(state)
        # The protocol's RunTool runs this request through the rest of the chain; the tool
        # node's answer lands in ``box`` (returned to the model on a fresh success).
        box: list[Answer] = yield UseTool(state.tool_request())
        try:
            outcome = yield from run_call(call_ctx)
        except SideEffectUncertain as exc:
            outcome = CallOutcome(error=exc, failure=classify(exc))
        if outcome.refused:
            # The agent's graph has no step that waits for a lock: the call stops with the
            # lock's error (ThreadBusy, LockBackendUnavailable), nothing written or run.
            assert outcome.error is not None
            raise outcome.error
        state.attempts += 1
        if outcome.failure is None:
            if box and not outcome.replayed:
                return state.marked(box[0])
            return state.result(outcome.result)
        settled = yield from _recover(settings, state, call_ctx, outcome)
        if settled is not None:
            return settled


def _record_decision(state: CallState) -> Generator[Any, Any, None]:
    # The checkpoint holding the model's message may not be durable yet ("async"
    # durability): a crash would make the model decide again with new tool-call ids, hence
    # new keys. Recording the decision lets the model hook replay it instead.
    record = decision_record(state.ctx, state.messages, state.call_id)
    if record is not None:
        yield RecordDecision(*record)


def _recover(
    settings: Settings,
    state: CallState,
    call_ctx: CallContext,
    outcome: CallOutcome,
) -> Generator[Any, Any, Answer | None]:
    """Apply the recovery decision for a failed attempt; ``None`` means "run again"."""
    failure = outcome.failure
    assert failure is not None
    assert outcome.error is not None
    now = _clock.now()
    if state.first_failed_at is None:
        state.first_failed_at = now
    signature = failure_signature(state.using, failure.kind, failure.error_type)
    state.failed = signature
    decision, tried = decide_next(
        settings.policy,
        tool=state.name,
        using=state.using,
        tried=state.tried,
        kind=failure.kind,
        attempts=state.attempts,
        first_failed_at=state.first_failed_at,
        now=now,
        retry_after=failure.retry_after,
        signature_count=_signature_count(state, signature),
        rng=settings.rng,
    )
    base = {
        "tool": state.name,
        "tool_call_id": state.call_id,
        "using": state.using,
        "reason": decision.reason,
        "failure_kind": failure.kind.value,
    }
    action = decision.action
    if action is Action.DEGRADE and decision.fallback not in state.tools:
        raise ConfigurationError(
            f"policies[{state.name!r}]: fallback {decision.fallback!r} is not one of the "
            "agent's tools; pass it in create_agent(tools=[...]) too"
        )
    for event in transition_events(state.ctx.thread_id, state.ctx.graph_ns, decision, **base):
        yield WriteEvent(event)
    if action is Action.RETRY:
        assert decision.retry_at is not None
        delay = max(0.0, decision.retry_at - now)
        policy = settings.policy(state.using)
        if delay > policy.max_in_process_wait:
            yield Flush()
            raise ToolWaiting(state.ctx.thread_id, decision.retry_at) from outcome.error
        if not state.answered:
            yield Sleep(delay)
        return None
    if action is Action.DEGRADE:
        assert decision.fallback is not None
        state.tried, state.using = tried, decision.fallback
        state.attempts, state.first_failed_at = 0, None
        return None
    if action is Action.REPORT:
        # The mark lets a later call of the same tool count this failure (stuck detection)
        # from the conversation itself; the model does not see artifacts.
        if isinstance(outcome.error, ErrorAnswer):
            return state.marked(outcome.error.answer.model_copy(update={"artifact": None}))
        return state.error(f"{describe(failure_payload(failure))} ({decision.reason})")
    if action in (Action.FAIL, Action.COMPENSATE):
        if action is Action.COMPENSATE:
            yield Compensate(state.ctx.thread_id, state.ctx.graph_ns, state.tools)
        # The run ends here (the error leaves invoke): logged as the recovery agent's fail
        # node logs it, so the thread shows as failed.
        reason = f"{state.using}: {decision.reason}"
        yield EndRun(run_finished(state.ctx.thread_id, state.ctx.graph_ns, "failed", reason=reason))
        yield Flush()
        raise outcome.error
    return (yield from _takeover(state, call_ctx, outcome.error, failure, decision.reason, base))


def _signature_count(state: CallState, signature: str) -> int:
    """How many tool calls of the conversation failed this way since a person's last
    decision, this one included. The recovery agent counts signatures in its flow state;
    here the answers of earlier calls carry them (``FAILURE_MARK``, ``DECIDED_MARK``).
    Retries of one call count once."""
    if state.decided:
        return 1  # a person's decision about this call starts the count again
    earlier: set[str] = set()
    for m in state.messages:
        marks = m.artifact if isinstance(m, ToolMessage) else None
        if not isinstance(marks, dict) or m.tool_call_id == state.call_id:
            continue
        if marks.get(DECIDED_MARK):
            earlier.clear()  # as the recovery agent's decisions reset its counts
        if marks.get(FAILURE_MARK) == signature:
            earlier.add(m.tool_call_id)
    return len(earlier) + 1


def _takeover(
    state: CallState,
    call_ctx: CallContext,
    error: BaseException,
    failure: Failure,
    reason: str,
    base: dict[str, Any],
) -> Generator[Any, Any, Answer | None]:
    key = call_ctx.key if call_ctx.spec is not None else None
    shown = failure_payload(failure)
    if isinstance(error, ResultDrifted):
        # As the recovery agent shows it: both values, and the new result ``accept`` keeps.
        shown["drift"] = {**error.drift, "current": error.result}
    ledger: list[LedgerEntry] = yield ReadLedger(state.ctx.thread_id, key)
    record = {
        "tool_call_id": state.call_id,
        "tool": state.name,
        "using": state.using,
        "args": dict(state.args),
        "attempts": state.attempts,
        "key": key,
        "status": "awaiting_human",
        "failure": shown,
    }
    view = {
        "messages": state.messages,
        "steps": {state.call_id: record},
        "flow": {"reason": f"{state.using}: {reason}"},
    }
    payload = build_request(view, state.ctx.thread_id, ledger).model_dump(mode="json")
    if not payload["pending"]:
        # The conversation no longer ends on the calling message (another middleware
        # rewrote it): name the step anyway, the person must see what waits.
        payload["pending"] = [{k: record[k] for k in ("tool_call_id", "tool", "args", "key")}]
    # What applying the answer needs when the task runs again (see tool_flow).
    again = {"task": state.task_ns, "ordinal": state.asked, "attempts": state.attempts}
    again["tried"] = list(state.tried)
    if isinstance(error, ResultDrifted):
        again["current"] = error.result
    event = state.ctx.event(
        EventKind.TAKEOVER_REQUESTED, key=key, args=dict(state.args), **base, **again
    )
    return (yield from _decide(state, call_ctx, again, Ask(payload, event)))


def _decide(
    state: CallState, call_ctx: CallContext, asked: Mapping[str, Any], ask: Ask
) -> Generator[Any, Any, Answer | None]:
    """Ask (or, on the task's way back, take the answer given) and apply the decision."""
    key = call_ctx.key if call_ctx.spec is not None else None
    ordinal = state.asked
    state.asked += 1
    decision = parse_decision((yield ask))
    entry: LedgerEntry | None = (yield ReadEntry(key)) if key else None
    applied = bool(asked.get("decided")) or (
        entry is not None
        and int(dict(entry.extra.get(DECISIONS) or {}).get(state.task_ns, 0)) > ordinal
    )
    if not applied:
        who = decided_by(decision)
        recorded = decision_recorded(
            state.ctx.thread_id,
            state.ctx.graph_ns,
            decision,
            who,
            [state.call_id],
            task=state.task_ns,
            ordinal=ordinal,
        )
        if entry is not None:
            # Mark the entry even when its status stays (abandon), so a re-run of the task
            # knows this answer was applied.
            moved = ledger_move(entry, decision, who, datetime.now(UTC)) or entry
            after = replace(moved, extra={**moved.extra, DECISIONS: {state.task_ns: ordinal + 1}})
            yield WriteEntry(after, (entry.status, entry.attempt), recorded)
        else:
            yield WriteEvent(recorded)
    action = decision.action
    state.answered = False  # from here on, this execution meets new ground
    state.decided, state.failed = True, None
    if action == "skip":
        return state.error(SKIPPED)
    if action == "provide_result":
        return state.result(decision.result)
    if action == "accept" and "current" in asked:
        return state.result(asked["current"])
    if action == "abandon":
        yield Compensate(state.ctx.thread_id, state.ctx.graph_ns, state.tools)
        return state.error(ABANDONED, abandoned=True)
    if action == "edit_args":
        state.args = dict(decision.args or {})
    state.attempts, state.first_failed_at = 0, None
    return None
