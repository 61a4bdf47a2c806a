"""``create_recovery_agent``: a ReAct loop whose tool calls survive failures and crashes."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import merge_configs
from langchain_core.tools import BaseTool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.pregel import Pregel

from taskpilots_graph import unfinished
from taskpilots_graph._compat import node_runnable
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.checkpointers.density import CheckpointDensity, Density
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.guard import aguard_thread, guard_thread
from taskpilots_graph.leases import DEFAULT_LEASE_TTL, LeaseBackend
from taskpilots_graph.locks import adefault_lease_backend, default_lease_backend
from taskpilots_graph.nodes.compensate import CompensateNode
from taskpilots_graph.nodes.executor import RecoveryExecutor, pending_calls
from taskpilots_graph.nodes.router import RecoveryRouter, WaitNode, fail_run
from taskpilots_graph.nodes.takeover import TakeoverNode
from taskpilots_graph.nodes.think import ResumeContext, ThinkNode
from taskpilots_graph.policy import ModelPolicy, ToolPolicy
from taskpilots_graph.state import RecoveryState
from taskpilots_graph.tool_tables import find_executor, node_owner
from taskpilots_graph.tools import spec_of
from taskpilots_graph.window import MemoryWindow, ObservationPolicy

__all__ = ["RecoveryGraph", "check_retry_owner", "create_recovery_agent"]


@dataclass(frozen=True, slots=True)
class LeaseSource:
    """Where a graph's thread lease comes from: the backend (sync and async) and its TTL."""

    backend: Callable[[], LeaseBackend]
    abackend: Callable[[], Awaitable[LeaseBackend]]
    ttl: float


def lease_source(graph: Any) -> LeaseSource | None:
    """How runners of ``graph`` hold its thread lease, or ``None`` for a plain graph.

    The recovery executor's (or ``RecoveryMiddleware``'s) backend, the one named with
    ``leases=`` else the checkpointer's own database, and its TTL; for any other graph
    compiled with a recovery checkpointer, that checkpointer's own backend. A graph compiled
    with a plain LangGraph saver has no lease to hold.
    """
    executor = find_executor(graph)
    if executor is not None:
        return LeaseSource(executor.lease_backend, executor.alease_backend, executor.lease_ttl)
    builder = getattr(graph, "builder", graph)
    for spec in getattr(builder, "nodes", {}).values():
        # RecoveryMiddleware (its after_agent node): matched by what it offers, so that
        # this module needs no langchain import.
        owner = node_owner(spec.runnable)
        if owner is not None and all(
            hasattr(owner, a) for a in ("lease_backend", "alease_backend", "lease_ttl")
        ):
            return LeaseSource(owner.lease_backend, owner.alease_backend, float(owner.lease_ttl))
    cp = getattr(graph, "checkpointer", None)
    if isinstance(cp, RecoveryAPI):
        return LeaseSource(
            lambda: default_lease_backend(cp), lambda: adefault_lease_backend(cp), DEFAULT_LEASE_TTL
        )
    return None


def _root_thread(graph: Pregel[Any, Any], config: RunnableConfig | None) -> str | None:
    """The thread a top-level call runs, or ``None`` (no thread, or a subgraph call).

    A call nested in another graph's run (a non-empty ``checkpoint_ns``) is part of that
    run: the enclosing run answers for the thread, and settles its unfinished work once.
    """
    conf = merge_configs(graph.config, config).get("configurable") or {}
    thread_id = conf.get("thread_id")
    if not thread_id or conf.get("checkpoint_ns"):
        return None
    return str(thread_id)


class RecoveryGraph(CompiledStateGraph[Any, Any, Any, Any]):
    """The compiled recovery agent: LangGraph's graph with its guards inside.

    ``invoke`` / ``stream`` / ``ainvoke`` / ``astream`` (and ``batch``, ``stream_events``,
    which LangGraph routes through them) hold the thread's lease for the whole call, so a
    second runner of the same thread gets :class:`~taskpilots_graph.errors.ThreadBusy` at
    once instead of silently interleaving its writes, whoever calls: ``tp.run`` or plain
    LangGraph code. With the lease held, and before the graph starts, the thread's unfinished
    work is settled (:func:`taskpilots_graph.unfinished.before_run`) and the graph runs with
    the input it returns.

    Only the two streaming methods are overridden: LangGraph's ``invoke`` runs ``stream``
    and ``ainvoke`` runs ``astream``, so every entry point passes here exactly once. The
    guard is re-entrant: under a runner that already holds the lease (``tp.run(...,
    wait=True)``) nothing is acquired again.
    """

    def stream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[Any]:
        """LangGraph's ``stream``, under the thread's lease (see the class docstring)."""
        thread_id = _root_thread(self, config)
        source = lease_source(self) if thread_id is not None else None
        if thread_id is None or source is None:
            yield from super().stream(input, config, **kwargs)
            return
        with guard_thread(source.backend, source.ttl, thread_id, wait=False):
            ready = unfinished.before_run(self, merge_configs(self.config, config), input)
            yield from super().stream(ready, config, **kwargs)

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """Async form of :meth:`stream`."""
        thread_id = _root_thread(self, config)
        source = lease_source(self) if thread_id is not None else None
        if thread_id is None or source is None:
            async for chunk in super().astream(input, config, **kwargs):
                yield chunk
            return
        async with aguard_thread(source.abackend, source.ttl, thread_id, wait=False):
            ready = await unfinished.abefore_run(self, merge_configs(self.config, config), input)
            async for chunk in super().astream(ready, config, **kwargs):
                yield chunk


