"""The coordinator: its construction (:func:`create_coordinator`) and its entry points
(:meth:`Coordinator.run` / :meth:`Coordinator.arun`); the loop itself is in :mod:`._drive`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from langgraph.pregel import Pregel

from taskpilots_graph.agent import lease_source
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.coordinator._drive import Drive
from taskpilots_graph.coordinator._plan import CoordinationPlan, Share
from taskpilots_graph.coordinator._report import CoordinationReport
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.leases import LeaseBackend, thread_lease_name
from taskpilots_graph.locks.hold import hold, reset_thread_hold, set_thread_hold

__all__ = ["Coordinator", "create_coordinator"]


class Coordinator:
    """Runs sub-agents as threads of their own, watches them, and recovers only what failed.

    Build it with :func:`create_coordinator`.
    """

    def __init__(
        self,
        subagents: Mapping[str, Pregel[Any, Any]],
        *,
        checkpointer: RecoveryAPI,
        leases: LeaseBackend | None,
        plan: CoordinationPlan,
        name: str,
        max_attempts: int,
        poll_interval: float,
        stuck_after: float | None,
        lease_ttl: float,
        discover_leases: bool = False,
    ) -> None:
        self.subagents = dict(subagents)
        self.checkpointer = checkpointer
        self._leases = leases
        self._discover_leases = discover_leases and leases is None
        self.plan = plan
        self.name = name
        self.max_attempts = max_attempts
        self.poll_interval = poll_interval
        self.stuck_after = stuck_after
        self.lease_ttl = lease_ttl

    @property
    def leases(self) -> LeaseBackend | None:
        """The lease backend the sub-agents' thread leases are watched in, if any.

        Found on first use when none was named: from the thread that runs the coordination,
        so an async checkpointer's backend is asked for off its event loop (``arun``).
        """
        if self._discover_leases:
            self._leases = _subagents_leases(self.subagents)
            self._discover_leases = False
        return self._leases

    # -- public ------------------------------------------------------------------------------

    def run(self, parent: str, inputs: Mapping[str, Any]) -> CoordinationReport:
        """Coordinate the sub-agents of ``parent`` until none can make progress.

        Call it again with the same arguments, in any process, to continue a coordination
        whose process died: finished sub-agents are left alone, a sub-agent whose worker
        died is resumed from its own checkpoint, and one not started yet is started.

        Args:
            parent: The coordinator's thread; sub-agent ``x`` runs on ``<parent>/x``
                (``<parent>/x~2`` for a rebuilt second attempt).
            inputs: The input of each sub-agent's graph, by name.

        Raises:
            ConfigurationError: For an empty ``parent`` or inputs missing a sub-agent.
            ThreadBusy: Another coordinator holds ``parent``.
            CompensationUncertain: An undo of a shared effect was interrupted and nothing
                can tell whether it happened (no ``compensate_precheck``); nothing re-ran
                on the object. Answer with
                ``taskpilots_graph.nodes.compensate.decide_compensation(cp,
                exc.effect_key, ...)``, then call ``run`` again.
        """
        self._check(parent, inputs)
        with self._parent_lease(parent):
            return Drive(self, parent, inputs).loop()

    async def arun(self, parent: str, inputs: Mapping[str, Any]) -> CoordinationReport:
        """Async form of :meth:`run` (the coordination runs in a worker thread; sub-agents
        are invoked through their sync interface)."""
        return await asyncio.to_thread(self.run, parent, inputs)

    # -- helpers -----------------------------------------------------------------------------

    def _check(self, parent: str, inputs: Mapping[str, Any]) -> None:
        if not isinstance(parent, str) or not parent:
            raise ConfigurationError("the parent thread id must be a non-empty string")
        if not isinstance(inputs, Mapping):
            raise ConfigurationError("inputs must map each sub-agent's name to its input")
        missing = sorted(set(self.subagents) - set(inputs))
        if missing:
            raise ConfigurationError(f"no input for sub-agents {missing}")

    @contextmanager
    def _parent_lease(self, parent: str) -> Iterator[None]:
        if self.leases is None:
            yield
            return
        # Waits out the lease of a coordinator that died (its TTL), refuses a live one.
        name, ttl = thread_lease_name(parent), self.lease_ttl
        with hold(self.leases, name, ttl=ttl, timeout=ttl * 1.5) as held:
            # The parent thread's own run: undo intents it left are its own (reconciled,
            # not waited for), and a lost lease stops an undo before it starts.
            token = set_thread_hold(held)
            try:
                yield
            finally:
                reset_thread_hold(token)


def _subagents_leases(subagents: Mapping[str, Pregel[Any, Any]]) -> LeaseBackend | None:
    """The one lease backend every sub-agent's runs hold their thread leases in, if any.

    With no backend named the sub-agents' leases live in their checkpointer's database: the
    coordinator watches them there. Sub-agents with backends of their own that differ
    leave it without one (it cannot see all of them in one place).
    """
    found: dict[int, LeaseBackend] = {}
    for graph in subagents.values():
        source = lease_source(graph)
        if source is None:
            return None
        backend = source.backend()
        found[id(backend)] = backend
    return next(iter(found.values())) if len(found) == 1 else None


def create_coordinator(
    subagents: Mapping[str, Pregel[Any, Any]],
    *,
    checkpointer: RecoveryAPI,
    leases: LeaseBackend | None = None,
    depends_on: Mapping[str, Any] | None = None,
    shares: Mapping[str, list[str | Share] | tuple[str | Share, ...]] | None = None,
    name: str = "coordinator",
    max_attempts: int = 2,
    poll_interval: float = 0.1,
    stuck_after: float | None = None,
    lease_ttl: float = 30.0,
) -> Coordinator:
    """A coordinator over sub-agent graphs (e.g. built by ``create_recovery_agent``).

    Each sub-agent runs on a thread of its own, ``<parent>/<name>``, through the
    lease-holding runners (``tp.run`` / ``tp.resume``). The coordinator:

    * starts a sub-agent once every sub-agent it ``depends_on`` is done, the others in
      parallel;
    * **watches** them through their thread leases and event logs: a sub-agent with work
      left whose lease nobody holds lost its worker and is **resumed alone** from its own
      checkpoint (its finished siblings are not touched);
    * **attributes** every failure (parent thread, sub-agent, step, tool, failure kind) in
      the parent's event log;
    * **re-runs only what failed**, as a new attempt that continues the sub-agent's own
      thread: a call repeating an effect it committed before returns the recorded result
      (the repeat guard), and its input says what stands and what was undone. Sharers'
      committed effects are never repeated: when the failed sub-agent had committed effects
      on a business object another sub-agent ``shares`` (the object of the tool's ``lock=``
      name), the object's policy decides (:class:`Share`): ``"keep"`` (default) leaves
      every effect on it as it is and re-runs the failed sub-agent alone;
      ``"compensate"`` undoes the effects on it of the failed sub-agent and of every
      sharer that ran, each exactly once, then re-runs those sub-agents;
    * reports a dependency cycle, or sub-agents each holding a lock the other waits for
      (:func:`await_lock`), as STUCK naming them, within one ``poll_interval`` (never a
      silent hang).

    Two sub-agents never perform one business operation twice when the tool declares a
    business ``key=`` (global across threads) and a ``lock=`` (always enforced).
    A re-run performs again only what was undone for it; an undone effect under a business
    ``key=`` is returned from the ledger instead (its key was used), so give an effect on a
    ``"compensate"`` object a default key if its re-run must perform it again.

    Example:
        >>> order = Share("order-1", policy="compensate")  # doctest: +SKIP
        >>> coordinator = create_coordinator(
        ...     {"picker": picker, "packer": packer, "shipper": shipper},
        ...     checkpointer=cp,
        ...     depends_on={"shipper": ["picker", "packer"]},
        ...     shares={"picker": [order], "packer": [order], "shipper": [order]},
        ... )
        >>> report = coordinator.run("order-1", inputs)

    Args:
        subagents: The sub-agent graphs by name, compiled with ``checkpointer``.
        checkpointer: The recovery checkpointer of every sub-agent and of the parent log.
        leases: Lease backend (the sub-agents' own, ``create_recovery_agent(leases=)``);
            needed to tell a live worker from a dead one and to see mutual waits. By
            default the one the sub-agents hold their leases in (their checkpointer's own
            database when none is named).
        depends_on: ``{name: [names it needs done first]}``.
        shares: ``{name: [business objects it reads or writes]}``, each an object id
            (``"order-1"``) or a :class:`Share` naming the object's policy.
        name: The coordinator's name (in its events).
        max_attempts: Attempts per sub-agent before it is given up on (≥ 1).
        poll_interval: Seconds between two looks at the sub-agents; bounds how late a
            mutual wait is reported.
        stuck_after: Also report a sub-agent STUCK that waits longer than this for a lock
            held by another sub-agent, even without a cycle (``None``: only cycles).
        lease_ttl: TTL of the coordinator's own lease on the parent thread.

    Raises:
        ConfigurationError: For no sub-agents, a graph without a recovery checkpointer,
            unknown names in ``depends_on`` / ``shares``, two policies for one shared
            object, or bad numbers.
    """
    if not isinstance(checkpointer, RecoveryAPI):
        raise ConfigurationError("create_coordinator needs checkpointer=RecoveryCheckpointer(...)")
    if not subagents:
        raise ConfigurationError("create_coordinator needs at least one sub-agent")
    for sub, graph in subagents.items():
        if not isinstance(graph, Pregel) or graph.checkpointer is None:
            raise ConfigurationError(
                f"sub-agent {sub!r} must be a graph compiled with a checkpointer"
            )
    if not isinstance(max_attempts, int) or max_attempts < 1:
        raise ConfigurationError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
    for label, value in (("poll_interval", poll_interval), ("lease_ttl", lease_ttl)):
        if not isinstance(value, int | float) or value <= 0:
            raise ConfigurationError(f"{label} must be > 0, got {value!r}")
    if stuck_after is not None and (not isinstance(stuck_after, int | float) or stuck_after <= 0):
        raise ConfigurationError(f"stuck_after must be > 0 or None, got {stuck_after!r}")
    plan = CoordinationPlan.build(subagents, depends_on, shares)
    return Coordinator(
        subagents,
        checkpointer=checkpointer,
        leases=leases,
        discover_leases=leases is None,
        plan=plan,
        name=name,
        max_attempts=max_attempts,
        poll_interval=float(poll_interval),
        stuck_after=None if stuck_after is None else float(stuck_after),
        lease_ttl=float(lease_ttl),
    )
