"""What :class:`RecoveryMiddleware` does with one tool call, as an I/O-free generator.

The flow wraps the ledger protocol of :mod:`taskpilots_graph.engine._protocol` (which it
drives unchanged) with the recovery decisions of :func:`~taskpilots_graph.decide_recovery`
and the takeover of a person. It yields requests; the engine's drivers carry them out, with
the middleware's own requests (:mod:`._requests`) handed to
:mod:`taskpilots_graph.middleware._middleware`.

A takeover calls LangGraph's ``interrupt()`` inside the tool node. On resume the node runs
again from its first line, so the flow runs again from its start: ledger facts keep that
safe (a committed effect is returned, an uncertain one escalates without executing), and a
decision applied once is recorded on the ledger entry with the ordinal of its interrupt in
the task, so it is never applied twice.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from langchain_core.messages import BaseMessage, ToolCall, ToolMessage
from langchain_core.tools import BaseTool
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from taskpilots_graph import _clock
from taskpilots_graph.engine import CallContext, CallOutcome, call_context, run_call
from taskpilots_graph.engine._recovery import decide_next, failure_signature, transition_events
from taskpilots_graph.engine._requests import FindPrevious, ReadEntry, WriteEntry, WriteEvent
from taskpilots_graph.engine._run import run_finished
from taskpilots_graph.engine._takeover import decided_by, decision_recorded, ledger_move
from taskpilots_graph.errors import ConfigurationError, ResultDrifted, ToolWaiting
from taskpilots_graph.events import EventKind, EventRecord, prepare_event
from taskpilots_graph.failures import Failure, classify, failure_payload
from taskpilots_graph.ledger import LedgerEntry, SideEffectUncertain
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
from taskpilots_graph.nodes._context import RunContext, dump_message, messages_digest
from taskpilots_graph.nodes.executor import error_message, tool_content
from taskpilots_graph.nodes.router import describe
from taskpilots_graph.nodes.takeover import build_request
from taskpilots_graph.policy import ToolPolicy
from taskpilots_graph.recovery import Action
from taskpilots_graph.takeover import parse_decision
from taskpilots_graph.tools import spec_of

__all__ = ["ABANDONED_MARK", "DECISIONS", "Answer", "Flow", "tool_flow"]

DECISIONS = "middleware_decisions"
"""Key in ``LedgerEntry.extra``: ``{task namespace: decisions applied}`` (see the module)."""

FAILURE_MARK = "taskpilots_failure"
"""Key in an answer's ``artifact``: the signature (tool, kind, error type) of its failure."""
DECIDED_MARK = "taskpilots_decided"
"""Key in an answer's ``artifact``: a person decided about the call."""
ABANDONED_MARK = "taskpilots_abandoned"
"""Key in an answer's ``artifact``: a person abandoned the run at this call (the agent ends
before the model is called again, as the recovery agent ends after compensating)."""

SKIPPED = "Skipped by a person; do not call it again."
ABANDONED = (
    "Abandoned by a person: committed side effects were undone where possible. "
    "Do not call any more tools; tell the user the task was stopped."
)


Answer = ToolMessage | Command[Any]
Flow = Generator[Any, Any, Answer]


def _event(ctx: RunContext, kind: EventKind, **payload: Any) -> EventRecord:
    return prepare_event(
        ctx.thread_id, kind, payload, checkpoint_id=None, checkpoint_ns=ctx.graph_ns
    )


def _answer(call_id: str, name: str, result: Any) -> ToolMessage:
    return ToolMessage(content=tool_content(result), tool_call_id=call_id, name=name)


def _before(messages: Sequence[BaseMessage], call_id: str) -> tuple[list[BaseMessage], Any]:
    """The conversation before the model message that made the call, and that message."""
    for index in range(len(messages) - 1, -1, -1):
        calls = getattr(messages[index], "tool_calls", None) or []
        if any(c.get("id") == call_id for c in calls):
            return list(messages[:index]), messages[index]
    return list(messages), None


