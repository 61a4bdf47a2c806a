"""The tool-side hooks of ``RecoveryMiddleware``: each tool call runs the flow of :mod:`._flow`
through the engine's driver, which hands the flow's own requests (:mod:`._requests`) back
here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from langchain_core.messages import ToolMessage
from langgraph.errors import GraphBubbleUp
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command, interrupt

from taskpilots_graph import _clock
from taskpilots_graph._compat import answers_waiting, middleware_chain
from taskpilots_graph._twins import IO, Steps, arun_steps, both, io, run_steps
from taskpilots_graph.engine._drive import LeaseOwner
from taskpilots_graph.engine._requests import RunTool
from taskpilots_graph.events import EventRecord
from taskpilots_graph.ledger import LedgerEntry
from taskpilots_graph.middleware._flow import tool_flow
from taskpilots_graph.middleware._leases import StepLeases
from taskpilots_graph.middleware._owner import check_middleware
from taskpilots_graph.middleware._requests import (
    Ask,
    Compensate,
    EndRun,
    Flush,
    PassThrough,
    ReadAsked,
    ReadLedger,
    RecordDecision,
    Settings,
    Sleep,
    ToolSeat,
    UseTool,
    asked_in,
)
from taskpilots_graph.nodes._context import RunContext, awaits_input, run_context, stored_input
from taskpilots_graph.nodes.compensate import acompensate_thread, compensate_thread
from taskpilots_graph.nodes.think import RESUME_KEY
from taskpilots_graph.tools import spec_of

__all__ = ["MARKS_MAX", "AsyncToolHandler", "ToolHandler", "ToolHooks"]

T = TypeVar("T")
MARKS_MAX = 4096
"""Bound on each set of marks the middleware keeps: a worker runs many threads."""

ToolHandler = Callable[[ToolCallRequest], ToolMessage | Command[Any]]
AsyncToolHandler = Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]]


class ToolHooks(LeaseOwner):
    """``wrap_tool_call`` in its two forms, and the flow's own requests; the thread lease
    each step of the middleware (a tool call, a model call) runs under."""

    _settings: Settings
    _checked: set[tuple[bool, str]]  # (async, tool) whose retry owner was checked
    _recorded: set[tuple[str, str]]  # (thread, digest) of decisions recorded durably
    _in_agent: bool  # the middleware runs a whole agent (not inside a ``tp.ToolNode``)
    _steps: StepLeases

    def _held(self, ctx: RunContext, body: Steps[T]) -> Steps[T]:
        """``body``, run under the thread lease of the step (:class:`._leases.StepLeases`)."""

        def sync() -> T:
            with self._steps.step(ctx.thread_id, ctx.checkpoint_id):
                return run_steps(body)

        async def async_() -> T:
            async with self._steps.astep(ctx.thread_id, ctx.checkpoint_id):
                return await arun_steps(body)

        done: T = yield IO(sync, async_)
        return done

    def wrap_tool_call(self, request: ToolCallRequest, handler: ToolHandler) -> Any:
        """Run one tool call through the ledger, the tool policy and takeover."""
        self._check_owner(request, handler, is_async=False)
        return run_steps(self._tool_call(request, handler))

    async def awrap_tool_call(self, request: ToolCallRequest, handler: AsyncToolHandler) -> Any:
        """Async form of :meth:`wrap_tool_call`."""
        self._check_owner(request, handler, is_async=True)
        return await arun_steps(self._tool_call(request, handler))

    def _check_owner(self, request: ToolCallRequest, handler: Any, *, is_async: bool) -> None:
        name = request.tool_call["name"]
        if (is_async, name) in self._checked:
            return
        chain = middleware_chain(handler, is_async=is_async)
        if chain is not None:
            tools = [t for t in getattr(request.runtime, "tools", None) or () if t.name == name]
            check_middleware(chain, tools or [name])
        self._checked.add((is_async, name))

    def _tool_call(self, request: ToolCallRequest, handler: Callable[..., Any]) -> Steps[Any]:
        cp, config = self.checkpointer, request.runtime.config
        ctx = run_context(config)
        if awaits_input(ctx) and request.tool is not None and spec_of(request.tool) is not None:
            # A side effect waits for its input checkpoint while it is written in the
            # background (see ``stored_input``).
            ctx = yield from stored_input(ctx, cp)
        configurable = config.get("configurable") or {}
        flow = tool_flow(
            self._settings,
            request,
            ctx,
            task_ns=str(configurable.get("checkpoint_ns") or ""),
            answers=answers_waiting(config),
            resumed=RESUME_KEY in configurable,
        )
        seat = ToolSeat()
        pending: list[EventRecord] = []

        def run_tool(req: RunTool) -> Steps[Any]:
            return seat.answered((yield both(handler, handler, seat.request)), req.effect)

        def own(req: Any) -> Steps[Any]:
            return self._request(req, seat, handler, pending)

        driven = self._driven(ctx.thread_id, flow, run_tool, pending, seat.check, own)
        # Pure-tool events ride along with the thread's next durable write (the next model
        # call flushes them at the latest).
        return (yield from self._settled(ctx.thread_id, pending, self._held(ctx, driven)))

    def _request(
        self,
        req: Any,
        seat: ToolSeat,
        handler: Callable[[ToolCallRequest], Any],
        pending: list[EventRecord],
    ) -> Steps[Any]:
        """The middleware's own requests (the engine's driver carries out the protocol's)."""
        cp = self.checkpointer
        if isinstance(req, UseTool):
            return seat.use(req)
        if isinstance(req, PassThrough):
            return (yield both(handler, handler, req.request))
        if isinstance(req, Ask):
            return _ask(req, pending)
        if isinstance(req, ReadAsked):
            return asked_in((yield io(cp, "events", req.thread_id)), req)
        if isinstance(req, ReadLedger):
            extra = (yield io(cp, "ledger_entry", req.key)) if req.key else None
            entries: list[LedgerEntry] = yield io(cp, "ledger", req.thread_id)
            if extra is not None and all(e.key != extra.key for e in entries):
                entries.append(extra)  # a business key first recorded by another thread
            return entries
        if isinstance(req, Sleep):
            yield both(_clock.sleep, _clock.asleep, req.seconds)
        elif isinstance(req, RecordDecision):
            # Parallel calls of one model message each ask to record it; the store keeps the
            # first anyway, the mark saves the repeated writes. It is set only once the record
            # is durable: a call that finds it may act at once, and one that does not, while
            # another call is still writing, records again rather than act before the message
            # is on disk.
            seen = (req.thread_id, req.digest)
            if seen not in self._recorded:
                yield io(
                    cp, "record_decision", req.thread_id, req.checkpoint_ns, req.digest, req.message
                )
                if len(self._recorded) >= MARKS_MAX:
                    self._recorded.clear()
                self._recorded.add(seen)
        elif isinstance(req, Compensate):
            # Inside the tool node, so an uncertain undo asks a person with interrupt().
            yield both(
                compensate_thread,
                acompensate_thread,
                cp,
                req.thread_id,
                req.tools,
                checkpoint_ns=req.checkpoint_ns,
                ask=True,
                leases=self.leases,
                lease_ttl=self.lease_ttl,
            )
        elif isinstance(req, EndRun):
            if self._in_agent:
                pending.append(req.event)
        elif isinstance(req, Flush):
            if pending:
                yield io(cp, "append_records", list(pending))
                pending.clear()
        else:  # pragma: no cover
            raise AssertionError(f"unknown request {req!r}")
        return None


def _ask(req: Ask, pending: list[EventRecord]) -> Any:
    """``interrupt()`` for a person's decision; the request is on record if the run pauses."""
    try:
        return interrupt(req.payload)
    except GraphBubbleUp:
        if req.event is not None:
            pending.append(req.event)
        raise