def guarded(graph: CompiledStateGraph[Any, Any, Any, Any]) -> RecoveryGraph:
    """``graph`` as a :class:`RecoveryGraph` (the same object, with the guarded methods).

    Only methods are added, no state, so the compiled graph is re-classed in place rather
    than rebuilt: rebuilding would go through LangGraph's constructor, which does not take
    back everything ``compile`` set. LangGraph's ``copy`` / ``with_config`` build copies
    with ``self.__class__``, so they stay guarded.
    """
    if not isinstance(graph, RecoveryGraph):
        graph.__class__ = RecoveryGraph
    assert isinstance(graph, RecoveryGraph)
    return graph


def check_retry_owner(
    graph: StateGraph[Any, Any, Any, Any] | CompiledStateGraph[Any, Any, Any, Any],
) -> None:
    """Refuse a graph in which LangGraph's ``RetryPolicy`` would retry a recovery node.

    One layer owns retries: LangGraph re-running the act node would bypass the tool
    policies (attempt budgets, backoff, the ledger's pre-check path) and multiply them.
    Call it on custom graphs built from the recovery nodes; ``create_recovery_agent`` does.

    Raises:
        ConfigurationError: Naming the node, with the fix.
    """
    builder = getattr(graph, "builder", graph)
    for name, spec in getattr(builder, "nodes", {}).items():
        owner = node_owner(spec.runnable)
        if spec.retry_policy and isinstance(owner, RecoveryExecutor | ThinkNode | RecoveryRouter):
            raise ConfigurationError(
                f"node {name!r} runs a recovery node and also has a LangGraph retry_policy; "
                "one layer owns retries: drop retry_policy and set tp.ToolPolicy(max_attempts=...) "
                "for the tool instead"
            )


_DEFAULT_OBSERVATIONS = ObservationPolicy()


def _side_effect_steps(
    tools: Sequence[BaseTool], policies: Mapping[str, ToolPolicy]
) -> frozenset[str]:
    """Tools whose step may run a side effect: side-effecting ones and those falling back
    to one."""
    effects = {t.name for t in tools if spec_of(t) is not None}
    return frozenset(
        effects | {name for name, p in policies.items() if any(f in effects for f in p.fallback)}
    )


def _after_act(state: dict[str, Any]) -> str:
    _, calls = pending_calls(state["messages"])
    return "recover" if calls else "think"


def _node(invoke: Any, ainvoke: Any, name: str) -> Runnable[Any, Any]:
    node: Runnable[Any, Any] = node_runnable(invoke, ainvoke, name)
    return node