@dataclass
class _Call:
    """The mutable course of one tool call through retries, fallbacks and decisions."""

    request: ToolCallRequest
    ctx: RunContext
    task_ns: str
    tools: dict[str, BaseTool]
    using: str
    args: dict[str, Any]
    attempts: int = 0
    first_failed_at: float | None = None
    tried: list[str] = field(default_factory=list)
    asked: int = 0  # interrupts met in this execution of the task, for ``DECISIONS``
    answered: bool = False  # the task runs again with a person's answer waiting
    failed: str | None = None  # the signature of the call's latest failure (stuck counting)
    decided: bool = False  # a person decided about the call

    def marked(self, answer: Answer, *, abandoned: bool = False) -> Answer:
        """``answer``, carrying what stuck detection counts in later calls, as the recovery
        agent counts it: the call's failure signature if it failed on its way (since a
        person's decision), and that a person decided (the count starts again); and that
        the run was abandoned here. An answer with an artifact of its own keeps it."""
        marks: dict[str, Any] = {DECIDED_MARK: True} if self.decided else {}
        if abandoned:
            marks[ABANDONED_MARK] = True
        if self.failed is not None:
            marks[FAILURE_MARK] = self.failed
        if not marks or not isinstance(answer, ToolMessage) or answer.artifact:
            return answer
        return answer.model_copy(update={"artifact": marks})

    @property
    def call_id(self) -> str:
        return self.request.tool_call["id"] or ""

    @property
    def name(self) -> str:
        return self.request.tool_call["name"]

    def context(self, policy: ToolPolicy) -> CallContext:
        """The call as the ledger protocol sees it, with the same user rules and drift
        settings the recovery agent's executor gives it."""
        tool = self.tools.get(self.using)
        return call_context(
            thread_id=self.ctx.thread_id,
            checkpoint_ns=self.ctx.graph_ns,
            tool=self.using,
            args=self.args,
            tool_call_id=self.call_id,
            spec=spec_of(tool) if tool is not None else None,
            policy=policy,
            attempt=self.attempts + 1,
            step_durable=self.ctx.input_stored,
        )

    def tool_request(self) -> ToolCallRequest:
        if self.using == self.name and self.args == self.request.tool_call["args"]:
            return self.request
        call = ToolCall(
            name=self.using, args=dict(self.args), id=self.request.tool_call["id"], type="tool_call"
        )
        # Known here: the flow only runs tools the node has (unknown ones pass through).
        return self.request.override(tool_call=call, tool=self.tools[self.using])


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
    state = _Call(
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
            return state.marked(_answer(state.call_id, state.name, outcome.result))
        settled = yield from _recover(settings, state, call_ctx, outcome)
        if settled is not None:
            return settled


def _record_decision(state: _Call) -> Generator[Any, Any, None]:
    # The checkpoint holding the model's message may not be durable yet ("async"
    # durability): a crash would make the model decide again with new tool-call ids, hence
    # new keys. Recording the decision lets the model hook replay it instead.
    messages = list((state.request.state or {}).get("messages") or [])
    before, ai = _before(messages, state.call_id)
    if ai is not None:
        yield RecordDecision(
            state.ctx.thread_id, state.ctx.graph_ns, messages_digest(before), dump_message(ai)
        )


def _recover(
    settings: Settings,
    state: _Call,
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
        if isinstance(outcome.error, ErrorAnswer):
            answer = outcome.error.answer
        else:
            text = f"{describe(failure_payload(failure))} ({decision.reason})"
            answer = error_message(state.request.tool_call, text)
        # The mark lets a later call of the same tool count this failure (stuck detection)
        # from the conversation itself; the model does not see artifacts.
        return state.marked(answer.model_copy(update={"artifact": None}))
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


def _signature_count(state: _Call, signature: str) -> int:
    """How many tool calls of the conversation failed this way since a person's last
    decision, this one included. The recovery agent counts signatures in its flow state;
    here the answers of earlier calls carry them (``FAILURE_MARK``, ``DECIDED_MARK``).
    Retries of one call count once."""
    if state.decided:
        return 1  # a person's decision about this call starts the count again
    earlier: set[str] = set()
    for m in (state.request.state or {}).get("messages") or []:
        marks = m.artifact if isinstance(m, ToolMessage) else None
        if not isinstance(marks, dict) or m.tool_call_id == state.call_id:
            continue
        if marks.get(DECIDED_MARK):
            earlier.clear()  # as the recovery agent's decisions reset its counts
        if marks.get(FAILURE_MARK) == signature:
            earlier.add(m.tool_call_id)
    return len(earlier) + 1


def _takeover(
    state: _Call,
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
        "messages": list((state.request.state or {}).get("messages") or []),
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
    event = _event(
        state.ctx, EventKind.TAKEOVER_REQUESTED, key=key, args=dict(state.args), **base, **again
    )
    return (yield from _decide(state, call_ctx, again, Ask(payload, event)))


def _decide(
    state: _Call, call_ctx: CallContext, asked: Mapping[str, Any], ask: Ask
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
        return state.marked(error_message(state.request.tool_call, SKIPPED))
    if action == "provide_result":
        return state.marked(_answer(state.call_id, state.name, decision.result))
    if action == "accept" and "current" in asked:
        return state.marked(_answer(state.call_id, state.name, asked["current"]))
    if action == "abandon":
        yield Compensate(state.ctx.thread_id, state.ctx.graph_ns, state.tools)
        return state.marked(error_message(state.request.tool_call, ABANDONED), abandoned=True)
    if action == "edit_args":
        state.args = dict(decision.args or {})
    state.attempts, state.first_failed_at = 0, None
    return None
