"""``RecoveryMiddleware``: its model-side hooks (the run's start and end, each model call),
and the tool-side hooks of :mod:`._tool_hooks`, which run the flow of :mod:`._flow` through
the engine's drivers."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

from langchain.agents.middleware import AgentMiddleware
from langchain.agents.middleware.types import ExtendedModelResponse, ModelRequest, ModelResponse
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import BaseTool
from langgraph.config import get_config

from taskpilots_graph._compat import create_agent_arguments
from taskpilots_graph._twins import Steps, arun_steps, both, io, run_steps
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.conversation import valid_conversation
from taskpilots_graph.engine._run import (
    answer_text,
    answered,
    decided,
    resume_context,
    run_finished,
    run_started,
)
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import EventRecord
from taskpilots_graph.leases import DEFAULT_LEASE_TTL, LeaseBackend
from taskpilots_graph.middleware._call_state import ABANDONED_MARK
from taskpilots_graph.middleware._leases import StepLeases
from taskpilots_graph.middleware._owner import check_middleware
from taskpilots_graph.middleware._requests import Settings
from taskpilots_graph.middleware._tool_hooks import MARKS_MAX, ToolHooks
from taskpilots_graph.nodes._context import RunContext, load_message, messages_digest, run_context
from taskpilots_graph.nodes.compensate import ABANDONED
from taskpilots_graph.nodes.think import RESUME_KEY, ResumeContext
from taskpilots_graph.policy import ToolPolicy
from taskpilots_graph.prompts.resume import resume_message
from taskpilots_graph.unfinished import areconcile_orphans, orphan_intents, reconcile_orphans

__all__ = ["RecoveryMiddleware"]


class RecoveryMiddleware(ToolHooks, AgentMiddleware[Any, Any, Any]):
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
        self._checked, self._recorded = set(), set()
        self._set_leases(leases, lease_ttl)
        self._steps = StepLeases(self.lease_backend, self.alease_backend, self.lease_ttl)
        # Threads whose run started with orphan intents in the ledger: settled at the first
        # model call, where the tools (and so their pre-checks) are at hand.
        self._orphaned: set[str] = set()
        # Resumes (thread, run_resumed seq) whose prompt a model call already got. A resume
        # marker lives in the config of one run only, so the mark is needed for that run
        # alone (the recovery agent keeps it in its flow state).
        self._resumed: set[tuple[str, Any]] = set()
        self._resume = ResumeContext()
        # ``agent_started`` of a run, noted by ``before_agent`` and deferred by the run's first
        # model call after its flush: it then rides along with the next durable write.
        self._starting: dict[str, EventRecord] = {}
        self._in_agent = False

    @property
    def tools(self) -> list[BaseTool]:  # type: ignore[override]
        """No tools of its own; reading it from ``create_agent`` checks the retry owner.

        ``create_agent`` reads every middleware's ``tools`` once, while it builds the agent:
        the only moment the whole middleware list is at hand. An outer
        ``ToolRetryMiddleware`` would swallow an error raised later, at the first call
        (it retries every exception and hands the last one to the model as a message).
        """
        # Read by create_agent: this middleware runs a whole agent, whose run it logs from
        # start to end (not so inside a ``tp.ToolNode``, which never reads it).
        self._in_agent = True
        found = create_agent_arguments()
        if found is not None:
            middleware, tools = found
            check_middleware(middleware, [t for t in tools if isinstance(t, BaseTool)])
        return []

    def policy(self, tool: str | None) -> ToolPolicy:
        """The policy that applies to ``tool`` (``None``: the default policy)."""
        return self.policies.get(tool, self.default_policy) if tool else self.default_policy

    # -- the model-side hooks ------------------------------------------------------------------

    def _resume_marker(self, ctx: RunContext) -> Mapping[str, Any] | None:
        """The resume this run continues, if no model call of it got the prompt yet."""
        try:
            marker = (get_config().get("configurable") or {}).get(RESUME_KEY)
        except RuntimeError:
            return None
        if not isinstance(marker, Mapping) or (ctx.thread_id, marker.get("seq")) in self._resumed:
            return None
        return marker

    def wrap_model_call(
        self, request: ModelRequest[Any], handler: Callable[[ModelRequest[Any]], Any]
    ) -> Any:
        """Replay a recorded model decision after a crash; make tool events durable.

        The provider never gets a tool call without its answer (new input on a thread that
        stopped mid-call would otherwise be rejected): see :func:`_answered`.
        """
        return run_steps(self._wrap_model_call(request, handler))

    async def awrap_model_call(
        self,
        request: ModelRequest[Any],
        handler: Callable[[ModelRequest[Any]], Awaitable[Any]],
    ) -> Any:
        """Async form of :meth:`wrap_model_call`."""
        return await arun_steps(self._wrap_model_call(request, handler))

    def _wrap_model_call(
        self, request: ModelRequest[Any], handler: Callable[..., Any]
    ) -> Steps[Any]:
        request = _answered(request)
        ctx = _run_context()
        if ctx is None:
            return (yield both(handler, handler, request))
        stopped = _stopped(request)
        if stopped is not None:
            return stopped
        return (yield from self._held(ctx, self._model_call(ctx, request, handler)))

    def _model_call(
        self, ctx: RunContext, request: ModelRequest[Any], handler: Callable[..., Any]
    ) -> Steps[Any]:
        cp, thread_id = self.checkpointer, ctx.thread_id
        if thread_id in self._orphaned:
            self._orphaned.discard(thread_id)
            tools = {t.name: t for t in request.tools if isinstance(t, BaseTool)}
            yield both(reconcile_orphans, areconcile_orphans, None, cp, thread_id, tools=tools)
        yield io(cp, "append_records", [], flush=thread_id)
        # The run's start after the flush, so that the event costs no transaction of its own.
        started = self._starting.pop(thread_id, None)
        if started is not None:
            cp.defer_records([started])
        marker = self._resume_marker(ctx)
        if ctx.durability != "sync" or marker is not None:
            # The model's recorded decision for this conversation, answered without a call;
            # its digest is of the conversation in the state.
            digest = messages_digest(list(request.state.get("messages") or []))
            recorded = yield io(cp, "decision", thread_id, ctx.graph_ns, digest)
            if recorded is not None:
                ai = load_message(recorded)
                assert isinstance(ai, AIMessage)
                cp.defer_records(_decision(ctx, ai, replayed=True))
                return ModelResponse(result=[ai])  # the resume prompt waits for a real call
        if marker is not None:
            # The resume prompt after the conversation, as the recovery agent's think node
            # gives it; only the model sees it (the state stays as it is).
            ledger = yield io(cp, "ledger", thread_id)
            prompt, refreshed = resume_message(
                request.state, request.messages, ledger, marker, self._resume
            )
            text = str(prompt.content)
            cp.defer_records([resume_context(thread_id, ctx.graph_ns, text, refreshed)])
            request = request.override(messages=[*request.messages, prompt])
        response = yield both(handler, handler, request)
        # Only once the model answered with the prompt: a failed call leaves it pending.
        if marker is not None:
            if len(self._resumed) >= MARKS_MAX:
                self._resumed.clear()
            self._resumed.add((thread_id, marker.get("seq")))
        cp.defer_records(_decision(ctx, _first_ai(response), replayed=False))
        return response

    def before_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Note a thread whose earlier run stopped with effects of unknown outcome.

        ``create_agent`` starts new input at the model, and LangGraph drops the tasks the
        stopped run left: the model could decide the same effect again under a new
        tool-call id (a new key). The orphan intents are settled (pre-check, or a person)
        before the model's first call of this run, so whatever it decides meets a settled
        entry and the repeat guard. Costs one ledger read per run.
        """
        return run_steps(self._before_agent(state))

    async def abefore_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Async form of :meth:`before_agent`."""
        return await arun_steps(self._before_agent(state))

    def _before_agent(self, state: Any) -> Steps[None]:
        ctx = _run_context()
        if ctx is not None:
            # A new turn (the input ends on a user's message), logged as the recovery agent's
            # think node logs it, before the model's first decision of the run.
            messages = list(state.get("messages") or [])
            started = run_started(ctx.thread_id, ctx.graph_ns, messages)
            if started is not None:
                if len(self._starting) >= MARKS_MAX:  # a run may never reach its model call
                    self._starting.clear()
                self._starting[ctx.thread_id] = started
            if orphan_intents((yield io(self.checkpointer, "ledger", ctx.thread_id))):
                self._orphaned.add(ctx.thread_id)
        return None

    def after_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Log the end of the run; make its buffered events durable before it returns."""
        return run_steps(self._after_agent(state))

    async def aafter_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Async form of :meth:`after_agent`."""
        return await arun_steps(self._after_agent(state))

    def _after_agent(self, state: Any) -> Steps[None]:
        ctx = _run_context()
        if ctx is None:
            return None
        # ``after_agent`` runs only when the agent loop ends on an answer (a pause for a
        # person or an error leaves before it): the run closed, as the think node logs it.
        messages = list(state.get("messages") or [])
        if messages and getattr(messages[-1], "name", None) == _STOPPED_NAME:
            end = run_finished(ctx.thread_id, ctx.graph_ns, "closed", reason=ABANDONED)
        else:
            answer = answer_text(messages[-1]) if messages else ""
            end = run_finished(ctx.thread_id, ctx.graph_ns, "closed", answer=answer)
        yield io(self.checkpointer, "append_records", [end], flush=ctx.thread_id)
        return None


def _run_context() -> RunContext | None:
    try:
        return run_context(get_config())
    except (RuntimeError, ConfigurationError):
        return None  # outside a run, or a run without a thread: nothing to record


def _decision(ctx: RunContext, ai: AIMessage | None, *, replayed: bool) -> list[EventRecord]:
    """The ``llm_decided`` of a model message; a final answer is logged as the recovery
    agent's think node logs it."""
    if ai is None:
        return []
    if not ai.tool_calls:
        return [answered(ctx.thread_id, ctx.graph_ns, ai)]
    return [decided(ctx.thread_id, ctx.graph_ns, ai, replayed=replayed)]


