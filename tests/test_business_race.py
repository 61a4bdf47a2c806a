"""Two agents race for one business operation 50 times, on PostgreSQL + Redis.

(Two processes racing for the *same thread* are in ``tests/test_leases.py``.)

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
