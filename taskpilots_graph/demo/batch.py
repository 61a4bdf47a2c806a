"""Run the ticket batch in worker processes, SIGKILL them, resume, and count side effects.

``run_batch`` is what one worker process does: start every ticket's thread, or resume it by
thread id if it already exists, printing a line per ticket. ``drill`` is the supervisor: it
plants kill points in the simulated services (and optionally kills at random moments),
restarts the worker after every SIGKILL until the batch is done, reports its progress as it
goes, and reports what the services performed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnableConfig

from taskpilots_graph.checkpointers.density import Density
from taskpilots_graph.demo.model import ScriptedTicketModel
from taskpilots_graph.demo.services import Phase, Services
from taskpilots_graph.demo.workflow import build_plain_graph, build_recovery_agent

__all__ = ["DrillEvent", "DrillReport", "KillPoint", "Mode", "drill", "make_batch", "run_batch"]

Mode = Literal["agent", "plain"]

SIDE_EFFECT_SERVICES = (
    "crm_tag",
    "create_ticket",
    "send_email",
    "request_approval",
    "issue_refund",
)


def make_batch(n: int, *, seed: int = 7) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """``n`` tickets from a handful of customers; most of them ask for a refund."""
    rng = random.Random(seed)
    customers = [
        {
            "customer_id": f"c{i}",
            "name": f"Customer {i}",
            "email": f"c{i}@example.com",
            "tier": rng.choice(["standard", "gold"]),
        }
        for i in range(max(1, n // 2))
    ]
    tickets = [
        {
            "ticket_id": f"T{i:03d}",
            "customer_id": customers[i % len(customers)]["customer_id"],
            "order_id": f"o{i:03d}",
            "subject": rng.choice(["Damaged parcel", "Late delivery", "Wrong size", "Refund"]),
            "refund": rng.choice([0, 25, 40, 60, 80]) if i % 4 == 3 else rng.choice([25, 40]),
        }
        for i in range(n)
    ]
    return customers, tickets


def thread_id(ticket: dict[str, Any]) -> str:
    """The thread of one ticket."""
    return f"ticket-{ticket['ticket_id']}"


def _plain_saver(conn_string: str) -> Any:
    if conn_string.startswith(("postgresql://", "postgres://")):
        from langgraph.checkpoint.postgres import PostgresSaver

        return PostgresSaver.from_conn_string(conn_string)
    from langgraph.checkpoint.sqlite import SqliteSaver

    return SqliteSaver.from_conn_string(conn_string.removeprefix("sqlite:///"))


READY = "ready"
"""What a worker prints once it is set up: timed kills count from here, not from spawn."""

SERVING = "serving"
"""What the worker's fork server (``worker --serve``) prints once its imports are done."""

SETTLED = "settled "
"""A worker's line once a ticket's run has ended (closed, or stopped for a person)."""

KillPoint = tuple[str, Phase] | tuple[str, Phase, str | None]
"""``(service, phase)`` or ``(service, phase, about)``: see :meth:`Services.plant_kill`."""


@dataclass(frozen=True, slots=True)
class DrillEvent:
    """Something a drill saw happen, for a progress display.

    Attributes:
        kind: ``"worker"`` (a worker process is up), ``"settled"`` (a ticket's run ended)
            or ``"killed"`` (the worker was SIGKILLed).
        detail: The ticket id (``settled``), the worker's run number (``worker``), or where
            the kill landed (``killed``, e.g. ``"right after create_ticket for o003"``).
    """

    kind: Literal["worker", "settled", "killed"]
    detail: str


def _ready() -> None:
    print(READY, flush=True)


def _settled(ticket: dict[str, Any]) -> None:
    print(f"{SETTLED}{ticket['ticket_id']}", flush=True)


