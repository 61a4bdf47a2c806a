"""The coordination loop: runs sub-agents as threads of their own and recovers only what
failed.

Everything the coordinator decides is written to the *parent* thread's event log before it
acts, so a coordinator started again in a fresh process (after a SIGKILL) reads where it
stood from that log and the sub-agents' own threads, and continues:

=====================  =======================================================================
parent event           meaning (payload keys)
=====================  =======================================================================
``plan_created``       the sub-tasks, their dependencies and shared objects (``subagents``),
                       each shared object's policy (``policies``)
``agent_started``      an attempt of a sub-agent began (``subagent``, ``thread_id``,
                       ``attempt``; a re-run also ``after``: where its thread stood)
``run_resumed``        a sub-agent whose worker died is resumed (``attribution``), or a
                       re-run recorded but never handed over is handed over (``handoff``)
``retry_scheduled``    one recovery decision, before anything is undone: the sub-agents to
                       run again (``rerun``), the effects to undo (``compensate``), those
                       kept (``kept``), why (``attribution``)
``compensated``        one planned undo was carried out (``subagent``: whose effect, ``key``,
                       ``object``, ``status``: ``undone``, ``already`` or ``left``); the
                       undo itself is a side effect of the parent thread, with its own
                       ledger entry ``undo:<key>`` and records
``agent_finished``     an attempt ended (``status``), or a sub-agent was given up on
``stuck_detected``     a dependency cycle or a mutual wait, naming the sub-agents
=====================  =======================================================================
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from langgraph.pregel import Pregel

from taskpilots_graph import _clock, runner
from taskpilots_graph.coordinator._log import ParentLog
from taskpilots_graph.coordinator._plan import (
    FailureAttribution,
    SubAgentState,
    attempt_thread_id,
    find_cycle,
)
from taskpilots_graph.coordinator._recover import MESSAGE_CHARS, Recovery
from taskpilots_graph.coordinator._report import CoordinationReport, SubAgentReport
from taskpilots_graph.coordinator._waits import STUCK_PREFIX, wait_edges
from taskpilots_graph.errors import PendingTakeover, ThreadBusy, ThreadNotFound, ToolWaiting
from taskpilots_graph.events import EventKind
from taskpilots_graph.leases import Lease, LeaseBackend, new_owner, thread_lease_name
from taskpilots_graph.threads import thread_info

if TYPE_CHECKING:
    from taskpilots_graph.coordinator._run import Coordinator

__all__ = ["Drive"]

_MARK_TTL_S: Final = 10.0
# Internal states of a dependency that will still move (so its dependents are not blocked).
_MOVING: Final = ("start", "recover", "orphaned", "handoff", SubAgentState.RUNNING)


class Drive:
    """One coordination loop (driver state; one per ``run`` call)."""

    def __init__(self, owner: Coordinator, parent: str, inputs: Mapping[str, Any]) -> None:
        self.c = owner
        self.cp = owner.checkpointer
        self.parent = parent
        self.inputs = inputs
        self.log = ParentLog.read(self.cp.events(parent))
        self.recovery = Recovery(owner, parent, inputs, self.log, self.event)
        self.running: dict[str, Future[None]] = {}
        self.errors: dict[str, int] = {}
        self.attributions: list[FailureAttribution] = []
        self.waits_seen: dict[str, float] = {}
        self.marks: dict[str, Lease] = {}
        self.mark_owner = f"coordinator:{parent}:{new_owner()}"
        self.reached_threads: set[tuple[str, int]] = set()  # (name, attempt) known reached

    def event(self, kind: EventKind, /, **payload: Any) -> None:
        self.cp.append_event(self.parent, kind, {"coordinator": self.c.name, **payload})

    # -- the loop ----------------------------------------------------------------------------

    def loop(self) -> CoordinationReport:
        if not self.log.planned:
            self.event(
                EventKind.PLAN_CREATED,
                coordination=True,
                subagents=self.c.plan.payload(),
                policies=self.c.plan.policy_payload(),
            )
            self.log.planned = True
        # A coordinator that died mid-recovery recorded what to undo: finish it before any
        # sub-agent runs again on the object.
        self.recovery.undo_pending()
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
        """The sub-agent's state, with the internal ``orphaned`` / ``recover`` / ``start`` /
        ``handoff``."""
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
        attempt = self.log.attempts(name)
        if not self.reached(name, thread, attempt):
            if self.c.leases is not None and self.c.leases.holder(thread_lease_name(thread)):
                return SubAgentState.RUNNING
            # The re-run was recorded but its input never got to the thread (the process
            # died in between): its thread still shows the attempt before, so hand it over.
            return "handoff"
        status = self.thread_status(thread)
        if status == "closed":
            return SubAgentState.DONE
        if status == "failed":
            # A failed attempt already recovered and not to run again: nothing left to do.
            handled = (thread, attempt) in self.log.handled
            return "recover" if not handled else SubAgentState.FAILED
        if status == "awaiting_human":
            return SubAgentState.TAKEOVER
        if status == "waiting" or (
            self.c.leases is not None and self.c.leases.holder(thread_lease_name(thread))
        ):
            return SubAgentState.RUNNING  # a live worker elsewhere (or a dead one's TTL)
        return "orphaned"  # work left (or no checkpoint yet) and nobody runs it

    def checkpoint_id(self, thread: str) -> str | None:
        found = self.cp.get_tuple({"configurable": {"thread_id": thread, "checkpoint_ns": ""}})
        return found.config["configurable"].get("checkpoint_id") if found else None

    def turn_mark(self, thread: str) -> dict[str, Any]:
        """Where the thread stands: its latest checkpoint and event."""
        events = self.cp.events(thread)
        return {"checkpoint_id": self.checkpoint_id(thread), "seq": events[-1].seq if events else 0}

    def reached(self, name: str, thread: str, attempt: int) -> bool:
        """Whether attempt ``attempt`` got to the thread: its first attempt always counts
        (a thread it never reached is found missing and run); a re-run once the thread
        moved past the mark recorded with it (a new event, or a new checkpoint)."""
        mark = self.log.after.get(name)
        if attempt <= 1 or mark is None or (name, attempt) in self.reached_threads:
            return True
        moved = bool(self.cp.events(thread, after_seq=int(mark.get("seq") or 0)))
        if moved or self.checkpoint_id(thread) != mark.get("checkpoint_id"):
            self.reached_threads.add((name, attempt))
            return True
        return False

    def act(self, pool: ThreadPoolExecutor, states: dict[str, str]) -> bool:
        acted = False
        moves: dict[str, Callable[[str], None]] = {"recover": self.recover}
        moves.update(orphaned=partial(self.resume, pool), handoff=partial(self.handoff, pool))
        for name in self.c.plan.tasks:
            state = states[name]
            if state in moves:
                moves[state](name)
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
        attempt = self.log.attempts(name) + 1
        # Every attempt continues the sub-agent's own thread: its ledger hands back what
        # earlier attempts committed (the repeat guard) instead of performing it again.
        thread = self.log.current(name) or attempt_thread_id(self.parent, name, 1)
        mark = self.turn_mark(thread) if attempt > 1 else None
        started: dict[str, Any] = {"subagent": name, "thread_id": thread, "attempt": attempt}
        if mark is not None:
            started["after"] = mark
        self.event(EventKind.AGENT_STARTED, **started)
        self.log.threads.setdefault(name, []).append(thread)
        self.log.after[name] = mark
        self.log.fresh.discard(name)
        self.submit(pool, name, runner.run, self.recovery.attempt_input(name, thread, attempt))

    def handoff(self, pool: ThreadPoolExecutor, name: str) -> None:
        thread = self.log.current(name)
        assert thread is not None
        attempt = self.log.attempts(name)
        why = FailureAttribution(self.parent, name, thread, "worker_lost")
        # The same notice (same message id): handed twice, it still appears once.
        input = self.recovery.attempt_input(name, thread, attempt)
        self.resubmit(pool, why, runner.run, input, attempt=attempt, handoff=True)

    def resubmit(
        self, pool: ThreadPoolExecutor, why: FailureAttribution, fn: Any, *args: Any, **detail: Any
    ) -> None:
        """Record a resume of a sub-agent (``run_resumed``, with ``detail``) and submit it."""
        self.attributions.append(why)
        name, thread = why.subagent, why.thread_id
        payload = {**detail, "attribution": why.payload()}
        self.event(EventKind.RUN_RESUMED, subagent=name, thread_id=thread, **payload)
        self.log.resumes[name] = self.log.resumes.get(name, 0) + 1
        self.submit(pool, name, fn, *args)

    def resume(self, pool: ThreadPoolExecutor, name: str) -> None:
        thread = self.log.current(name)
        assert thread is not None
        try:
            step = thread_info(self.cp, thread).current_step
        except ThreadNotFound:
            step = None  # died before its first checkpoint
        # A run that raised out of the graph here is an error; otherwise its worker died.
        kind = "error" if self.errors.get(name) else "worker_lost"
        where = {"step": step.tool_call_id, "tool": step.using} if step else {}
        why = FailureAttribution(self.parent, name, thread, kind, **where)
        self.resubmit(pool, why, _resume, self.inputs[name])

    def recover(self, name: str) -> None:
        thread = self.log.current(name)
        assert thread is not None
        why = self.recovery.attribution(name, thread)
        self.attributions.append(why)
        if not self.recovery.decide(why, self.log.attempts(name)):
            self.give_up(name, why)

    def give_up(self, name: str, why: FailureAttribution) -> None:
        self.log.given_up.add(name)
        payload = {"status": "failed", "given_up": True, "attribution": why.payload()}
        self.event(EventKind.AGENT_FINISHED, subagent=name, thread_id=why.thread_id, **payload)

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
    return f"{type(exc).__name__}: {exc}"[:MESSAGE_CHARS]
