"""Thread leases for runs and business locks for side effects, on real stores.

* Two real processes start the same thread at once, round after round: exactly one runs,
  the other gets ``ThreadBusy``, and no checkpoint write is lost (SQLite, Redis, PostgreSQL).
* A business lock held by another owner: the side effect waits for it, or fails closed and
  is retried later; the tool never runs while the lock is held elsewhere.
* Redis stopped mid-run: the side effect does not run unlocked, the router waits per
  policy; after Redis is back ``tp.resume`` completes it exactly once.
* The fencing token is on the ledger entry and in ``current_invocation()``.
* A thread lease lost mid-run stops the run with ``LeaseLost`` before the next effect.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _models import PlanModel
from _services import RedisServer, start_redis
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph import RecoveryCheckpointer, testing
from taskpilots_graph.errors import LeaseLost, LockBackendUnavailable, ToolWaiting
from taskpilots_graph.locks import (
    LeaseBackend,
    RedisLeaseBackend,
    business_lock_name,
    lease_backend_from_url,
    thread_lease_name,
)
from taskpilots_graph.policy import Backoff, ToolPolicy

ROUNDS = 20
SCALE_OUT_ROUNDS = 50
RUN_SECONDS = 0.15  # how long the racing side effect takes: the winner surely holds the lease
PARK = ToolPolicy(backoff=Backoff(initial=60, jitter=False), wait_window=3600)  # → ToolWaiting


def _go(text: str = "go") -> dict[str, Any]:
    return {"messages": [HumanMessage(text)]}


def _db(path: str) -> str:
    return f"sqlite:///{path}"


# --- two processes, one thread ----------------------------------------------------------------


def _record(note: str) -> str:
    time.sleep(RUN_SECONDS)
    return f"recorded {note}"


def _race(
    db_url: str,
    lease_url: str,
    thread_id: str,
    rounds: int,
    barrier: Any,
    results: Any,
) -> None:
    """One racing worker (module level: the "spawn" context pickles it by name)."""
    try:
        outcomes: list[str] = []
        record = StructuredTool.from_function(_record, name="record", description="record")
        with (
            RecoveryCheckpointer.from_conn_string(db_url) as cp,
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
                    tp.run(graph, thread_id, _go(f"round {round_}"))
                    outcomes.append("ran")
                except tp.ThreadBusy:
                    outcomes.append("busy")
        results.put(("ok", outcomes))
    except BaseException:
        barrier.abort()
        results.put(("error", traceback.format_exc()))


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("redis", marks=[pytest.mark.redis, pytest.mark.postgres]),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def stores(request: pytest.FixtureRequest, sqlite_path: str) -> tuple[str, str]:
    """(checkpointer URL, lease URL), set up: SQLite for both, PostgreSQL + Redis (the
    scale-out configuration), or PostgreSQL for both."""
    if request.param == "sqlite":
        db = lease_url = _db(sqlite_path)
    else:
        db = str(request.getfixturevalue("postgres_url"))
        lease_url = db if request.param == "postgres" else str(request.getfixturevalue("redis_url"))
    with RecoveryCheckpointer.from_conn_string(db) as cp, lease_backend_from_url(lease_url) as lb:
        cp.setup()
        lb.setup()
    return db, lease_url


def test_two_processes_racing_for_one_thread(stores: tuple[str, str]) -> None:
    """Rounds of two processes starting one thread at once: one runs, one gets ThreadBusy."""
    db, lease_url = stores
    # The scale-out configuration races 50 rounds; the embedded ones 20, to keep the suite fast.
    rounds = SCALE_OUT_ROUNDS if lease_url.startswith("redis") else ROUNDS
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2, timeout=60)
    results = context.Queue()
    children = [
        context.Process(target=_race, args=(db, lease_url, "t", rounds, barrier, results))
        for _ in range(2)
    ]
    for child in children:
        child.start()
    try:
        reports = [results.get(timeout=90) for _ in children]
    except queue.Empty:
        pytest.fail("a racing process did not report")
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    errors = [body for status, body in reports if status == "error"]
    assert not errors, errors[0]
    first, second = (body for _, body in reports)
    for a, b in zip(first, second, strict=True):
        assert sorted((a, b)) == ["busy", "ran"]  # exactly one ran each round

    with RecoveryCheckpointer.from_conn_string(db) as cp:
        history = list(cp.list({"configurable": {"thread_id": "t"}}))
        messages = history[0].checkpoint["channel_values"]["messages"]
        asked = [m.content for m in messages if isinstance(m, HumanMessage)]
        assert asked == [f"round {i}" for i in range(rounds)]  # one run per round, none lost
        answers = [m.content for m in messages if isinstance(m, ToolMessage)]
        assert answers == [f"recorded round {i}" for i in range(rounds)]
        entries = cp.ledger("t")
        assert [e.status for e in entries] == ["committed"] * rounds
        assert sorted(e.args["note"] for e in entries) == sorted(asked)
        # Each checkpoint extends its parent: no run wrote on top of a stale checkpoint.
        ids = {c.config["configurable"]["checkpoint_id"] for c in history}
        parents = [c.parent_config for c in history if c.parent_config is not None]
        assert all(p["configurable"]["checkpoint_id"] in ids for p in parents)
        assert len(parents) == len(history) - 1  # one chain, one root


# --- business locks ---------------------------------------------------------------------------


class Refunds:
    """A refund service that records the fencing token of every call it receives."""

    def __init__(self) -> None:
        self.fencing: list[int | None] = []
        self.at: list[float] = []

    def tool(self) -> BaseTool:
        def refund(order: str) -> str:
            self.fencing.append(tp.current_invocation().fencing)
            self.at.append(time.monotonic())
            return f"refunded {order}"

        return tp.side_effect(
            StructuredTool.from_function(refund, name="refund", description="refund an order"),
            lock=lambda args: f"order-{args['order']}:refund",
        )


REFUND_LOCK = business_lock_name("order-42", "refund")


@pytest.fixture
def leased_cp(sqlite_path: str) -> Iterator[tuple[RecoveryCheckpointer, LeaseBackend]]:
    """A checkpointer and SQLite leases in the same file."""
    with (
        RecoveryCheckpointer.from_conn_string(_db(sqlite_path)) as cp,
        lease_backend_from_url(_db(sqlite_path)) as leases,
    ):
        cp.setup()
        yield cp, leases


def _refund_agent(
    cp: RecoveryCheckpointer, leases: LeaseBackend, refunds: Refunds, **options: Any
) -> Any:
    return tp.create_recovery_agent(
        PlanModel(plan=[("refund", {"order": "42"})]),
        [refunds.tool()],
        checkpointer=cp,
        leases=leases,
        **options,
    )


def test_side_effect_waits_for_a_business_lock_held_elsewhere(
    leased_cp: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """The lock is released while the call waits: the tool runs only after the release."""
    cp, leases = leased_cp
    refunds = Refunds()
    graph = _refund_agent(cp, leases, refunds, lease_ttl=2.0)
    other = leases.acquire(REFUND_LOCK, "other-agent", 30)
    assert other is not None
    released: list[float] = []

    def release() -> None:
        released.append(time.monotonic())
        leases.release(other)

    timer = threading.Timer(0.3, release)
    timer.start()
    try:
        result = tp.run(graph, "t", _go())
    finally:
        timer.join()
    assert result["messages"][-1].content == "done"
    assert len(refunds.at) == 1
    assert refunds.at[0] > released[0]  # never while the other owner held the lock
    (fencing,) = refunds.fencing
    assert fencing is not None
    assert fencing > other.fencing
    (entry,) = cp.ledger("t")
    assert (entry.status, entry.lock, entry.extra["fencing"]) == (
        "committed",
        "order-42:refund",
        fencing,
    )


def test_side_effect_fails_closed_while_the_business_lock_is_held(
    leased_cp: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """Held throughout: the call fails closed (nothing run or written) and waits per policy."""
    cp, leases = leased_cp
    refunds = Refunds()
    graph = _refund_agent(cp, leases, refunds, lease_ttl=0.5, default_policy=PARK)
    other = leases.acquire(REFUND_LOCK, "other-agent", 30)
    assert other is not None
    with testing.fake_clock() as clock:
        with pytest.raises(ToolWaiting) as waiting:
            tp.run(graph, "t", _go())
        assert refunds.at == []
        assert cp.ledger("t") == []  # not even an intent: nothing happened
        (step,) = graph.get_state({"configurable": {"thread_id": "t"}}).values["steps"].values()
        assert step["failure"]["kind"] == "transient"
        assert step["failure"]["error_type"].endswith("ThreadBusy")
        failed = [e for e in cp.events("t") if e.kind is tp.EventKind.TOOL_FAILED]
        assert failed[0].payload["maybe_sent"] is False

        assert leases.release(other)
        clock.advance(waiting.value.retry_at - clock.now())
        result = tp.resume(graph, "t")
    assert result["messages"][-1].content == "done"
    assert len(refunds.fencing) == 1
    (entry,) = cp.ledger("t")
    assert entry.extra["fencing"] == refunds.fencing[0]


def test_lock_without_lease_backend_is_enforced_in_the_checkpointers_database(
    leased_cp: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """No lease backend named: ``lock=`` is enforced all the same, in the checkpointer's own
    SQLite file; held elsewhere, the call fails closed (nothing run or written)."""
    cp, leases = leased_cp
    refunds = Refunds()
    graph = tp.create_recovery_agent(
        PlanModel(plan=[("refund", {"order": "42"})]),
        [refunds.tool()],
        checkpointer=cp,
        lease_ttl=0.5,
        default_policy=PARK,
    )
    other = leases.acquire(REFUND_LOCK, "other-agent", 30)  # same file, another owner
    assert other is not None
    with testing.fake_clock() as clock:
        with pytest.raises(ToolWaiting) as waiting:
            tp.run(graph, "t", _go())
        assert refunds.at == []
        assert cp.ledger("t") == []
        assert leases.release(other)
        clock.advance(waiting.value.retry_at - clock.now())
        tp.resume(graph, "t")
    (fencing,) = refunds.fencing
    assert fencing is not None
    assert fencing > other.fencing
    (entry,) = cp.ledger("t")
    assert (entry.lock, entry.extra["fencing"]) == ("order-42:refund", fencing)


def test_lock_name_split() -> None:
    """Split on the last ':'; without one the whole name is the object, the tool the operation."""
    from taskpilots_graph.engine._locks import lock_target

    assert lock_target("order-42:refund", "t") == ("order-42", "refund")
    assert lock_target("tenant:a:order-42:refund", "t") == ("tenant:a:order-42", "refund")
    assert lock_target("order-42", "refund_tool") == ("order-42", "refund_tool")
    assert lock_target("order-42:", "refund_tool") == ("order-42:", "refund_tool")


# --- thread leases ------------------------------------------------------------------------------


def test_second_runner_gets_thread_busy_or_waits(
    leased_cp: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """Another holder of the thread: run / resume raise ThreadBusy; ``wait=True`` waits."""
    cp, leases = leased_cp
    refunds = Refunds()
    graph = _refund_agent(cp, leases, refunds, lease_ttl=2.0)
    other = leases.acquire(thread_lease_name("t"), "other-runner", 30)
    assert other is not None
    with pytest.raises(tp.ThreadBusy) as busy:
        tp.run(graph, "t", _go())
    assert busy.value.holder == "other-runner"
    with pytest.raises(tp.ThreadBusy):
        tp.resume(graph, "t")
    assert refunds.at == []
    timer = threading.Timer(0.3, leases.release, args=(other,))
    timer.start()
    try:
        result = tp.run(graph, "t", _go(), wait=True)
    finally:
        timer.join()
    assert result["messages"][-1].content == "done"
    assert len(refunds.at) == 1
    assert leases.holder(thread_lease_name("t")) is None  # released after the run


def test_lost_thread_lease_stops_the_run_before_the_next_effect(
    leased_cp: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """The lease is taken over during a pure step: the next side effect never runs."""
    cp, leases = leased_cp
    refunds = Refunds()
    name = thread_lease_name("t")

    def lookup(order: str) -> str:
        current = leases.holder(name)
        assert current is not None
        leases.release(current)  # another runner takes the thread over ...
        assert leases.acquire(name, "usurper", 30) is not None
        time.sleep(0.4)  # ... and our heartbeat (every 0.1 s) notices
        return f"order {order}: paid"

    graph = tp.create_recovery_agent(
        PlanModel(plan=[("lookup", {"order": "42"}), ("refund", {"order": "42"})]),
        [
            StructuredTool.from_function(lookup, name="lookup", description="look up"),
            refunds.tool(),
        ],
        checkpointer=cp,
        leases=leases,
        lease_ttl=0.3,
    )
    with pytest.raises(LeaseLost):
        tp.run(graph, "t", _go())
    assert refunds.at == []
    assert cp.ledger("t") == []  # stopped before the intent


async def test_async_run_holds_the_lease_and_passes_fencing(
    leased_cp: tuple[RecoveryCheckpointer, LeaseBackend], sqlite_path: str
) -> None:
    """``arun`` / ``aresume``: ThreadBusy for a held thread; the lock's fencing is recorded."""
    _, leases = leased_cp
    refunds = Refunds()
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(_db(sqlite_path)) as acp:
        graph = _refund_agent(acp, leases, refunds, lease_ttl=2.0)  # type: ignore[arg-type]
        other = leases.acquire(thread_lease_name("t"), "other-runner", 30)
        assert other is not None
        with pytest.raises(tp.ThreadBusy):
            await tp.arun(graph, "t", _go())
        leases.release(other)
        result = await tp.arun(graph, "t", _go())
        assert result["messages"][-1].content == "done"
        (entry,) = await acp.aledger("t")
    (fencing,) = refunds.fencing
    assert fencing is not None
    assert entry.extra["fencing"] == fencing


