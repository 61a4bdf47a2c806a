"""What :class:`RecoveryMiddleware` does with one tool call, as an I/O-free generator.

The flow wraps the ledger protocol of :mod:`taskpilots_graph.nodes._protocol` (which it
drives unchanged) with the recovery decisions of :func:`~taskpilots_graph.decide_recovery`
and the takeover of a person. It yields requests; the sync and async drivers in
:mod:`taskpilots_graph.middleware._middleware` carry them out, so both share one copy of the
rules.

A takeover calls LangGraph's ``interrupt()`` inside the tool node. On resume the node runs
again from its first line, so the flow runs again from its start: ledger facts keep that
safe (a committed effect is returned, an uncertain one escalates without executing), and a
decision applied once is recorded on the ledger entry with the ordinal of its interrupt in
the task, so it is never applied twice.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from langchain_core.messages import BaseMessage, ToolCall, ToolMessage
from langchain_core.tools import BaseTool
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from taskpilots_graph import _clock
from taskpilots_graph.checkpointers.base import EventRecord, prepare_event
from taskpilots_graph.errors import ConfigurationError, ToolWaiting
from taskpilots_graph.events import EventKind
from taskpilots_graph.failures import Failure, classify, failure_payload
from taskpilots_graph.ledger import LedgerEntry, SideEffectUncertain, default_key
from taskpilots_graph.middleware._requests import (
    Ask,
    CallTool,
    CheckEffect,
    Compensate,
    ErrorAnswer,
    Flush,
    ReadLedger,
    RecordDecision,
    Settings,
    Sleep,
)
from taskpilots_graph.nodes._context import RunContext, dump_message, messages_digest
from taskpilots_graph.nodes._protocol import (
    CallContext,
    CallOutcome,
    CheckArgs,
    RunPrecheck,
    RunTool,
    WriteEntry,
    WriteEvent,
    run_call,
)
from taskpilots_graph.nodes.executor import error_message, tool_content
from taskpilots_graph.nodes.router import describe
from taskpilots_graph.nodes.takeover import _ledger_move, _user, build_request
from taskpilots_graph.policy import ToolPolicy
from taskpilots_graph.recovery import Action, decide_recovery
from taskpilots_graph.takeover import parse_decision
from taskpilots_graph.tools import check_args, spec_of

__all__ = ["DECISIONS", "Answer", "Flow", "tool_flow"]

DECISIONS = "middleware_decisions"
"""Key in ``LedgerEntry.extra``: ``{task namespace: decisions applied}`` (see the module)."""

FAILURE_MARK = "taskpilots_failure"
"""Key in an error answer's ``artifact``: the failure's signature (tool, kind, error type)."""

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


def _ledgered(
    ctx: CallContext, request: ToolCallRequest, box: list[Answer]
) -> Generator[Any, Any, CallOutcome]:
    """The ledger protocol with ``RunTool`` turned into :class:`CallTool`.

    The tool node's answer is kept in ``box`` (returned to the model on a fresh success)
    while the protocol records the answer's content. ``CheckArgs`` is answered here (no
    I/O): the arguments are checked against the schema of the tool the node would run.
    """
    gen = run_call(ctx)
    value: Any = None
    thrown: BaseException | None = None
    while True:
        try:
            req = gen.throw(thrown) if thrown is not None else gen.send(value)
        except StopIteration as stop:
            outcome: CallOutcome = stop.value
            return outcome
        value, thrown = None, None
        if isinstance(req, CheckArgs):
            try:
                if request.tool is not None:
                    check_args(request.tool, req.args)
            except Exception as exc:
                thrown = exc
            continue
        if isinstance(req, RunTool):
            try:
                answer = yield CallTool(request, req.invocation)
            except ErrorAnswer as exc:
                # The arguments passed CheckArgs: the node's error answer comes from the body.
                thrown = ErrorAnswer(exc.answer, maybe_sent=True) if ctx.spec is not None else exc
                continue
            except Exception as exc:  # GraphBubbleUp included: the protocol lets it through
                thrown = exc
                continue
            box[:] = [answer]
            value = answer.content if isinstance(answer, ToolMessage) else answer
            continue
        try:
            value = yield (CheckEffect(ctx, req) if isinstance(req, RunPrecheck) else req)
        except Exception as exc:
            thrown = exc


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
        spec = spec_of(tool) if tool is not None else None
        key = (
            spec.key(dict(self.args))
            if spec is not None and spec.key is not None
            else default_key(
                thread_id=self.ctx.thread_id,
                checkpoint_ns=self.ctx.graph_ns,
                tool_call_id=self.call_id,
                tool=self.using,
                args=self.args,
            )
        )
        return CallContext(
            thread_id=self.ctx.thread_id,
            checkpoint_ns=self.ctx.graph_ns,
            tool=self.using,
            args=dict(self.args),
            tool_call_id=self.call_id,
            spec=spec,
            key=key,
            rules=tuple(policy.rules),
            confirm_drift=policy.confirm_drift or (spec is not None and spec.confirm_drift),
            drift_comparator=(spec.drift_comparator if spec is not None else None)
            or policy.drift_comparator,
            attempt=self.attempts + 1,
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
    answered: bool,
) -> Flow:
    """The flow of one tool call; returns the answer for the model.

    Args:
        settings: Policies and jitter source.
        request: The tool call as the tool node built it.
        ctx: Thread, namespace and durability of the run.
        task_ns: The tool task's own checkpoint namespace (unique per task).
        answered: A person's answer waits for this task (a resumed takeover): in-process
            backoff is skipped on the way back to it.
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
        answered=answered,
    )
    if state.using not in tools:
        # Not ours to handle: the tool node answers an unknown tool with an error message.
        answer: Answer = yield CallTool(request, None)
        return answer
    recorded = False
    while True:
        call_ctx = state.context(settings.policy(state.using))
        if call_ctx.spec is not None and ctx.durability != "sync" and not recorded:
            recorded = True
            yield from _record_decision(state)
        box: list[Answer] = []
        try:
            outcome = yield from _ledgered(call_ctx, state.tool_request(), box)
        except SideEffectUncertain as exc:
            outcome = CallOutcome(error=exc, failure=classify(exc))
        state.attempts += 1
        if outcome.failure is None:
            if box and not outcome.replayed:
                return box[0]
            return _answer(state.call_id, state.name, outcome.result)
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
    policy = settings.policy(state.using)
    chain = settings.policy(state.name).fallback
    tried = [*state.tried, state.using]
    next_fallback = next((t for t in chain if t not in tried), None)
    signature = f"{state.using}|{failure.kind}|{failure.error_type}"
    decision = decide_recovery(
        kind=failure.kind,
        policy=policy,
        attempts=state.attempts,
        first_failed_at=state.first_failed_at,
        now=now,
        retry_after=failure.retry_after,
        next_fallback=next_fallback,
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
    if decision.stuck:
        yield WriteEvent(_event(state.ctx, EventKind.STUCK_DETECTED, **base))
    if action is Action.RETRY:
        assert decision.retry_at is not None
        retry = _event(state.ctx, EventKind.RETRY_SCHEDULED, retry_at=decision.retry_at, **base)
        yield WriteEvent(retry)
        delay = max(0.0, decision.retry_at - now)
        if delay > policy.max_in_process_wait:
            yield Flush()
            raise ToolWaiting(state.ctx.thread_id, decision.retry_at) from outcome.error
        if not state.answered:
            yield Sleep(delay)
        return None
    if action is Action.DEGRADE:
        assert decision.fallback is not None
        if decision.fallback not in state.tools:
            raise ConfigurationError(
                f"policies[{state.name!r}]: fallback {decision.fallback!r} is not one of the "
                "agent's tools; pass it in create_agent(tools=[...]) too"
            )
        yield WriteEvent(_event(state.ctx, EventKind.DEGRADED, fallback=decision.fallback, **base))
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
        return answer.model_copy(update={"artifact": {FAILURE_MARK: signature}})
    if action in (Action.FAIL, Action.COMPENSATE):
        if action is Action.COMPENSATE:
            yield Compensate(state.ctx.thread_id, state.ctx.graph_ns, state.tools)
        yield Flush()
        raise outcome.error
    return (yield from _takeover(state, call_ctx, failure, decision.reason, base))


def _signature_count(state: _Call, signature: str) -> int:
    """How many tool calls of the conversation failed this way, this one included.

    The recovery agent counts signatures in its flow state; here the error answers of
    earlier calls carry them (``FAILURE_MARK``). Retries of one call count once.
    """
    messages = (state.request.state or {}).get("messages") or []
    earlier = {
        m.tool_call_id
        for m in messages
        if isinstance(m, ToolMessage)
        and isinstance(m.artifact, dict)
        and m.artifact.get(FAILURE_MARK) == signature
        and m.tool_call_id != state.call_id
    }
    return len(earlier) + 1


def _takeover(
    state: _Call,
    call_ctx: CallContext,
    failure: Failure,
    reason: str,
    base: dict[str, Any],
) -> Generator[Any, Any, Answer | None]:
    key = call_ctx.key if call_ctx.spec is not None else None
    ledger: list[LedgerEntry] = yield ReadLedger(state.ctx.thread_id, key)
    record = {
        "tool_call_id": state.call_id,
        "tool": state.name,
        "using": state.using,
        "args": dict(state.args),
        "attempts": state.attempts,
        "key": key,
        "status": "awaiting_human",
        "failure": failure_payload(failure),
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
    event = _event(state.ctx, EventKind.TAKEOVER_REQUESTED, key=key, args=dict(state.args), **base)
    ordinal = state.asked
    state.asked += 1
    decision = parse_decision((yield Ask(payload, event)))
    entry = next((e for e in ledger if e.key == key), None) if key else None
    applied = (
        entry is not None
        and int(dict(entry.extra.get(DECISIONS) or {}).get(state.task_ns, 0)) > ordinal
    )
    if not applied:
        who = decision.decided_by or _user()
        recorded = _event(
            state.ctx,
            EventKind.DECISION_RECORDED,
            decision=decision.model_dump(mode="json", exclude_none=True),
            decided_by=who,
            steps=[state.call_id],
        )
        moved = _ledger_move(entry, decision, who, datetime.now(UTC)) if entry is not None else None
        if entry is not None:
            # Mark the entry even when its status stays (abandon), so a re-run of the task
            # knows this answer was applied.
            after = replace(
                moved or entry,
                extra={**(moved or entry).extra, DECISIONS: {state.task_ns: ordinal + 1}},
            )
            yield WriteEntry(after, (entry.status, entry.attempt), recorded)
        else:
            yield WriteEvent(recorded)
    action = decision.action
    state.answered = False  # from here on, this execution meets new ground
    if action == "skip":
        return error_message(state.request.tool_call, SKIPPED)
    if action == "provide_result":
        return _answer(state.call_id, state.name, decision.result)
    if action == "abandon":
        yield Compensate(state.ctx.thread_id, state.ctx.graph_ns, state.tools)
        return error_message(state.request.tool_call, ABANDONED)
    if action == "edit_args":
        state.args = dict(decision.args or {})
    state.attempts, state.first_failed_at = 0, None
    return None