def create_recovery_agent(
    model: BaseChatModel,
    tools: Sequence[BaseTool],
    *,
    checkpointer: RecoveryAPI,
    policies: Mapping[str, ToolPolicy] | None = None,
    default_policy: ToolPolicy | None = None,
    model_policy: ModelPolicy | None = None,
    max_steps: int = 50,
    resume_context: ResumeContext | None = None,
    milestones: Mapping[str, Callable[[Mapping[str, Any]], bool]] | None = None,
    prompt: str | None = None,
    name: str = "recovery_agent",
    rng: random.Random | None = None,
    leases: LeaseBackend | None = None,
    lease_ttl: float = DEFAULT_LEASE_TTL,
    observations: ObservationPolicy | None = _DEFAULT_OBSERVATIONS,
    memory_window: MemoryWindow | None = None,
    checkpoint_density: Density = "every_step",
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """Build a think → act loop that continues from the right place after any failure.

    ``think`` asks the model; ``act`` runs its tool calls (``@side_effect`` tools through the
    ledger) and records the observations, so the checkpoint after it is the recovery anchor.
    A failed call goes to ``recover``, which retries that step only (``wait``), degrades to a
    fallback, reports the error to the model, asks a person (``takeover``), undoes committed
    effects (``compensate``) or fails the run (``fail``), as the tool's policy says. The loop
    ends when the model answers without tool calls.

    The compiled graph is a :class:`RecoveryGraph`: its own ``invoke`` / ``stream`` /
    ``ainvoke`` / ``astream`` hold the thread's lease and settle unfinished work first, so
    plain LangGraph calls are as guarded as ``tp.run``.

    Example:
        >>> with tp.RecoveryCheckpointer.from_conn_string("sqlite:///runs.db") as cp:
        ...     graph = tp.create_recovery_agent(
        ...         model, [kb_search, kb_backup, create_ticket], checkpointer=cp,
        ...         policies={"kb_search": tp.ToolPolicy(max_attempts=5, fallback=["kb_backup"])},
        ...     )
        ...     graph.invoke({"messages": [("user", goal)]}, {"configurable": {"thread_id": "t-1"}})
        ... # doctest: +SKIP

    Args:
        model: A chat model supporting ``bind_tools``.
        tools: The tools the model may call, fallbacks included.
        checkpointer: A :class:`RecoveryCheckpointer` or :class:`AsyncRecoveryCheckpointer`.
        policies: Recovery policies by tool name (validated against ``tools`` here).
        default_policy: The policy of tools without one (default: ``ToolPolicy()``).
        model_policy: Fallback models for model failures.
        max_steps: Model decisions per user turn before the run counts as stuck.
        resume_context: How a resumed run is re-anchored (prompt language and budget,
            refreshers of stale data, acknowledgement).
        milestones: Named business milestones (predicates of the state); each is recorded
            the first time it holds and can be a ``rewind`` target.
        prompt: Optional system prompt.
        name: The graph's name.
        rng: Source of backoff jitter (tests pass a seeded one).
        leases: A lease backend (:func:`~taskpilots_graph.locks.lease_backend_from_url`),
            e.g. Redis for scale-out; by default the checkpointer's own database (SQLite
            file, PostgreSQL, or memory). The graph's own ``invoke`` / ``stream`` (and
            ``tp.run`` / ``tp.resume`` / ``tp.decide`` / ``tp.rewind``) hold the thread's
            lease for the whole call (a second runner gets ``ThreadBusy``), every side
            effect first checks it (``LeaseLost`` stops the run), and ``lock=`` tools run
            under their business lock (fail closed).
        lease_ttl: TTL in seconds of those leases and locks (renewed every third of it);
            also the longest a call waits for a business lock, or for another runner's
            live intent on the same key (then ``EffectInProgress``).
        observations: Results above its threshold (4 KB by default) are stored as an
            artifact (``cp.artifact(id)``) and the state, so the model, gets a summary and
            the id. ``None`` keeps every result whole.
        memory_window: A context budget for the model:
            ``taskpilots_graph.window.MemoryWindow(max_tokens=N)`` folds the oldest turns
            (a call with its answer, each as a line naming tool, arguments, outcome and
            ledger key) out of what the model sees once its input exceeds ``N`` tokens.
            ``None`` (default): the model sees its whole conversation. The state keeps
            every message either way.
        checkpoint_density: ``"every_step"``, ``"tool_boundary"`` or ``"milestones"``: which
            checkpoints are stored (see :mod:`taskpilots_graph.checkpointers.density`).
            No density repeats a side effect on resume.

    Raises:
        ConfigurationError: If the checkpointer is not a recovery checkpointer, tool names
            repeat, or a policy does not fit the tools.
    """
    if not isinstance(checkpointer, RecoveryAPI):
        raise ConfigurationError(
            "create_recovery_agent needs checkpointer=RecoveryCheckpointer(...) or "
            f"AsyncRecoveryCheckpointer(...), got {type(checkpointer).__name__}"
        )
    density = CheckpointDensity(
        checkpoint_density,
        side_effect_tools=_side_effect_steps(tools, policies or {}),
        milestones=dict(milestones or {}),
    )
    checkpointer = checkpointer.with_density(density)
    act = RecoveryExecutor(
        tools,
        checkpointer=checkpointer,
        policies=policies,
        default_policy=default_policy,
        leases=leases,
        lease_ttl=lease_ttl,
        observations=observations,
        record_all_decisions=checkpoint_density == "milestones",
    )
    think = ThinkNode(
        model,
        tools,
        checkpointer=checkpointer,
        prompt=prompt,
        model_policy=model_policy,
        max_steps=max_steps,
        resume_context=resume_context,
        milestones=milestones,
        memory_window=memory_window,
    )
    router = RecoveryRouter(act, checkpointer=checkpointer, rng=rng)
    wait = WaitNode(act)
    takeover = TakeoverNode(checkpointer=checkpointer)
    compensate = CompensateNode(act, checkpointer=checkpointer)
    builder = StateGraph(RecoveryState)
    builder.add_node(
        "think", _node(think.invoke, think.ainvoke, "think"), destinations=("act", "takeover", END)
    )
    builder.add_node("act", _node(act.invoke, act.ainvoke, "act"))
    builder.add_node(
        "recover",
        _node(router.invoke, router.ainvoke, "recover"),
        destinations=("act", "wait", "takeover", "compensate", "fail", "think"),
    )
    builder.add_node("wait", _node(wait.invoke, wait.ainvoke, "wait"), destinations=("act",))
    builder.add_node(
        "takeover",
        _node(takeover.invoke, takeover.ainvoke, "takeover"),
        destinations=("act", "think", "compensate"),
    )
    builder.add_node("compensate", _node(compensate.invoke, compensate.ainvoke, "compensate"))
    fail_invoke, fail_ainvoke = fail_run(checkpointer)
    builder.add_node("fail", _node(fail_invoke, fail_ainvoke, "fail"))
    builder.add_edge(START, "think")
    builder.add_conditional_edges("act", _after_act, ["recover", "think"])
    builder.add_edge("compensate", "fail")
    builder.add_edge("fail", END)
    check_retry_owner(builder)
    return guarded(builder.compile(checkpointer=checkpointer, name=name))
