"""``RecoveryMiddleware``: the sync and async drivers of the flow in :mod:`._flow`."""

from __future__ import annotations

import contextlib
import inspect
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, cast

from langchain.agents.middleware import AgentMiddleware
from langchain.agents.middleware.types import ExtendedModelResponse, ModelRequest, ModelResponse
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.errors import GraphBubbleUp
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command, interrupt

from taskpilots_graph import _clock
from taskpilots_graph.agent import DEFAULT_LEASE_TTL
from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.checkpointers.base import EventRecord, prepare_event
from taskpilots_graph.conversation import valid_conversation
from taskpilots_graph.errors import ConfigurationError, LedgerConflict
from taskpilots_graph.events import EventKind
from taskpilots_graph.ledger import LedgerEntry
from taskpilots_graph.locks.base import LeaseBackend
from taskpilots_graph.middleware._compensate import acompensate, compensate
from taskpilots_graph.middleware._flow import Flow, tool_flow
from taskpilots_graph.middleware._leases import StepLeases
from taskpilots_graph.middleware._owner import check_middleware, middleware_chain
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
from taskpilots_graph.nodes._await import aawait_owner, await_owner
from taskpilots_graph.nodes._context import RunContext, load_message, messages_digest, run_context
from taskpilots_graph.nodes._locks import CallLocks
from taskpilots_graph.nodes._protocol import (
    SUMMARY_CHARS,
    AwaitOwner,
    FindRepeat,
    ReadEntry,
    WriteEntry,
    WriteEvent,
)
from taskpilots_graph.nodes.executor import acall_precheck, call_precheck
from taskpilots_graph.policy import ToolPolicy
from taskpilots_graph.tools import reset_invocation, set_invocation
from taskpilots_graph.unfinished import areconcile_orphans, orphan_intents, reconcile_orphans

__all__ = ["RecoveryMiddleware"]

ToolHandler = Callable[[ToolCallRequest], ToolMessage | Command[Any]]
AsyncToolHandler = Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]]
_RECORDED_MAX = 4096
_SCRATCHPAD = "__pregel_scratchpad"  # LangGraph's per-task state, holding resume values


def _answer_waiting(config: RunnableConfig) -> bool:
    """Whether this task runs again with a person's answer to one of its interrupts."""
    pad = (config.get("configurable") or {}).get(_SCRATCHPAD)
    if pad is None:
        return False
    return bool(getattr(pad, "resume", None)) or pad.get_null_resume(False) is not None


def _first_ai(response: Any) -> AIMessage | None:
    if isinstance(response, ExtendedModelResponse):
        response = response.model_response
    if isinstance(response, AIMessage):
        return response
    for message in getattr(response, "result", ()):
        if isinstance(message, AIMessage):
            return message
    return None