def run_batch(
    mode: Mode,
    conn_string: str,
    services_path: str,
    tickets: list[dict[str, Any]],
    *,
    density: Density = "every_step",
) -> None:
    """Process every ticket once: start its thread, or resume it if it exists."""
    import taskpilots_graph as tp

    services = Services(services_path)
    model = ScriptedTicketModel()
    if mode == "agent":
        with tp.RecoveryCheckpointer.from_conn_string(conn_string) as cp:
            cp.setup()
            _ready()
            graph = build_recovery_agent(model, services, cp, checkpoint_density=density)
            for ticket in tickets:
                cfg: RunnableConfig = {"configurable": {"thread_id": thread_id(ticket)}}
                try:
                    if cp.get_tuple(cfg) is None:
                        graph.invoke({"messages": [HumanMessage(json.dumps(ticket))]}, cfg)
                    else:
                        tp.resume(graph, thread_id(ticket))
                except tp.PendingTakeover:
                    pass  # stopped on a named effect; a person decides
                _settled(ticket)
        return
    with _plain_saver(conn_string) as saver:
        saver.setup()
        _ready()
        graph = build_plain_graph(model, services, saver)
        # The control runs with durability "sync": every step's checkpoint is on disk
        # before the next step starts, so a kill loses exactly the step it lands in. Under
        # the default "async" the checkpoint races the kill, and the control's duplicate
        # count would depend on the machine's speed instead of the kill schedule.
        for ticket in tickets:
            cfg = {"configurable": {"thread_id": thread_id(ticket)}}
            if saver.get_tuple(cfg) is None:
                start = {"messages": [HumanMessage(json.dumps(ticket))]}
                graph.invoke(start, cfg, durability="sync")
            else:
                state = graph.get_state(cfg)
                if state.next or state.tasks:
                    graph.invoke(None, cfg, durability="sync")
            _settled(ticket)


@dataclass
class DrillReport:
    """What one drill observed."""

    mode: Mode
    tickets: int
    closed: int
    stopped_uncertain: list[str]
    incomplete: list[str]
    effects: dict[str, int]
    duplicates: int
    kills: int
    worker_runs: int
    seconds: float
    uncertain_keys: list[str] = field(default_factory=list)
    kill_sites: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


_IN_PROCESS = threading.Lock()
"""Held while this process builds and reads a drill's graph.

``taskpilots demo`` runs its drills side by side in threads; their workers are processes
of their own, but the final reading happens in this process, and the library is not set
up from two threads at once this way. One reading at a time costs a fraction of a second.
"""


def _outcomes(
    mode: Mode, conn_string: str, services: Services, tickets: list[dict[str, Any]]
) -> tuple[int, list[str], list[str], list[str]]:
    with _IN_PROCESS:
        return _read_outcomes(mode, conn_string, services, tickets)


def _read_outcomes(
    mode: Mode, conn_string: str, services: Services, tickets: list[dict[str, Any]]
) -> tuple[int, list[str], list[str], list[str]]:
    import taskpilots_graph as tp

    closed, uncertain, incomplete, keys = 0, [], [], []
    opener = (
        tp.RecoveryCheckpointer.from_conn_string(conn_string)
        if mode == "agent"
        else _plain_saver(conn_string)
    )
    with opener as saver:
        graph = (
            build_recovery_agent(ScriptedTicketModel(), services, saver)
            if mode == "agent"
            else build_plain_graph(ScriptedTicketModel(), services, saver)
        )
        for ticket in tickets:
            tid = thread_id(ticket)
            values = graph.get_state({"configurable": {"thread_id": tid}}).values
            last = (values.get("messages") or [None])[-1]
            if (
                isinstance(last, AIMessage)
                and not last.tool_calls
                and "closed." in str(last.content)
            ):
                closed += 1
                continue
            stuck = (
                [e.key for e in saver.ledger(tid) if e.status == "uncertain"]
                if mode == "agent"
                else []
            )
            if stuck:
                uncertain.append(tid)
                keys += stuck
            else:
                incomplete.append(tid)
    return closed, uncertain, incomplete, keys


def _spawn(
    cmd: list[str], delay: float | None, on_event: Callable[[DrillEvent], None] | None, run: int
) -> tuple[int, bool]:
    """One worker run in a new interpreter: its exit code, and whether we killed it."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    # Interpreter start-up takes seconds on a loaded machine: a kill timed from spawn
    # would mostly land in the imports, before any tool ran.
    proc.stdout.readline()
    if on_event is not None:
        on_event(DrillEvent("worker", str(run)))
    timed = False
    if delay is not None:
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            timed = True
    _watch(proc, on_event)
    return proc.wait(), timed


class _ForkServer:
    """``python -m taskpilots_graph.demo.worker --serve``: forks a worker per run."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != SERVING:
            self.close()
            raise RuntimeError(f"the worker's fork server did not start (exit {self.proc.poll()})")

    def run(
        self, delay: float | None, on_event: Callable[[DrillEvent], None] | None, run: int
    ) -> tuple[int, bool]:
        """Fork one worker run; its exit code, and whether the server killed it."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"run {'-' if delay is None else delay}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.strip() == READY:
                if on_event is not None:
                    on_event(DrillEvent("worker", str(run)))
            elif line.startswith(SETTLED):
                if on_event is not None:
                    on_event(DrillEvent("settled", line[len(SETTLED) :].strip()))
            elif line.startswith("exit "):
                code, *timed = line.split()[1:]
                return int(code), bool(timed)
        raise RuntimeError(f"the worker's fork server died (exit {self.proc.wait()})")

    def close(self) -> None:
        """End the server (its stdin closes) and reap it."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _kill_site(service: str, phase: Phase, identity: str) -> str:
    about = identity.partition(":")[0]
    when = "right after" if phase == "after" else "just before"
    return f"{when} {service} for {about}"


