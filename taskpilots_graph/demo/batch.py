"""Run the ticket batch in worker processes, SIGKILL them, resume, and count side effects.

``run_batch`` is what one worker process does: start every ticket's thread, or resume it by
thread id if it already exists. ``drill`` is the supervisor: it plants kill points in the
simulated services (and optionally kills at random moments), restarts the worker after every
SIGKILL until the batch is done, and reports what the services performed.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnableConfig

from taskpilots_graph.checkpointers.density import Density
from taskpilots_graph.demo.model import ScriptedTicketModel
from taskpilots_graph.demo.services import Phase, Services
from taskpilots_graph.demo.workflow import build_plain_graph, build_recovery_agent

__all__ = ["DrillReport", "Mode", "drill", "make_batch", "run_batch"]

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


def _ready() -> None:
    print(READY, flush=True)


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
                    continue  # stopped on a named effect; a person decides
        return
    with _plain_saver(conn_string) as saver:
        saver.setup()
        _ready()
        graph = build_plain_graph(model, services, saver)
        for ticket in tickets:
            cfg = {"configurable": {"thread_id": thread_id(ticket)}}
            if saver.get_tuple(cfg) is None:
                graph.invoke({"messages": [HumanMessage(json.dumps(ticket))]}, cfg)
            else:
                state = graph.get_state(cfg)
                if state.next or state.tasks:
                    graph.invoke(None, cfg)


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

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def _outcomes(
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


def drill(
    mode: Mode,
    workdir: Path,
    tickets: list[dict[str, Any]],
    customers: list[dict[str, str]],
    *,
    kill_points: list[tuple[str, Phase]],
    timed_kills: int = 0,
    conn_string: str | None = None,
    seed: int = 0,
    max_runs: int = 200,
    density: Density = "every_step",
) -> DrillReport:
    """Run the batch in child processes under SIGKILLs until every ticket is settled.

    Args:
        mode: ``"agent"`` (the recovery agent) or ``"plain"`` (plain LangGraph).
        workdir: Folder for the databases of this drill.
        tickets: The batch.
        customers: CRM records the tickets refer to.
        kill_points: ``(service, "before" | "after")``: the next call of that service kills
            the worker, before or right after it performs the effect.
        timed_kills: Extra SIGKILLs sent to the worker at random moments.
        conn_string: Storage of the runs (default: a SQLite file in ``workdir``).
        seed: Seed of the random kill moments.
        max_runs: Upper bound on worker restarts (a drill never loops forever).
        density: The agent's checkpoint density.
    """
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    services_path = str(workdir / f"{mode}-services.db")
    conn = conn_string or f"sqlite:///{workdir / f'{mode}-runs.db'}"
    services = Services(services_path)
    services.seed_customers(customers)
    for service, phase in kill_points:
        services.plant_kill(service, phase)
    batch_file = workdir / f"{mode}-batch.json"
    batch_file.write_text(json.dumps(tickets))
    cmd = [
        sys.executable,
        "-m",
        "taskpilots_graph.demo.worker",
        mode,
        conn,
        services_path,
        str(batch_file),
        density,
    ]
    started = time.perf_counter()
    kills = runs = 0
    while runs < max_runs:
        runs += 1
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        # Interpreter start-up takes seconds on a loaded machine: a kill timed from spawn
        # would mostly land in the imports, before any tool ran.
        proc.stdout.readline()
        if timed_kills > 0:
            try:
                proc.wait(timeout=rng.uniform(0.05, 2.5))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                timed_kills -= 1
        proc.stdout.read()
        code = proc.wait()
        if code == -signal.SIGKILL:
            kills += 1
            continue
        if code != 0:
            raise RuntimeError(f"worker exited with {code}; see its output above")
        break
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
    )
