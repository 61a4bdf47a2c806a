"""The coordinator driver: runs sub-agents as threads of their own and recovers only what
failed.

Everything the coordinator decides is written to the *parent* thread's event log before it
acts, so a coordinator started again in a fresh process (after a SIGKILL) reads where it
stood from that log and the sub-agents' own threads, and continues:

=====================  =======================================================================
parent event           meaning (payload keys)
=====================  =======================================================================
``plan_created``       the sub-tasks, their dependencies and shared objects (``subagents``)
``agent_started``      an attempt of a sub-agent began (``subagent``, ``thread_id``, ``attempt``)
``run_resumed``        a sub-agent whose worker died is resumed (``attribution``)
``compensated``        a shared effect of a failed sub-agent was undone (``key``, ``object``)
``retry_scheduled``    a sub-agent will run again as a new attempt (``attribution``)
``agent_finished``     an attempt ended (``status``), or a sub-agent was given up on
``stuck_detected``     a dependency cycle or a mutual wait, naming the sub-agents
=====================  =======================================================================
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Final

from langgraph.pregel import Pregel

from taskpilots_graph import _clock, runner
from taskpilots_graph.agent import find_executor, lease_source
from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.checkpointers.base import prepare_event
from taskpilots_graph.coordinator._plan import (
    CoordinationPlan,
    FailureAttribution,
    SubAgentState,
    attempt_thread_id,
    find_cycle,
    plan_recovery,
)
from taskpilots_graph.coordinator._waits import STUCK_PREFIX, wait_edges
from taskpilots_graph.errors import (
    ConfigurationError,
    LedgerConflict,
    PendingTakeover,
    ThreadBusy,
    ThreadNotFound,
    ToolWaiting,
)
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.ledger import LedgerStatus
from taskpilots_graph.locks.base import Lease, LeaseBackend, new_owner, thread_lease_name
from taskpilots_graph.locks.hold import hold
from taskpilots_graph.nodes._locks import lock_target
from taskpilots_graph.threads import thread_info
from taskpilots_graph.tools import spec_of

__all__ = ["CoordinationReport", "Coordinator", "SubAgentReport", "create_coordinator"]

_MESSAGE_CHARS: Final = 500
_MARK_TTL_S: Final = 10.0
# Internal states of a dependency that will still move (so its dependents are not blocked).
_MOVING: Final = ("start", "recover", "orphaned", SubAgentState.RUNNING)


@dataclass(frozen=True, slots=True)
class SubAgentReport:
    """How one sub-agent ended.

    Attributes:
        name: The sub-agent.
        state: Where it stands.
        thread_id: The thread of its latest attempt (``None`` if it never started).
        attempts: Attempts started (a rebuild is a new attempt, a resume is not).
        resumes: Resumes of a dead worker's attempt by this coordinator.
    """

    name: str
    state: SubAgentState
    thread_id: str | None
    attempts: int
    resumes: int


@dataclass(frozen=True, slots=True)
class CoordinationReport:
    """The outcome of :meth:`Coordinator.run`.

    Attributes:
        parent: The coordinator's thread.
        subagents: Per sub-agent, in plan order.
        stuck: The sub-agents reported STUCK (a dependency cycle or a mutual wait).
        attributions: The failures attributed during this run, in order.
    """

    parent: str
    subagents: Mapping[str, SubAgentReport]
    stuck: tuple[str, ...] = ()
    attributions: tuple[FailureAttribution, ...] = ()

    @property
    def done(self) -> bool:
        """Whether every sub-agent finished its work."""
        return all(r.state is SubAgentState.DONE for r in self.subagents.values())


@dataclass
class _Log:
    """What the parent's event log says (driver state, rebuilt from the log on start)."""

    planned: bool = False
    threads: dict[str, list[str]] = field(default_factory=dict)
    resumes: dict[str, int] = field(default_factory=dict)
    fresh: set[str] = field(default_factory=set)  # a new attempt is due
    given_up: set[str] = field(default_factory=set)
    stuck: set[str] = field(default_factory=set)
    handled: set[str] = field(default_factory=set)  # failed attempt threads already recovered

    @classmethod
    def read(cls, events: list[Event]) -> _Log:
        log = cls()
        for event in events:
            p = event.payload
            name = p.get("subagent")
            if event.kind is EventKind.PLAN_CREATED and "coordination" in p:
                log.planned = True
            elif event.kind is EventKind.STUCK_DETECTED and "subagents" in p:
                log.stuck |= set(p["subagents"])
            elif not isinstance(name, str):
                continue
            elif event.kind is EventKind.AGENT_STARTED:
                log.threads.setdefault(name, []).append(str(p["thread_id"]))
                log.fresh.discard(name)
            elif event.kind is EventKind.RUN_RESUMED:
                log.resumes[name] = log.resumes.get(name, 0) + 1
            elif event.kind is EventKind.RETRY_SCHEDULED:
                # One event per recovery, naming every sub-agent to run again: a crash
                # can never leave half of a decision recorded.
                log.fresh |= set(p.get("rerun") or [name])
                log.handled.add(str((p.get("attribution") or {}).get("thread_id") or ""))
            elif event.kind is EventKind.AGENT_FINISHED and p.get("given_up"):
                log.given_up.add(name)
        return log

    def current(self, name: str) -> str | None:
        threads = self.threads.get(name)
        return threads[-1] if threads else None


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
    ) -> None:
        self.subagents = dict(subagents)
        self.checkpointer = checkpointer
        self.leases = leases
        self.plan = plan
        self.name = name
        self.max_attempts = max_attempts
        self.poll_interval = poll_interval
        self.stuck_after = stuck_after
        self.lease_ttl = lease_ttl

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
        """
        self._check(parent, inputs)
        with self._parent_lease(parent):
            return _Drive(self, parent, inputs).loop()

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
        with hold(
            self.leases,
            thread_lease_name(parent),
            ttl=self.lease_ttl,
            timeout=self.lease_ttl * 1.5,
        ):
            yield


class _Drive:
    """One coordination loop (driver state; one per ``run`` call)."""

    def __init__(self, owner: Coordinator, parent: str, inputs: Mapping[str, Any]) -> None:
        self.c = owner
        self.cp = owner.checkpointer
        self.parent = parent
        self.inputs = inputs
        self.log = _Log.read(self.cp.events(parent))
        self.running: dict[str, Future[None]] = {}
        self.errors: dict[str, int] = {}
        self.attributions: list[FailureAttribution] = []
        self.waits_seen: dict[str, float] = {}
        self.marks: dict[str, Lease] = {}
        self.mark_owner = f"coordinator:{parent}:{new_owner()}"

    def event(self, kind: EventKind, /, **payload: Any) -> None:
        self.cp.append_event(self.parent, kind, {"coordinator": self.c.name, **payload})

    # -- the loop ----------------------------------------------------------------------------

    def loop(self) -> CoordinationReport:
        if not self.log.planned:
            self.event(EventKind.PLAN_CREATED, coordination=True, subagents=self.c.plan.payload())
            self.log.planned = True
        cycle = self.c.plan.cycle()
        if cycle and not set(cycle) <= self.log.stuck:
            self.stuck("dependency_cycle", cycle)
        with ThreadPoolExecutor(max_workers=max(1, len(self.c.subagents))) as pool:
            while True:
                self.collect()
                states = {n: self.state(n) for n in self.c.plan.tasks}
                acted = self.act(pool, states)
                self.watch_waits()
                if not self.running and not acted:
                    return self.report(states)
                time.sleep(self.c.poll_interval)

    def collect(self) -> None:
        for name, future in list(self.running.items()):
            if not future.done():
                continue
            del self.running[name]
            exc = future.exception()
            thread = self.log.current(name) or ""
            if exc is not None and not isinstance(exc, ThreadBusy | PendingTakeover | ToolWaiting):
                self.errors[name] = self.errors.get(name, 0) + 1
                why = FailureAttribution(self.parent, name, thread, "error", message=_short(exc))
                self.attributions.append(why)
                if self.errors[name] >= self.c.max_attempts:
                    self.give_up(name, why)
                continue
            status = self.thread_status(thread)
            self.event(EventKind.AGENT_FINISHED, subagent=name, thread_id=thread, status=status)

    def thread_status(self, thread: str) -> str:
        try:
            info = thread_info(self.cp, thread)
        except ThreadNotFound:
            return "missing"
        if info.status == "waiting_tool" and info.retry_at and info.retry_at > _clock.now():
            return "waiting"  # parked until retry_at: not orphaned yet
        return str(info.status)

    def state(self, name: str) -> str:
        """The sub-agent's state, with the internal ``orphaned`` / ``recover`` / ``start``."""
        if name in self.running:
            return SubAgentState.RUNNING
        thread = self.log.current(name)
        if name in self.log.stuck:
            # Reported stuck: never run again here. One that got its lock anyway (another
            # in the cycle let go first) and finished is done.
            closed = thread is not None and self.thread_status(thread) == "closed"
            return SubAgentState.DONE if closed else SubAgentState.STUCK
        if name in self.log.given_up:
            return SubAgentState.FAILED
        if thread is None or name in self.log.fresh:
            return "start"
        status = self.thread_status(thread)
        if status == "closed":
            return SubAgentState.DONE
        if status == "failed":
            # A failed attempt already recovered and not to run again: nothing left to do.
            return "recover" if thread not in self.log.handled else SubAgentState.FAILED
        if status == "awaiting_human":
            return SubAgentState.TAKEOVER
        if status == "waiting" or (
            self.c.leases is not None and self.c.leases.holder(thread_lease_name(thread))
        ):
            return SubAgentState.RUNNING  # a live worker elsewhere (or a dead one's TTL)
        return "orphaned"  # work left (or no checkpoint yet) and nobody runs it

    def act(self, pool: ThreadPoolExecutor, states: dict[str, str]) -> bool:
        acted = False
        for name in self.c.plan.tasks:
            state = states[name]
            if state == "recover":
                self.recover(name)
                acted = True
            elif state == "orphaned":
                self.resume(pool, name)
                acted = True
            elif state == "start":
                deps = [states[d] for d in self.c.plan.tasks[name].depends_on]
                if all(d == SubAgentState.DONE for d in deps):
                    self.start(pool, name)
                    acted = True
                elif any(d not in _MOVING for d in deps):
                    states[name] = SubAgentState.BLOCKED
            elif state == SubAgentState.RUNNING and name not in self.running:
                acted = True  # watched through its lease: wait for it
        return acted

    # -- actions -----------------------------------------------------------------------------

    def submit(self, pool: ThreadPoolExecutor, name: str, fn: Any, *args: Any) -> None:
        graph = self.c.subagents[name]
        thread = self.log.current(name)
        assert thread is not None
        self.running[name] = pool.submit(fn, graph, thread, *args)

    def start(self, pool: ThreadPoolExecutor, name: str) -> None:
        attempt = len(self.log.threads.get(name, ())) + 1
        thread = attempt_thread_id(self.parent, name, attempt)
        self.event(EventKind.AGENT_STARTED, subagent=name, thread_id=thread, attempt=attempt)
        self.log.threads.setdefault(name, []).append(thread)
        self.log.fresh.discard(name)
        self.submit(pool, name, runner.run, self.inputs[name])

    def resume(self, pool: ThreadPoolExecutor, name: str) -> None:
        thread = self.log.current(name)
        assert thread is not None
        try:
            step = thread_info(self.cp, thread).current_step
        except ThreadNotFound:
            step = None  # died before its first checkpoint
        why = FailureAttribution(
            self.parent,
            name,
            thread,
            # A run that raised out of the graph here is an error; otherwise its worker died.
            "error" if self.errors.get(name) else "worker_lost",
            step=step.tool_call_id if step else None,
            tool=step.using if step else None,
        )
        self.attributions.append(why)
        self.event(
            EventKind.RUN_RESUMED, subagent=name, thread_id=thread, attribution=why.payload()
        )
        self.log.resumes[name] = self.log.resumes.get(name, 0) + 1
        self.submit(pool, name, _resume, self.inputs[name])

    def failed_attribution(self, name: str, thread: str) -> FailureAttribution:
        failure = next(
            (e for e in reversed(self.cp.events(thread)) if e.kind is EventKind.TOOL_FAILED),
            None,
        )
        if failure is None:
            return FailureAttribution(self.parent, name, thread, "failed")
        p = failure.payload
        detail = p.get("failure") or {}
        return FailureAttribution(
            self.parent,
            name,
            thread,
            str(detail.get("kind") or "failed"),
            step=p.get("tool_call_id"),
            tool=p.get("tool"),
            key=p.get("key"),
            message=str(detail.get("message") or "")[:_MESSAGE_CHARS] or None,
        )

    def recover(self, name: str) -> None:
        thread = self.log.current(name)
        assert thread is not None
        why = self.failed_attribution(name, thread)
        self.attributions.append(why)
        effects = self.compensable(name, thread)
        started = [n for n in self.c.plan.tasks if self.log.threads.get(n)]
        decision = plan_recovery(
            self.c.plan,
            name,
            [(e[0], e[1], e[2]) for e in effects],
            started=started,
            attempts=len(self.log.threads.get(name, ())),
            max_attempts=self.c.max_attempts,
        )
        if decision.give_up:
            self.give_up(name, why)
            return
        for shared in decision.shared:
            self.compensate(name, shared.key, shared.obj, shared.readers, why)
        self.event(
            EventKind.RETRY_SCHEDULED,
            subagent=name,
            rerun=list(decision.rerun),
            attribution=why.payload(),
        )
        self.log.fresh |= set(decision.rerun)
        self.log.handled.add(thread)

    def compensable(self, name: str, thread: str) -> list[tuple[str, str, str | None]]:
        executor = find_executor(self.c.subagents[name])
        out = []
        for entry in self.cp.ledger(thread):
            tool = executor.tools.get(entry.tool) if executor is not None else None
            spec = spec_of(tool) if tool is not None else None
            # Compensated ones count too: after a crash in the middle of a recovery they
            # still name the dependents to run again (they are not undone twice).
            settled = entry.status in (LedgerStatus.COMMITTED, LedgerStatus.COMPENSATED)
            if not settled or spec is None or not spec.compensate:
                continue
            obj = lock_target(entry.lock, entry.tool)[0] if entry.lock else None
            out.append((entry.key, entry.tool, obj))
        return out

    def compensate(
        self, name: str, key: str, obj: str, readers: tuple[str, ...], why: FailureAttribution
    ) -> None:
        entry = self.cp.ledger_entry(key)
        executor = find_executor(self.c.subagents[name])
        if entry is None or entry.status is not LedgerStatus.COMMITTED or executor is None:
            return
        spec = spec_of(executor.tools[entry.tool])
        if spec is None or spec.compensate is None:
            return
        spec.compensate(entry.key, dict(entry.args), entry.result)
        undone = replace(entry, status=LedgerStatus.COMPENSATED, updated_at=datetime.now(UTC))
        note = {"tool": entry.tool, "key": entry.key, "by": "coordinator"}
        record = prepare_event(
            entry.thread_id, EventKind.COMPENSATED, note, checkpoint_id=None, checkpoint_ns=""
        )
        try:
            # Compare-and-set: of two coordinators only one marks it; the ledger row says
            # the effect was undone, so no later recovery undoes it again.
            self.cp.write_ledger(
                undone, expect=(LedgerStatus.COMMITTED, entry.attempt), events=[record]
            )
        except LedgerConflict:
            return
        self.event(
            EventKind.COMPENSATED,
            subagent=name,
            key=key,
            tool=entry.tool,
            object=obj,
            readers=list(readers),
            attribution=why.payload(),
        )

    def give_up(self, name: str, why: FailureAttribution) -> None:
        self.log.given_up.add(name)
        self.event(
            EventKind.AGENT_FINISHED,
            subagent=name,
            thread_id=why.thread_id,
            status="failed",
            given_up=True,
            attribution=why.payload(),
        )

    def stuck(self, kind: str, names: tuple[str, ...], **detail: Any) -> None:
        self.log.stuck |= set(names)
        self.event(EventKind.STUCK_DETECTED, kind=kind, subagents=list(names), **detail)

    # -- mutual waits ------------------------------------------------------------------------

    def watch_waits(self) -> None:
        leases = self.c.leases
        if leases is None:
            return
        threads = {
            t: n
            for n in self.c.plan.tasks
            if n not in self.log.stuck and (t := self.log.current(n)) is not None
        }
        edges = wait_edges(leases, threads)
        cycle = find_cycle({a: [b] for a, (b, _) in edges.items()})
        now = time.monotonic()
        for name in list(self.waits_seen):
            if name not in edges:
                del self.waits_seen[name]
        for name in edges:
            self.waits_seen.setdefault(name, now)
        kind = "mutual_wait"
        if not cycle and self.c.stuck_after is not None:
            long = sorted(n for n, t in self.waits_seen.items() if now - t >= self.c.stuck_after)
            if long:
                kind, cycle = "long_wait", tuple(sorted({*long, *(edges[n][0] for n in long)}))
        if cycle:
            locks = sorted({edges[n][1] for n in cycle if n in edges})
            self.stuck(kind, cycle, locks=locks)
        self.mark_stuck(leases)

    def mark_stuck(self, leases: LeaseBackend) -> None:
        """Keep stuck sub-agents that still run marked, so their lock waits end."""
        for name in self.log.stuck:
            thread = self.log.current(name)
            if thread is None:
                continue
            alive = name in self.running or leases.holder(thread_lease_name(thread))
            mark = self.marks.pop(name, None)
            if alive:
                # Renewed every poll while the sub-agent runs; short-lived afterwards, so a
                # person's later retry of the step is not refused by an old mark.
                got = leases.acquire(STUCK_PREFIX + thread, self.mark_owner, _MARK_TTL_S)
                if got is not None:
                    self.marks[name] = got
            elif mark is not None:
                leases.release(mark)

    # -- the report --------------------------------------------------------------------------

    def report(self, states: Mapping[str, str]) -> CoordinationReport:
        subagents = {}
        for name in self.c.plan.tasks:
            raw = states[name]
            state = raw if isinstance(raw, SubAgentState) else SubAgentState.PENDING
            subagents[name] = SubAgentReport(
                name,
                SubAgentState(state),
                self.log.current(name),
                len(self.log.threads.get(name, ())),
                self.log.resumes.get(name, 0),
            )
        stuck = tuple(n for n in self.c.plan.tasks if n in self.log.stuck)
        return CoordinationReport(self.parent, subagents, stuck, tuple(self.attributions))