def _first_ai(response: Any) -> AIMessage | None:
    if isinstance(response, ExtendedModelResponse):
        response = response.model_response
    if isinstance(response, AIMessage):
        return response
    for message in getattr(response, "result", ()):
        if isinstance(message, AIMessage):
            return message
    return None


_STOPPED_NAME = "taskpilots_abandoned"
_STOPPED = (
    "Stopped: a person abandoned this task; committed side effects were undone where possible."
)


def _stopped(request: ModelRequest[Any]) -> AIMessage | None:
    """The run's last answer when a person abandoned it at a call of the last step.

    The recovery agent closes the run once the undo is done, without asking the model
    again; so does this form: the loop ends on this answer (no tool calls), and
    ``after_agent`` logs the run closed for the reason the recovery agent gives.
    """
    for message in reversed(request.state.get("messages") or []):
        if not isinstance(message, ToolMessage):
            return None
        if isinstance(message.artifact, Mapping) and message.artifact.get(ABANDONED_MARK):
            return AIMessage(_STOPPED, name=_STOPPED_NAME)
    return None


def _answered(request: ModelRequest[Any]) -> ModelRequest[Any]:
    """The model request with every tool call answered before the next message.

    Only what the provider is sent changes; the state (and the digest of recorded
    decisions, taken from the state) stays as it is.
    """
    fixed = valid_conversation(request.messages)
    if fixed == request.messages:
        return request
    return request.override(messages=cast(Any, fixed))  # AnyMessage: the same messages