def _watch(proc: subprocess.Popen[str], on_event: Callable[[DrillEvent], None] | None) -> None:
    """Read the worker's lines to its end, reporting each settled ticket."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(SETTLED) and on_event is not None:
            on_event(DrillEvent("settled", line[len(SETTLED) :].strip()))


def drill(
    mode: Mode,
    workdir: Path,
    tickets: list[dict[str, Any]],
    customers: list[dict[str, str]],
    *,
    kill_points: Sequence[KillPoint],
    timed_kills: int = 0,
    conn_string: str | None = None,
    seed: int = 0,
    max_runs: int = 200,
    density: Density = "every_step",
    on_event: Callable[[DrillEvent], None] | None = None,
    fork_server: bool = False,
) -> DrillReport:
    """Run the batch in child processes under SIGKILLs until every ticket is settled.

    Args:
        mode: ``"agent"`` (the recovery agent) or ``"plain"`` (plain LangGraph).
        workdir: Folder for the databases of this drill.
        tickets: The batch.
        customers: CRM records the tickets refer to.
        kill_points: ``(service, "before" | "after"[, about])``: the next call of that
            service (about that order or customer, if given) kills the worker, before or
            right after it performs the effect.
        timed_kills: Extra SIGKILLs sent to the worker at random moments (these depend on
            the machine's speed: a drill that must give the same figures every run uses
            kill points only).
        conn_string: Storage of the runs (default: a SQLite file in ``workdir``).
        seed: Seed of the random kill moments.
        max_runs: Upper bound on worker restarts (a drill never loops forever).
        density: The agent's checkpoint density.
        on_event: Called, from this thread, with each :class:`DrillEvent` as it happens.
        fork_server: Fork each worker from a server process that imported the library once
            (a restart takes milliseconds, not an interpreter start-up), instead of starting
            a new interpreter per run. Each worker is a fresh process either way.
    """
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    services_path = str(workdir / f"{mode}-services.db")
    conn = conn_string or f"sqlite:///{workdir / f'{mode}-runs.db'}"
    services = Services(services_path)
    services.seed_customers(customers)
    for service, phase, *about in kill_points:
        services.plant_kill(service, phase, about=about[0] if about else None)
    batch_file = workdir / f"{mode}-batch.json"
    batch_file.write_text(json.dumps(tickets))
    args = [mode, conn, services_path, str(batch_file), density]
    worker = [sys.executable, "-m", "taskpilots_graph.demo.worker"]
    # Fork needs os.fork (not on Windows): elsewhere every run starts an interpreter.
    forking = fork_server and hasattr(os, "fork")
    server = _ForkServer([*worker, "--serve", *args]) if forking else None
    started = time.perf_counter()
    kills = runs = fired = 0
    try:
        while runs < max_runs:
            runs += 1
            delay = rng.uniform(0.05, 2.5) if timed_kills > 0 else None
            if server is not None:
                code, timed = server.run(delay, on_event, runs)
            else:
                code, timed = _spawn([*worker, *args], delay, on_event, runs)
            timed_kills -= timed
            if code == -signal.SIGKILL:
                kills += 1
                sites = services.kills_fired()
                # No kill point fired during this run: the kill was a timed one.
                site = _kill_site(*sites[-1]) if len(sites) > fired else "at a random moment"
                fired = len(sites)
                if on_event is not None:
                    on_event(DrillEvent("killed", site))
                continue
            if code != 0:
                raise RuntimeError(f"worker exited with {code}; see its output above")
            break
    finally:
        if server is not None:
            server.close()
    closed, uncertain, incomplete, keys = _outcomes(mode, conn, services, tickets)
    counts = {c.service: c.performed for c in services.effect_counts()}
    return DrillReport(
        mode=mode,
        tickets=len(tickets),
        closed=closed,
        stopped_uncertain=uncertain,
        incomplete=incomplete,
        effects={s: counts.get(s, 0) for s in SIDE_EFFECT_SERVICES},
        duplicates=sum(c.duplicates for c in services.effect_counts()),
        kills=kills,
        worker_runs=runs,
        seconds=round(time.perf_counter() - started, 2),
        uncertain_keys=keys,
        kill_sites=[_kill_site(*fired) for fired in services.kills_fired()],
    )