def _resume(graph: Pregel[Any, Any], thread: str, input: Any) -> None:
    try:
        runner.resume(graph, thread)
    except ThreadNotFound:
        # Killed before its first checkpoint: nothing ran that a checkpoint would know of;
        # the ledger still absorbs any effect it began.
        runner.run(graph, thread, input)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:_MESSAGE_CHARS]


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
    shares: Mapping[str, Any] | None = None,
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
    * **rebuilds** a failed sub-agent as a new attempt (``<parent>/<name>~2``). If it had
      committed effects on a business object another sub-agent ``shares`` (the object of
      the tool's ``lock=`` name), those effects are compensated first, exactly once, then
      the failed sub-agent and the sharers that already ran are run again;
    * reports a dependency cycle, or sub-agents each holding a lock the other waits for
      (:func:`await_lock`), as STUCK naming them, within one ``poll_interval`` (never a
      silent hang).

    Two sub-agents never perform one business operation twice when the tool declares a
    business ``key=`` (global across threads) and a ``lock=`` (always enforced).
    A rebuilt attempt is a new thread: its effects with default keys run again (that is
    the point after a compensation), effects with a business key are returned from the
    ledger.

    Args:
        subagents: The sub-agent graphs by name, compiled with ``checkpointer``.
        checkpointer: The recovery checkpointer of every sub-agent and of the parent log.
        leases: Lease backend (the sub-agents' own, ``create_recovery_agent(leases=)``);
            needed to tell a live worker from a dead one and to see mutual waits. By
            default the one the sub-agents hold their leases in (their checkpointer's own
            database when none is named).
        depends_on: ``{name: [names it needs done first]}``.
        shares: ``{name: [business object ids it reads or writes]}``.
        name: The coordinator's name (in its events).
        max_attempts: Attempts per sub-agent before it is given up on (≥ 1).
        poll_interval: Seconds between two looks at the sub-agents; bounds how late a
            mutual wait is reported.
        stuck_after: Also report a sub-agent STUCK that waits longer than this for a lock
            held by another sub-agent, even without a cycle (``None``: only cycles).
        lease_ttl: TTL of the coordinator's own lease on the parent thread.

    Raises:
        ConfigurationError: For no sub-agents, a graph without a recovery checkpointer,
            unknown names in ``depends_on`` / ``shares``, or bad numbers.
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
        leases=leases if leases is not None else _subagents_leases(subagents),
        plan=plan,
        name=name,
        max_attempts=max_attempts,
        poll_interval=float(poll_interval),
        stuck_after=None if stuck_after is None else float(stuck_after),
        lease_ttl=float(lease_ttl),
    )