# --- Redis outage -------------------------------------------------------------------------------


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis server of this test's own, which it may stop and start again."""
    server = start_redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.redis
def test_redis_outage_mid_run_fails_closed_then_resume_completes_once(
    own_redis: RedisServer, sqlite_path: str
) -> None:
    """Redis stops before the side effect: it is not run unlocked, the run waits per policy
    (EXTERNAL_OUTAGE); after Redis is back, ``tp.resume`` completes it exactly once."""
    refunds = Refunds()

    def lookup(order: str) -> str:
        own_redis.stop()
        return f"order {order}: paid"

    with (
        RecoveryCheckpointer.from_conn_string(_db(sqlite_path)) as cp,
        RedisLeaseBackend(own_redis.url, timeout=0.5) as leases,
    ):
        cp.setup()
        graph = tp.create_recovery_agent(
            PlanModel(plan=[("lookup", {"order": "42"}), ("refund", {"order": "42"})]),
            [
                StructuredTool.from_function(lookup, name="lookup", description="look up"),
                refunds.tool(),
            ],
            checkpointer=cp,
            leases=leases,
            lease_ttl=10,
            default_policy=PARK,
        )
        with testing.fake_clock() as clock:
            with pytest.raises(ToolWaiting) as waiting:
                tp.run(graph, "t", _go())
            assert refunds.at == []  # never unlocked
            assert cp.ledger("t") == []
            values = graph.get_state({"configurable": {"thread_id": "t"}}).values
            refund = next(s for s in values["steps"].values() if s["tool"] == "refund")
            assert refund["status"] == "waiting_tool"
            assert refund["failure"]["kind"] == "external_outage"
            assert refund["failure"]["error_type"].endswith("LockBackendUnavailable")
            with pytest.raises(LockBackendUnavailable):
                tp.resume(graph, "t")  # cannot even take the thread lease: nothing runs

            own_redis.start()
            clock.advance(waiting.value.retry_at - clock.now())
            result = tp.resume(graph, "t")
        assert result["messages"][-1].content == "done"
        assert len(refunds.fencing) == 1  # exactly once, no duplicate
        (entry,) = cp.ledger("t")
        assert entry.status == "committed"
        assert entry.extra["fencing"] == refunds.fencing[0]
