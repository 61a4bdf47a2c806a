"""``tp.ToolNode``: LangGraph's ``ToolNode`` with every tool call going through the ledger.

A drop-in for ``langgraph.prebuilt.ToolNode`` in a graph you build yourself::

    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import tools_condition
    import taskpilots_graph as tp

    builder = StateGraph(MessagesState)
    builder.add_node("agent", call_model)
    builder.add_node("tools", tp.ToolNode([lookup_customer, create_ticket]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    with tp.RecoveryCheckpointer.from_conn_string("sqlite:///runs.db") as cp:
        graph = builder.compile(checkpointer=cp)

It is LangGraph's own ``ToolNode`` (same input, output, ``Command`` and injection
handling, found by :func:`~taskpilots_graph.resume` and the drills like any ``ToolNode``),
given one ``wrap_tool_call`` / ``awrap_tool_call`` hook: the tool-call driver of
:class:`~taskpilots_graph.RecoveryMiddleware`. So a call gets exactly what a
``create_agent`` agent with that middleware gets, from one copy of the code: the
side-effect ledger (intent, commit, reconcile with the pre-check, the repeat guard), the
thread lease around the call, business locks, classification and the tool's
:class:`~taskpilots_graph.ToolPolicy`, and a takeover (``interrupt()``) when nobody can say
whether an effect happened.

What it cannot do from inside a tool node: replay the model's decision when a crash lost the
checkpoint holding it (your model node is not ours to wrap). Resume a crashed thread with
:func:`~taskpilots_graph.resume` (or :func:`~taskpilots_graph.run`): it settles the
intents the ledger holds first, so a re-decided call finds its effect committed.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.prebuilt import ToolNode as _LangGraphToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from taskpilots_graph._compat import task_checkpointer
from taskpilots_graph._twins import Steps, arun_steps, io, run_steps
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.leases import DEFAULT_LEASE_TTL, LeaseBackend
from taskpilots_graph.middleware._middleware import RecoveryMiddleware
from taskpilots_graph.policy import ToolPolicy

__all__ = ["ToolNode"]

_MAX_CHECKPOINTERS = 8

Answer = ToolMessage | Command[Any]
Execute = Callable[[ToolCallRequest], Answer]
AsyncExecute = Callable[[ToolCallRequest], Awaitable[Answer]]


class ToolNode(_LangGraphToolNode):
    """LangGraph's ``ToolNode`` whose calls of ``@tp.side_effect`` tools are never repeated.

    Use it where you would use ``langgraph.prebuilt.ToolNode``, in a graph compiled with a
    :class:`~taskpilots_graph.RecoveryCheckpointer` (or the async one)::

        builder.add_node("tools", tp.ToolNode([lookup_customer, create_ticket]))
        graph = builder.compile(checkpointer=cp)
        graph.invoke({"messages": [("user", goal)]}, {"configurable": {"thread_id": "t-1"}})
        # after a crash, in any process: tp.resume(graph, "t-1")

    Tool failures are handled by the tools' policies (retry, wait, fallback, report to the
    model, a person), not by LangGraph's ``handle_tool_errors``, which this node keeps at
    LangGraph's default: arguments that do not validate go back to the model, every other
    error reaches the policy.

    Args:
        tools: The tools, as for LangGraph's ``ToolNode``; ``@tp.side_effect`` tools go
            through the ledger, the others through their policy only.
        checkpointer: The recovery checkpointer holding the ledger. Default: the
            checkpointer of the graph the node runs in (it must be a recovery checkpointer).
        policies: Recovery policies by tool name; others use ``default_policy``.
        default_policy: The policy of tools without one (default ``ToolPolicy()``).
        leases: Lease backend for the thread lease and ``lock=`` business locks (Redis to
            scale out); the checkpointer's own database when omitted.
        lease_ttl: TTL in seconds of those leases.
        rng: Source of backoff jitter (tests pass a seeded one).
        name: The node's name.
        tags: Tags of the node's runs.
        messages_key: The state key holding the messages.

    Raises:
        ConfigurationError: For a checkpointer that is not a recovery checkpointer or a
            policy that is not a ``ToolPolicy`` (at construction); at the first call, for a
            graph compiled without a recovery checkpointer when none was given here.
    """

    # Set on the instance only when this node names the lease backend itself: then
    # runners of the graph (tp.run, tp.resume) hold the thread lease where its calls do.
    lease_backend: Callable[[], LeaseBackend]
    alease_backend: Callable[[], Awaitable[LeaseBackend]]
    lease_ttl: float

    def __init__(
        self,
        tools: Sequence[BaseTool | Callable[..., Any]],
        *,
        checkpointer: RecoveryAPI | None = None,
        policies: Mapping[str, ToolPolicy] | None = None,
        default_policy: ToolPolicy | None = None,
        leases: LeaseBackend | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        rng: random.Random | None = None,
        name: str = "tools",
        tags: list[str] | None = None,
        messages_key: str = "messages",
    ) -> None:
        _check_options(policies, default_policy, lease_ttl)
        self._options: dict[str, Any] = {
            "policies": policies,
            "default_policy": default_policy,
            "leases": leases,
            "lease_ttl": lease_ttl,
            "rng": rng,
        }
        self._recoveries: dict[int, RecoveryMiddleware] = {}
        self._lock = threading.Lock()
        self.checkpointer = checkpointer
        self.policies: dict[str, ToolPolicy] = dict(policies or {})
        self.default_policy = default_policy or ToolPolicy()
        if checkpointer is not None:
            self._recoveries[id(checkpointer)] = RecoveryMiddleware(checkpointer, **self._options)
        super().__init__(
            tools,
            name=name,
            tags=tags,
            messages_key=messages_key,
            wrap_tool_call=self._wrap,
            awrap_tool_call=self._awrap,
        )
        if checkpointer is not None:
            named = self._recoveries[id(checkpointer)]
            self.lease_backend = named.lease_backend
            self.alease_backend = named.alease_backend
            self.lease_ttl = named.lease_ttl
        elif leases is not None:
            self.lease_backend = lambda: leases
            self.alease_backend = _returning(leases)
            self.lease_ttl = float(lease_ttl)

    def recovery(self, config: RunnableConfig) -> RecoveryMiddleware:
        """The middleware driving calls in the run of ``config`` (one per checkpointer)."""
        cp = self.checkpointer
        if cp is None:
            found = task_checkpointer(config)
            if not isinstance(found, RecoveryAPI):
                raise ConfigurationError(
                    f"tp.ToolNode {self.name!r} keeps its side effects in the recovery "
                    "checkpointer's ledger, but the graph was compiled with "
                    f"{type(found).__name__ if found is not None else 'no checkpointer'}: "
                    "compile it with checkpointer=tp.RecoveryCheckpointer.from_conn_string(...) "
                    "or pass tp.ToolNode(tools, checkpointer=cp)"
                )
            cp = found
        with self._lock:
            recovery = self._recoveries.get(id(cp))
            if recovery is None or recovery.checkpointer is not cp:
                if len(self._recoveries) >= _MAX_CHECKPOINTERS:
                    # A long-lived node used with checkpointers opened per request must not
                    # keep them all alive; a dropped one only loses its write-saving marks.
                    self._recoveries.clear()
                recovery = RecoveryMiddleware(cp, **self._options)
                self._recoveries[id(cp)] = recovery
            return recovery

    def _call(self, request: ToolCallRequest, execute: Execute | AsyncExecute) -> Steps[Any]:
        """One tool call through the middleware (the body of ``_wrap`` and ``_awrap``)."""
        recovery = self.recovery(request.runtime.config)
        thread_id = _thread_id(request.runtime.config)
        try:
            return (yield io(recovery, "wrap_tool_call", request, execute))
        finally:
            # The middleware leaves pure-tool events for the next model call to write; the
            # model node here is the user's, so they are written at the end of the call.
            if thread_id is not None:
                yield io(recovery.checkpointer, "append_records", [], flush=thread_id)

    def _wrap(self, request: ToolCallRequest, execute: Execute) -> Any:
        return run_steps(self._call(request, execute))

    async def _awrap(self, request: ToolCallRequest, execute: AsyncExecute) -> Any:
        return await arun_steps(self._call(request, execute))


def _thread_id(config: RunnableConfig) -> str | None:
    # None: the middleware refuses the call itself (a run without a thread has no ledger).
    found = (config.get("configurable") or {}).get("thread_id")
    return str(found) if found else None


def _check_options(
    policies: Mapping[str, ToolPolicy] | None, default: ToolPolicy | None, lease_ttl: float
) -> None:
    """RecoveryMiddleware's own checks, made before a checkpointer is at hand."""
    for name, policy in (policies or {}).items():
        if not isinstance(policy, ToolPolicy):
            raise ConfigurationError(f"policies[{name!r}] must be a tp.ToolPolicy(...)")
    if default is not None and not isinstance(default, ToolPolicy):
        raise ConfigurationError("default_policy must be a tp.ToolPolicy(...)")
    if not isinstance(lease_ttl, int | float) or not math.isfinite(lease_ttl) or lease_ttl <= 0:
        raise ConfigurationError(f"lease_ttl must be a positive number, got {lease_ttl!r}")


def _returning(backend: LeaseBackend) -> Callable[[], Awaitable[LeaseBackend]]:
    async def get() -> LeaseBackend:
        return backend

    return get
