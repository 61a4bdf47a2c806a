"""The executor ("act") node: runs the model's tool calls, side effects through the ledger.

For every tool call of the last ``AIMessage`` it runs the ledger protocol of
:mod:`taskpilots_graph.nodes._protocol`: a side-effecting tool is intended durably before it
runs and committed after; on a re-run (retry, resume after a crash) the ledger decides
whether to return the recorded result, ask the pre-check, execute again, or stop with
:class:`~taskpilots_graph.ledger.SideEffectUncertain`. It also *observes*: the results become
``ToolMessage``s and a ``step_completed`` event, so the checkpoint LangGraph writes after
this node is the recovery anchor.

Durable writes: each side effect costs two (intent, commit), each carrying its events; the
events of pure tools and of the step are written in one batch at the end of the step.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessage, ToolCall, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.errors import GraphBubbleUp

from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.checkpointers.base import EventRecord, prepare_event
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import EventKind
from taskpilots_graph.ledger import Unknown, default_key
from taskpilots_graph.nodes._context import RunContext, dump_message, messages_digest, run_context
from taskpilots_graph.nodes._protocol import (
    SUMMARY_CHARS,
    CallContext,
    CallOutcome,
    ReadEntry,
    RunPrecheck,
    WriteEntry,
    WriteEvent,
    run_call,
)
from taskpilots_graph.tools import SideEffectTool, reset_invocation, set_invocation, spec_of

__all__ = ["RecoveryExecutor"]


@dataclass
class _Step:
    """One execution of the node: its calls and the events waiting for the next write."""

    ctx: RunContext
    ai: AIMessage
    calls: list[tuple[ToolCall, BaseTool | None, CallContext]]
    pending: list[EventRecord] = field(default_factory=list)

    def take_pending(self) -> list[EventRecord]:
        pending, self.pending = self.pending, []
        return pending


def _content(result: Any) -> str:
    if isinstance(result, str):
        return result
    return json.dumps(result, default=str, ensure_ascii=False)


def _tool_message(call: ToolCall, outcome: CallOutcome) -> ToolMessage:
    if outcome.error is not None:
        return ToolMessage(
            content=f"Error: {type(outcome.error).__name__}: {outcome.error}",
            tool_call_id=call["id"] or "",
            name=call["name"],
            status="error",
        )
    return ToolMessage(
        content=_content(outcome.result), tool_call_id=call["id"] or "", name=call["name"]
    )


class RecoveryExecutor:
    """The act node: use it in a ``StateGraph`` whose state has a ``messages`` channel.

    Example:
        >>> builder.add_node("act", RecoveryExecutor(tools, checkpointer=cp).as_runnable())
        ... # doctest: +SKIP

    Args:
        tools: The tools the model may call; ``@side_effect`` tools go through the ledger.
        checkpointer: The recovery checkpointer the graph is compiled with.
    """

    def __init__(self, tools: Sequence[BaseTool], *, checkpointer: RecoveryAPI) -> None:
        if not isinstance(checkpointer, RecoveryAPI):
            raise ConfigurationError(
                "the recovery executor needs a RecoveryCheckpointer or "
                f"AsyncRecoveryCheckpointer, got {type(checkpointer).__name__}"
            )
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ConfigurationError("tool names must be unique")
        self.checkpointer = checkpointer

    # -- shared preparation and completion --------------------------------------------------

    def _prepare(self, state: dict[str, Any], config: RunnableConfig) -> _Step | None:
        messages = state["messages"]
        ai = messages[-1] if messages else None
        if not isinstance(ai, AIMessage) or not ai.tool_calls:
            return None
        ctx = run_context(config)
        calls = []
        for call in ai.tool_calls:
            tool = self.tools.get(call["name"])
            spec = spec_of(tool) if tool is not None else None
            args = dict(call["args"])
            if spec is not None and spec.key is not None:
                key = spec.key(args)
            else:
                key = default_key(
                    thread_id=ctx.thread_id,
                    checkpoint_ns=ctx.graph_ns,
                    tool_call_id=call["id"],
                    tool=call["name"],
                    args=args,
                )
            calls.append(
                (
                    call,
                    tool,
                    CallContext(
                        thread_id=ctx.thread_id,
                        checkpoint_ns=ctx.graph_ns,
                        tool=call["name"],
                        args=args,
                        tool_call_id=call["id"],
                        spec=spec,
                        key=key,
                    ),
                )
            )
        step = _Step(ctx, ai, calls)
        step.pending.append(
            self._event(
                ctx,
                EventKind.LLM_DECIDED,
                tool_calls=[
                    {"name": c["name"], "id": c["id"], "args": c["args"]} for c in ai.tool_calls
                ],
                content=str(ai.content)[:SUMMARY_CHARS],
            )
        )
        return step

    def _needs_decision_record(self, step: _Step) -> bool:
        # With durability "sync" the checkpoint holding the model's message is on disk before
        # this node runs. Otherwise it may not be, and a crash would make the model decide
        # again with new tool-call ids (new keys): record the decision so that the think node
        # replays it instead.
        return step.ctx.durability != "sync" and any(c.spec is not None for _, _, c in step.calls)

    def _finish(self, step: _Step, results: list[tuple[ToolCall, CallOutcome]]) -> dict[str, Any]:
        messages = [_tool_message(call, outcome) for call, outcome in results]
        step.pending.append(
            self._event(
                step.ctx,
                EventKind.STEP_COMPLETED,
                observations=[
                    {
                        "tool": call["name"],
                        "tool_call_id": call["id"],
                        "status": "error" if outcome.error else "ok",
                        "replayed": outcome.replayed,
                        "summary": str(m.content)[:200],
                    }
                    for (call, outcome), m in zip(results, messages, strict=True)
                ],
            )
        )
        return {"messages": messages}

    @staticmethod
    def _event(ctx: RunContext, kind: EventKind, **payload: Any) -> EventRecord:
        return prepare_event(
            ctx.thread_id, kind, payload, checkpoint_id=None, checkpoint_ns=ctx.graph_ns
        )

    @staticmethod
    def _unknown_tool(call: ToolCall) -> CallOutcome:
        return CallOutcome(error=LookupError(f"unknown tool {call['name']!r}"))

    # -- sync driver -------------------------------------------------------------------------

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Run the step synchronously."""
        step = self._prepare(state, config)
        if step is None:
            return {}
        cp = self.checkpointer
        if self._needs_decision_record(step):
            digest = messages_digest(state["messages"][:-1])
            cp.record_decision(step.ctx.thread_id, step.ctx.graph_ns, digest, dump_message(step.ai))
        results = []
        try:
            for call, tool, ctx in step.calls:
                outcome = (
                    self._unknown_tool(call)
                    if tool is None
                    else self._drive(step, ctx, tool, config)
                )
                results.append((call, outcome))
            return self._finish(step, results)
        finally:
            cp.append_records(step.take_pending())

    def _drive(
        self, step: _Step, ctx: CallContext, tool: BaseTool, config: RunnableConfig
    ) -> CallOutcome:
        cp = self.checkpointer
        gen = run_call(ctx)
        value: Any = None
        thrown: Exception | None = None
        while True:
            try:
                request = gen.throw(thrown) if thrown is not None else gen.send(value)
            except StopIteration as stop:
                outcome: CallOutcome = stop.value
                return outcome
            value, thrown = None, None
            if isinstance(request, ReadEntry):
                value = cp.ledger_entry(request.key)
            elif isinstance(request, WriteEntry):
                events = [*step.take_pending(), request.event]
                value = cp.write_ledger(request.entry, expect=request.expect, events=events)
            elif isinstance(request, WriteEvent):
                step.pending.append(request.event)
            elif isinstance(request, RunPrecheck):
                value = _precheck(ctx, request)
            else:
                token = set_invocation(request.invocation)
                try:
                    value = _target(tool).invoke(dict(ctx.args), config)
                except Exception as exc:
                    # Handed to the protocol, which lets LangGraph control flow through.
                    thrown = exc
                finally:
                    reset_invocation(token)

    # -- async driver ------------------------------------------------------------------------

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Run the step asynchronously."""
        step = self._prepare(state, config)
        if step is None:
            return {}
        cp = self.checkpointer
        if self._needs_decision_record(step):
            digest = messages_digest(state["messages"][:-1])
            await cp.arecord_decision(
                step.ctx.thread_id, step.ctx.graph_ns, digest, dump_message(step.ai)
            )
        results = []
        try:
            for call, tool, ctx in step.calls:
                outcome = (
                    self._unknown_tool(call)
                    if tool is None
                    else await self._adrive(step, ctx, tool, config)
                )
                results.append((call, outcome))
            return self._finish(step, results)
        finally:
            await cp.aappend_records(step.take_pending())

    async def _adrive(
        self, step: _Step, ctx: CallContext, tool: BaseTool, config: RunnableConfig
    ) -> CallOutcome:
        cp = self.checkpointer
        gen = run_call(ctx)
        value: Any = None
        thrown: Exception | None = None
        while True:
            try:
                request = gen.throw(thrown) if thrown is not None else gen.send(value)
            except StopIteration as stop:
                outcome: CallOutcome = stop.value
                return outcome
            value, thrown = None, None
            if isinstance(request, ReadEntry):
                value = await cp.aledger_entry(request.key)
            elif isinstance(request, WriteEntry):
                events = [*step.take_pending(), request.event]
                value = await cp.awrite_ledger(request.entry, expect=request.expect, events=events)
            elif isinstance(request, WriteEvent):
                step.pending.append(request.event)
            elif isinstance(request, RunPrecheck):
                value = await _aprecheck(ctx, request)
            else:
                token = set_invocation(request.invocation)
                try:
                    value = await _target(tool).ainvoke(dict(ctx.args), config)
                except Exception as exc:
                    thrown = exc
                finally:
                    reset_invocation(token)


def _target(tool: BaseTool) -> BaseTool:
    # Call the wrapped tool itself, so callbacks see one tool run, not two nested ones.
    return tool.tool if isinstance(tool, SideEffectTool) else tool


def _precheck(ctx: CallContext, request: RunPrecheck) -> Any:
    precheck = ctx.spec.precheck if ctx.spec is not None else None
    assert precheck is not None, "the protocol asks only tools that have a pre-check"
    try:
        return precheck(request.key, request.args)
    except GraphBubbleUp:
        raise
    except Exception as exc:
        # A pre-check that cannot answer is an unknown outcome: fail closed, never execute.
        return Unknown(f"pre-check raised {type(exc).__name__}: {exc}")


async def _aprecheck(ctx: CallContext, request: RunPrecheck) -> Any:
    precheck = ctx.spec.precheck if ctx.spec is not None else None
    assert precheck is not None, "the protocol asks only tools that have a pre-check"
    try:
        answer = precheck(request.key, request.args)
        return await answer if inspect.isawaitable(answer) else answer
    except GraphBubbleUp:
        raise
    except Exception as exc:
        return Unknown(f"pre-check raised {type(exc).__name__}: {exc}")
