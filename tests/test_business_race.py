"""Races over 50 rounds on PostgreSQL + Redis: one thread, and one business operation.

* Two processes start the *same thread* at once, 50 times (as ``tests/test_leases.py`` does
  for 20 rounds per backend; here the 50 of issue 7):
  every round exactly one runs, the other gets ``ThreadBusy``; no checkpoint write is lost.
* Two agents on *different threads* race for the same business operation 50 times. Two
  processes each run their own agent, on threads of their own, released by a barrier at
the same instant every round. Both decide to charge the same order; the tool is declared
with a business key (``charge:<order>``, global across threads and agents) and a business
lock (``order-<order>:charge``, in Redis). The payment service (a SQLite file outside both
processes) must see exactly one charge per order, and the losing agent must get the
winner's recorded result instead of charging again.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _models import PlanModel
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool

import taskpilots_graph as tp
from taskpilots_graph import RecoveryCheckpointer
from taskpilots_graph.demo.services import Services
from taskpilots_graph.locks import lease_backend_from_url

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

ROUNDS = 50
RUN_SECONDS = 0.15  # how long the racing side effect takes: the winner surely holds the lease


def _record(note: str) -> str:
    time.sleep(RUN_SECONDS)
    return f"recorded {note}"


def _race(db: str, lease_url: str, rounds: int, barrier: Any, results: Any) -> None:
    """One racing runner: every round, start thread ``t`` with a new message."""
    try:
        outcomes: list[str] = []
        record = StructuredTool.from_function(_record, name="record", description="record")
        with (
            RecoveryCheckpointer.from_conn_string(db) as cp,
            lease_backend_from_url(lease_url) as leases,
        ):
            graph = tp.create_recovery_agent(
                PlanModel(plan=[("record", {"note": "$msg"})]),
                [tp.side_effect(record)],
                checkpointer=cp,
                leases=leases,
                lease_ttl=10,
                memory_window=None,  # the check below reads every answer from the state
            )
            for round_ in range(rounds):
                barrier.wait()
                try:
                    tp.run(graph, "t", {"messages": [HumanMessage(f"round {round_}")]})
                    outcomes.append("ran")
                except tp.ThreadBusy:
                    outcomes.append("busy")
        results.put(("ok", outcomes))
    except BaseException:
        barrier.abort()
        results.put(("error", traceback.format_exc()))


def test_two_processes_start_one_thread_fifty_times(postgres_url: str, redis_url: str) -> None:
    """50 rounds of two processes starting one thread: one runs, one gets ThreadBusy, and
    the checkpoint history holds all 50 runs (none lost)."""
    with RecoveryCheckpointer.from_conn_string(postgres_url) as cp:
        cp.setup()
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2, timeout=60)
    results = context.Queue()
    racers = [
        context.Process(target=_race, args=(postgres_url, redis_url, ROUNDS, barrier, results))
        for _ in range(2)
    ]
    for racer in racers:
        racer.start()
    try:
        reports = [results.get(timeout=180) for _ in racers]
    except queue.Empty:
        pytest.fail("a racing process did not report")
    finally:
        for racer in racers:
            racer.join(timeout=10)
            if racer.is_alive():
                racer.kill()
    errors = [body for status, body in reports if status == "error"]
    assert not errors, errors[0]
    first, second = (body for _, body in reports)
    for a, b in zip(first, second, strict=True):
        assert sorted((a, b)) == ["busy", "ran"]  # exactly one ran each round
    with RecoveryCheckpointer.from_conn_string(postgres_url) as cp:
        history = list(cp.list({"configurable": {"thread_id": "t"}}))
        latest = history[0].checkpoint["channel_values"]["messages"]
        asked = [m.content for m in latest if isinstance(m, HumanMessage)]
        assert asked == [f"round {i}" for i in range(ROUNDS)]  # one run per round, none lost
        answers = [m.content for m in latest if isinstance(m, ToolMessage)]
        assert answers == [f"recorded round {i}" for i in range(ROUNDS)]
        entries = cp.ledger("t")
        assert sorted(str(e.args["note"]) for e in entries) == sorted(asked)
        # Each checkpoint extends its parent: no run wrote on top of a stale checkpoint.
        ids = {c.config["configurable"]["checkpoint_id"] for c in history}
        parents = [c.parent_config for c in history if c.parent_config is not None]
        assert all(p["configurable"]["checkpoint_id"] in ids for p in parents)
        assert len(parents) == len(history) - 1  # one chain, one root
        assert [e.status for e in entries] == ["committed"] * ROUNDS


def _agent_process(
    agent: str,
    db: str,
    lease_url: str,
    services_path: str,
    barrier: Any,
    results: Any,
) -> None:
    """One agent: every round, charge order ``o<round>`` on its own thread."""
    try:
        services = Services(services_path, latency_s=0.02)

        def charge(order: str) -> str:
            inv = tp.current_invocation()
            return services.create_ticket(f"charge:{order}", f"charge {order}", inv.key)

        tool = tp.side_effect(
            StructuredTool.from_function(charge, name="charge", description="charge an order"),
            key=lambda args: f"charge:{args['order']}",
            lock=lambda args: f"order-{args['order']}:charge",
        )
        answers: list[str] = []
        with (
            RecoveryCheckpointer.from_conn_string(db) as cp,
            lease_backend_from_url(lease_url) as leases,
        ):
            for round_ in range(ROUNDS):
                graph = tp.create_recovery_agent(
                    PlanModel(plan=[("charge", {"order": f"o{round_}"})]),
                    [tool],
                    checkpointer=cp,
                    leases=leases,
                    lease_ttl=10,
                    name=agent,
                )
                barrier.wait()
                values = tp.run(graph, f"{agent}-{round_}", {"messages": [HumanMessage("go")]})
                (answer,) = [m for m in values["messages"] if isinstance(m, ToolMessage)]
                answers.append(str(answer.content))
        results.put((agent, "ok", answers))
    except BaseException:
        barrier.abort()
        results.put((agent, "error", traceback.format_exc()))


def test_two_agents_race_for_one_business_operation_fifty_times(
    postgres_url: str, redis_url: str, tmp_path: Path
) -> None:
    """50 rounds: one charge per order, the loser gets the winner's recorded result."""
    services = Services(str(tmp_path / "payments.db"))
    with RecoveryCheckpointer.from_conn_string(postgres_url) as cp:
        cp.setup()
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2, timeout=90)
    results = context.Queue()
    agents = [
        context.Process(
            target=_agent_process,
            args=(name, postgres_url, redis_url, services.path, barrier, results),
        )
        for name in ("agent-a", "agent-b")
    ]
    for process in agents:
        process.start()
    try:
        reports = {}
        for _ in agents:
            name, status, body = results.get(timeout=180)
            assert status == "ok", body
            reports[name] = body
    except queue.Empty:
        pytest.fail("an agent process did not report")
    finally:
        for process in agents:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()

    effects = services.effects()
    assert sum(c.duplicates for c in services.effect_counts()) == 0
    assert sorted(e["identity"] for e in effects) == sorted(f"charge:o{i}" for i in range(ROUNDS))
    performed = {e["identity"]: e["payload"]["id"] for e in effects}
    winners = []
    with RecoveryCheckpointer.from_conn_string(postgres_url) as cp:
        ledger = {e.key: e for e in cp.ledger()}
        for round_ in range(ROUNDS):
            effect_id = performed[f"charge:o{round_}"]
            # Both agents answered with the one charge: the loser got the recorded result.
            assert reports["agent-a"][round_] == reports["agent-b"][round_] == effect_id
            entry = ledger[f"charge:o{round_}"]
            assert entry.status == "committed"
            assert entry.extra["fencing"] is not None
            winner = entry.thread_id.rsplit("-", 1)[0]
            winners.append(winner)
            loser = "agent-b" if winner == "agent-a" else "agent-a"
            skipped = [
                e for e in cp.events(f"{loser}-{round_}") if e.kind is tp.EventKind.TOOL_SKIPPED
            ]
            assert len(skipped) == 1, f"round {round_}: the loser did not replay the record"
    assert set(winners) <= {"agent-a", "agent-b"}
    assert len(ledger) == ROUNDS  # one entry per business key, whichever thread won
    print(f"\nbusiness race: wins {Counter(winners)} over {ROUNDS} rounds, 0 duplicate charges")