class RecoveryMiddleware(AgentMiddleware[Any, Any, Any]):
    """Duplicate-free recovery for a langchain ``create_agent`` agent, in one middleware.

    Every tool call goes through the side-effect ledger and the tool policies, as in
    :func:`~taskpilots_graph.create_recovery_agent` (see the package docstring for what
    happens and how it composes with langchain's own middleware)::

        with tp.RecoveryCheckpointer.from_conn_string("sqlite:///runs.db") as cp:
            agent = create_agent(model, tools, checkpointer=cp,
                                 middleware=[tp.RecoveryMiddleware(cp)])
            agent.invoke({"messages": [("user", goal)]}, {"configurable": {"thread_id": "t-1"}})

    Args:
        checkpointer: The :class:`~taskpilots_graph.RecoveryCheckpointer` (or async one) the
            agent is created with; ledger and events live in its database.
        policies: Recovery policies by tool name; others use ``default_policy``.
        default_policy: The policy of tools without one (default ``ToolPolicy()``).
        rng: Source of backoff jitter (tests pass a seeded one).
        leases: Lease backend for the thread lease and ``lock=`` business locks; the
            checkpointer's own database when omitted (Redis for scale-out).
        lease_ttl: TTL in seconds of those leases (renewed every third of it); also the
            longest a call waits for a business lock or for another runner's live intent.

    Raises:
        ConfigurationError: For a checkpointer that is not a recovery checkpointer or a
            policy that is not a ``ToolPolicy``; at the first call of a tool, for a second
            retry owner (:func:`~taskpilots_graph.middleware.check_middleware`).
    """

    def __init__(
        self,
        checkpointer: RecoveryAPI,
        *,
        policies: Mapping[str, ToolPolicy] | None = None,
        default_policy: ToolPolicy | None = None,
        rng: random.Random | None = None,
        leases: LeaseBackend | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
    ) -> None:
        super().__init__()
        if not isinstance(checkpointer, RecoveryAPI):
            raise ConfigurationError(
                "RecoveryMiddleware needs the RecoveryCheckpointer or "
                f"AsyncRecoveryCheckpointer the agent runs with, got {type(checkpointer).__name__}"
            )
        for name, policy in (policies or {}).items():
            if not isinstance(policy, ToolPolicy):
                raise ConfigurationError(f"policies[{name!r}] must be a tp.ToolPolicy(...)")
        if default_policy is not None and not isinstance(default_policy, ToolPolicy):
            raise ConfigurationError("default_policy must be a tp.ToolPolicy(...)")
        self.checkpointer = checkpointer
        self.policies: dict[str, ToolPolicy] = dict(policies or {})
        self.default_policy = default_policy or ToolPolicy()
        self._settings = Settings(self.policies, self.default_policy, rng or random.Random())
        self._checked: set[tuple[bool, str]] = set()
        self._recorded: set[tuple[str, str]] = set()
        if not isinstance(lease_ttl, int | float) or not math.isfinite(lease_ttl) or lease_ttl <= 0:
            raise ConfigurationError(f"lease_ttl must be a positive number, got {lease_ttl!r}")
        self.leases = leases
        self.lease_ttl = float(lease_ttl)
        self._steps = StepLeases(self.lease_backend, self.alease_backend, self.lease_ttl)
        # Threads whose run started with orphan intents in the ledger: settled at the first
        # model call, where the tools (and so their pre-checks) are at hand.
        self._orphaned: set[str] = set()

    def lease_backend(self) -> LeaseBackend:
        """Where thread leases and business locks live: the backend named with ``leases=``,
        else the checkpointer's own database."""
        return self.leases if self.leases is not None else self.checkpointer.lease_backend()

    async def alease_backend(self) -> LeaseBackend:
        """Async form of :meth:`lease_backend`."""
        if self.leases is not None:
            return self.leases
        return await self.checkpointer.alease_backend()

    @property
    def tools(self) -> list[BaseTool]:  # type: ignore[override]
        """No tools of its own; reading it from ``create_agent`` checks the retry owner.

        ``create_agent`` reads every middleware's ``tools`` once, while it builds the agent:
        the only moment the whole middleware list is at hand. An outer
        ``ToolRetryMiddleware`` would swallow an error raised later, at the first call
        (it retries every exception and hands the last one to the model as a message).
        """
        frame = inspect.currentframe()
        for _ in range(4):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                break
            if frame.f_code.co_name == "create_agent" and "middleware" in frame.f_locals:
                middleware = frame.f_locals["middleware"]
                tools = frame.f_locals.get("tools") or ()
                check_middleware(list(middleware), [t for t in tools if isinstance(t, BaseTool)])
                break
        del frame  # frames hold their locals alive
        return []

    def policy(self, tool: str | None) -> ToolPolicy:
        """The policy that applies to ``tool`` (``None``: the default policy)."""
        return self.policies.get(tool, self.default_policy) if tool else self.default_policy

    # -- shared --------------------------------------------------------------------------------

    def _check_owner(self, request: ToolCallRequest, handler: Any, *, is_async: bool) -> None:
        name = request.tool_call["name"]
        if (is_async, name) in self._checked:
            return
        chain = middleware_chain(handler, is_async=is_async)
        if chain is not None:
            tools = [t for t in getattr(request.runtime, "tools", None) or () if t.name == name]
            check_middleware(chain, tools or [name])
        self._checked.add((is_async, name))

    def _flow(self, request: ToolCallRequest) -> tuple[Flow, RunContext]:
        config = request.runtime.config
        ctx = run_context(config)
        task_ns = str((config.get("configurable") or {}).get("checkpoint_ns") or "")
        flow = tool_flow(
            self._settings, request, ctx, task_ns=task_ns, answered=_answer_waiting(config)
        )
        return flow, ctx

    def _write(self, request: WriteEntry, pending: list[EventRecord]) -> Any:
        events = [*pending, request.event]
        pending.clear()
        try:
            return self.checkpointer.write_ledger(
                request.entry, expect=request.expect, events=events
            )
        except LedgerConflict:
            pending[:0] = events[:-1]  # nothing was written: keep them
            raise

    async def _awrite(self, request: WriteEntry, pending: list[EventRecord]) -> Any:
        events = [*pending, request.event]
        pending.clear()
        try:
            return await self.checkpointer.awrite_ledger(
                request.entry, expect=request.expect, events=events
            )
        except LedgerConflict:
            pending[:0] = events[:-1]
            raise

    def _ledger_view(self, entries: list[LedgerEntry], extra: LedgerEntry | None) -> Any:
        if extra is not None and all(e.key != extra.key for e in entries):
            entries.append(extra)  # a business key first recorded by another thread
        return entries

    def _recorded_before(self, req: RecordDecision) -> bool:
        # Parallel calls of one model message each ask to record it; the store keeps the
        # first anyway, the mark saves the repeated writes. It is set only once the record
        # is durable (_mark_recorded): a call that finds it may act at once, and one that
        # does not, while another call is still writing, records again rather than act
        # before the message is on disk.
        return (req.thread_id, req.digest) in self._recorded

    def _mark_recorded(self, req: RecordDecision) -> None:
        if len(self._recorded) >= _RECORDED_MAX:  # bounded: a worker runs many threads
            self._recorded.clear()
        self._recorded.add((req.thread_id, req.digest))

    def _model_context(self) -> RunContext | None:
        try:
            return run_context(get_config())
        except (RuntimeError, ConfigurationError):
            return None  # outside a run, or a run without a thread: nothing to record

    def _decided(self, ctx: RunContext, ai: AIMessage | None, *, replayed: bool) -> None:
        if ai is None or not ai.tool_calls:
            return
        event = prepare_event(
            ctx.thread_id,
            EventKind.LLM_DECIDED,
            {
                "tool_calls": [
                    {"name": c["name"], "id": c["id"], "args": c["args"]} for c in ai.tool_calls
                ],
                "content": str(ai.content)[:SUMMARY_CHARS],
                "replayed": replayed,
            },
            checkpoint_id=None,
            checkpoint_ns=ctx.graph_ns,
        )
        self.checkpointer.defer_records([event])

    # -- sync driver ---------------------------------------------------------------------------

    def wrap_tool_call(self, request: ToolCallRequest, handler: ToolHandler) -> Any:
        """Run one tool call through the ledger, the tool policy and takeover."""
        self._check_owner(request, handler, is_async=False)
        flow, ctx = self._flow(request)
        pending: list[EventRecord] = []
        value: Any = None
        thrown: BaseException | None = None
        locks = CallLocks(ctx.thread_id, self.lease_ttl)
        try:
            with self._steps.step(ctx.thread_id, ctx.checkpoint_id), contextlib.ExitStack() as held:
                while True:
                    try:
                        req = flow.throw(thrown) if thrown is not None else flow.send(value)
                    except StopIteration as stop:
                        result = stop.value
                        break
                    value, thrown = None, None
                    try:
                        if isinstance(req, WriteEntry):
                            req = replace(
                                req, entry=locks.before_write(req.entry, self.lease_backend, held)
                            )
                        elif isinstance(req, CallTool) and req.invocation is not None:
                            req = replace(req, invocation=locks.before_call(req.invocation))
                        value = self._do(req, handler, pending)
                    except Exception as exc:  # handed to the flow, which lets control flow through
                        thrown = exc
        except BaseException:
            self.checkpointer.append_records(pending, flush=ctx.thread_id)
            raise
        # Pure-tool events ride along with the thread's next durable write (the next model
        # call flushes them at the latest).
        self.checkpointer.defer_records(pending)
        return result

    def _do(self, req: Any, handler: ToolHandler, pending: list[EventRecord]) -> Any:
        cp = self.checkpointer
        if isinstance(req, CallTool):
            token = set_invocation(req.invocation)
            try:
                answer = handler(req.request)
            finally:
                reset_invocation(token)
            if isinstance(answer, ToolMessage) and answer.status == "error" and req.invocation:
                raise ErrorAnswer(answer)
            return answer
        if isinstance(req, FindRepeat):
            return cp.committed_effect(req.thread_id, req.tool, req.args_digest)
        if isinstance(req, ReadEntry):
            return cp.ledger_entry(req.key)
        if isinstance(req, AwaitOwner):
            return await_owner(
                req, backend=self.lease_backend(), read=cp.ledger_entry, timeout=self.lease_ttl
            )
        if isinstance(req, WriteEntry):
            return self._write(req, pending)
        if isinstance(req, WriteEvent):
            pending.append(req.event)
            return None
        if isinstance(req, CheckEffect):
            return call_precheck(req.ctx, req.request)
        if isinstance(req, Sleep):
            _clock.sleep(req.seconds)
            return None
        if isinstance(req, Ask):
            try:
                return interrupt(req.payload)
            except GraphBubbleUp:
                pending.append(req.event)  # the run pauses: the request is on record
                raise
        if isinstance(req, ReadLedger):
            extra = cp.ledger_entry(req.key) if req.key else None
            return self._ledger_view(cp.ledger(req.thread_id), extra)
        if isinstance(req, RecordDecision):
            if not self._recorded_before(req):
                cp.record_decision(req.thread_id, req.checkpoint_ns, req.digest, req.message)
                self._mark_recorded(req)
            return None
        if isinstance(req, Compensate):
            compensate(
                cp,
                req.thread_id,
                req.checkpoint_ns,
                req.tools,
                leases=self.lease_backend(),
                lease_ttl=self.lease_ttl,
            )
            return None
        if isinstance(req, Flush):
            if pending:
                cp.append_records(list(pending))
                pending.clear()
            return None
        raise AssertionError(f"unknown request {req!r}")  # pragma: no cover

    def wrap_model_call(
        self, request: ModelRequest[Any], handler: Callable[[ModelRequest[Any]], Any]
    ) -> Any:
        """Replay a recorded model decision after a crash; make tool events durable.

        The provider never gets a tool call without its answer (new input on a thread that
        stopped mid-call would otherwise be rejected): see :func:`_answered`.
        """
        request = _answered(request)
        ctx = self._model_context()
        if ctx is None:
            return handler(request)
        with self._steps.step(ctx.thread_id, ctx.checkpoint_id):
            return self._model_call(ctx, request, handler)

    def _model_call(
        self,
        ctx: RunContext,
        request: ModelRequest[Any],
        handler: Callable[[ModelRequest[Any]], Any],
    ) -> Any:
        cp = self.checkpointer
        if ctx.thread_id in self._orphaned:
            self._orphaned.discard(ctx.thread_id)
            reconcile_orphans(None, cp, ctx.thread_id, tools=_tool_table(request))
        cp.append_records([], flush=ctx.thread_id)
        if ctx.durability != "sync":
            digest = messages_digest(list(request.state.get("messages") or []))
            recorded = cp.decision(ctx.thread_id, ctx.graph_ns, digest)
            if recorded is not None:
                ai = load_message(recorded)
                assert isinstance(ai, AIMessage)
                self._decided(ctx, ai, replayed=True)
                return ModelResponse(result=[ai])
        response = handler(request)
        self._decided(ctx, _first_ai(response), replayed=False)
        return response

    def before_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Note a thread whose earlier run stopped with effects of unknown outcome.

        ``create_agent`` starts new input at the model, and LangGraph drops the tasks the
        stopped run left: the model could decide the same effect again under a new
        tool-call id (a new key). The orphan intents are settled (pre-check, or a person)
        before the model's first call of this run, so whatever it decides meets a settled
        entry and the repeat guard. Costs one ledger read per run.
        """
        ctx = self._model_context()
        if ctx is not None and orphan_intents(self.checkpointer.ledger(ctx.thread_id)):
            self._orphaned.add(ctx.thread_id)
        return None

    def after_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Make the run's last buffered events durable before it returns."""
        ctx = self._model_context()
        if ctx is not None:
            self.checkpointer.append_records([], flush=ctx.thread_id)
        return None

    # -- async driver --------------------------------------------------------------------------

    async def awrap_tool_call(self, request: ToolCallRequest, handler: AsyncToolHandler) -> Any:
        """Async form of :meth:`wrap_tool_call`."""
        self._check_owner(request, handler, is_async=True)
        flow, ctx = self._flow(request)
        pending: list[EventRecord] = []
        value: Any = None
        thrown: BaseException | None = None
        locks = CallLocks(ctx.thread_id, self.lease_ttl)
        try:
            async with (
                self._steps.astep(ctx.thread_id, ctx.checkpoint_id),
                contextlib.AsyncExitStack() as held,
            ):
                while True:
                    try:
                        req = flow.throw(thrown) if thrown is not None else flow.send(value)
                    except StopIteration as stop:
                        result = stop.value
                        break
                    value, thrown = None, None
                    try:
                        if isinstance(req, WriteEntry):
                            entry = await locks.abefore_write(req.entry, self.alease_backend, held)
                            req = replace(req, entry=entry)
                        elif isinstance(req, CallTool) and req.invocation is not None:
                            req = replace(req, invocation=locks.before_call(req.invocation))
                        value = await self._ado(req, handler, pending)
                    except Exception as exc:
                        thrown = exc
        except BaseException:
            await self.checkpointer.aappend_records(pending, flush=ctx.thread_id)
            raise
        self.checkpointer.defer_records(pending)
        return result

    async def _ado(self, req: Any, handler: AsyncToolHandler, pending: list[EventRecord]) -> Any:
        cp = self.checkpointer
        if isinstance(req, CallTool):
            token = set_invocation(req.invocation)
            try:
                answer = await handler(req.request)
            finally:
                reset_invocation(token)
            if isinstance(answer, ToolMessage) and answer.status == "error" and req.invocation:
                raise ErrorAnswer(answer)
            return answer
        if isinstance(req, FindRepeat):
            return await cp.acommitted_effect(req.thread_id, req.tool, req.args_digest)
        if isinstance(req, ReadEntry):
            return await cp.aledger_entry(req.key)
        if isinstance(req, AwaitOwner):
            backend = await self.alease_backend()
            return await aawait_owner(
                req, backend=backend, read=cp.aledger_entry, timeout=self.lease_ttl
            )
        if isinstance(req, WriteEntry):
            return await self._awrite(req, pending)
        if isinstance(req, CheckEffect):
            return await acall_precheck(req.ctx, req.request)
        if isinstance(req, Sleep):
            await _clock.asleep(req.seconds)
            return None
        if isinstance(req, ReadLedger):
            extra = await cp.aledger_entry(req.key) if req.key else None
            return self._ledger_view(await cp.aledger(req.thread_id), extra)
        if isinstance(req, RecordDecision):
            if not self._recorded_before(req):
                await cp.arecord_decision(req.thread_id, req.checkpoint_ns, req.digest, req.message)
                self._mark_recorded(req)
            return None
        if isinstance(req, Compensate):
            await acompensate(
                cp,
                req.thread_id,
                req.checkpoint_ns,
                req.tools,
                leases=await self.alease_backend(),
                lease_ttl=self.lease_ttl,
            )
            return None
        if isinstance(req, Flush):
            if pending:
                await cp.aappend_records(list(pending))
                pending.clear()
            return None
        # WriteEvent and Ask need no I/O of their own: the sync driver's code does.
        return self._do(req, _no_handler, pending)

    async def awrap_model_call(
        self,
        request: ModelRequest[Any],
        handler: Callable[[ModelRequest[Any]], Awaitable[Any]],
    ) -> Any:
        """Async form of :meth:`wrap_model_call`."""
        request = _answered(request)
        ctx = self._model_context()
        if ctx is None:
            return await handler(request)
        async with self._steps.astep(ctx.thread_id, ctx.checkpoint_id):
            return await self._amodel_call(ctx, request, handler)

    async def _amodel_call(
        self,
        ctx: RunContext,
        request: ModelRequest[Any],
        handler: Callable[[ModelRequest[Any]], Awaitable[Any]],
    ) -> Any:
        cp = self.checkpointer
        if ctx.thread_id in self._orphaned:
            self._orphaned.discard(ctx.thread_id)
            await areconcile_orphans(None, cp, ctx.thread_id, tools=_tool_table(request))
        await cp.aappend_records([], flush=ctx.thread_id)
        if ctx.durability != "sync":
            digest = messages_digest(list(request.state.get("messages") or []))
            recorded = await cp.adecision(ctx.thread_id, ctx.graph_ns, digest)
            if recorded is not None:
                ai = load_message(recorded)
                assert isinstance(ai, AIMessage)
                self._decided(ctx, ai, replayed=True)
                return ModelResponse(result=[ai])
        response = await handler(request)
        self._decided(ctx, _first_ai(response), replayed=False)
        return response

    async def abefore_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Async form of :meth:`before_agent`."""
        ctx = self._model_context()
        if ctx is not None and orphan_intents(await self.checkpointer.aledger(ctx.thread_id)):
            self._orphaned.add(ctx.thread_id)
        return None

    async def aafter_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Async form of :meth:`after_agent`."""
        ctx = self._model_context()
        if ctx is not None:
            await self.checkpointer.aappend_records([], flush=ctx.thread_id)
        return None


def _tool_table(request: ModelRequest[Any]) -> dict[str, BaseTool]:
    """The agent's tools by name, as the model request carries them."""
    return {t.name: t for t in request.tools if isinstance(t, BaseTool)}


def _answered(request: ModelRequest[Any]) -> ModelRequest[Any]:
    """The model request with every tool call answered before the next message.

    Only what the provider is sent changes; the state (and the digest of recorded
    decisions, taken from the state) stays as it is.
    """
    fixed = valid_conversation(request.messages)
    if fixed == request.messages:
        return request
    return request.override(messages=cast(Any, fixed))  # AnyMessage: the same messages


def _no_handler(request: ToolCallRequest) -> ToolMessage:  # pragma: no cover - never called
    raise AssertionError("tool calls are driven by the async driver")
