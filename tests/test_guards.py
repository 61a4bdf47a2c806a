"""Guards inside the graph, with the default set-up: no lease backend named anywhere.

The thread lease and business locks live in the checkpointer's own database (a SQLite file,
PostgreSQL), and the compiled agent's own ``invoke`` holds the lease, so plain LangGraph
code is guarded as much as ``tp.run``:

* two processes refund one order on two threads (``key="refund:<order>"``,
  ``lock="order:<order>:refund"``) through plain ``graph.invoke``, 20 rounds: one refund
  per order, counted by a payment service that keeps its state in a SQLite file of its own;
* two processes invoke one thread at once, 20 rounds: one runs, the other gets
  ``ThreadBusy``;
* two people answer ``retry`` on one pending takeover at once, 20 rounds: one shipment;
* in process: an ``intended`` entry whose writer still holds its thread lease is waited
  for (its recorded result is returned), ``EffectInProgress`` when the wait runs out, and an
  entry whose owner is gone is reconciled as an orphan; the middleware form holds the lease
  while a tool runs and enforces ``lock=``.

Models decide only from the messages they receive (:mod:`_models`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from _models import PlanModel
from _race import race
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph import RecoveryCheckpointer
from taskpilots_graph.demo.services import Services
from taskpilots_graph.errors import EffectInProgress, NoPendingTakeover
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus, args_digest
from taskpilots_graph.locks import (
    SqliteLeaseBackend,
    business_lock_name,
    default_lease_backend,
    thread_lease_name,
)

pytestmark = pytest.mark.slow

ROUNDS = 20
RUN_SECONDS = 0.2  # how long a racing side effect takes: the winner surely holds its lease


def _go(text: str = "go") -> dict[str, Any]:
    return {"messages": [HumanMessage(text)]}


def _on(thread_id: str) -> Any:
    return {"configurable": {"thread_id": thread_id}}


def _answers(values: dict[str, Any]) -> list[str]:
    return [str(m.content) for m in values["messages"] if isinstance(m, ToolMessage)]


# --- the simulated services and their tools -------------------------------------------------


def refund_tool(services_path: str) -> BaseTool:
    """Refund an order: a business key and a business lock per order."""
    services = Services(services_path, latency_s=0)

    def refund(order: str) -> str:
        time.sleep(RUN_SECONDS)
        return services.issue_refund(f"refund:{order}", 25.0, None)

    return tp.side_effect(
        StructuredTool.from_function(refund, name="refund", description="refund an order"),
        key=lambda args: f"refund:{args['order']}",
        lock=lambda args: f"order:{args['order']}:refund",
    )


def label_tool(services_path: str) -> BaseTool:
    """Print a parcel's shipping label (the default key: one per tool call)."""
    services = Services(services_path, latency_s=0)

    def print_label(parcel: str) -> str:
        time.sleep(RUN_SECONDS)
        return services.create_ticket(f"label:{parcel}", f"label {parcel}", None)

    return tp.side_effect(
        StructuredTool.from_function(print_label, name="print_label", description="print")
    )


def ship_tool(services_path: str, markers: str) -> BaseTool:
    """Hand a parcel to the carrier; the first call of each parcel times out before acting.

    No pre-check and not idempotent: the timeout leaves the effect uncertain, so the run
    stops for a person (``markers`` remembers which parcels timed out already).
    """
    services = Services(services_path, latency_s=0)

    def ship(parcel: str) -> str:
        marker = Path(markers) / parcel
        if not marker.exists():
            marker.touch()
            raise TimeoutError("the carrier did not answer")
        time.sleep(RUN_SECONDS)
        return services.create_ticket(f"ship:{parcel}", f"ship {parcel}", None)

    return tp.side_effect(
        StructuredTool.from_function(ship, name="ship", description="ship a parcel")
    )


def ship_agent(cp: Any, services_path: str, markers: str) -> Any:
    return tp.create_recovery_agent(
        PlanModel(plan=[("ship", {"parcel": "$msg"})]),
        [ship_tool(services_path, markers)],
        checkpointer=cp,
    )


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A set-up database: a SQLite file or a PostgreSQL database of the test's own."""
    url = (
        f"sqlite:///{tmp_path / 'runs.db'}"
        if request.param == "sqlite"
        else str(request.getfixturevalue("postgres_url"))
    )
    with RecoveryCheckpointer.from_conn_string(url) as cp:
        cp.setup()
    return url


# --- (a) two processes, one business operation, two threads -------------------------------


def _refund_racer(db: str, services_path: str, agent: str, barrier: Any) -> list[str]:
    answers: list[str] = []
    with RecoveryCheckpointer.from_conn_string(db) as cp:
        graph = tp.create_recovery_agent(
            PlanModel(plan=[("refund", {"order": "$msg"})]),
            [refund_tool(services_path)],
            checkpointer=cp,
            name=agent,
        )
        for round_ in range(ROUNDS):
            barrier.wait()
            values = graph.invoke(_go(f"o{round_}"), _on(f"{agent}-{round_}"))
            (answer,) = _answers(values)
            answers.append(answer)
    return answers


def test_two_processes_refund_one_order_once(db: str, tmp_path: Path) -> None:
    """20 rounds through plain ``graph.invoke``: one refund per order, both get its id."""
    services = Services(str(tmp_path / "payments.db"))
    first, second = race(
        _refund_racer, [(db, services.path, "agent-a"), (db, services.path, "agent-b")]
    )
    effects = services.effects()
    assert sorted(e["identity"] for e in effects) == sorted(f"refund:o{i}" for i in range(ROUNDS))
    performed = {e["identity"]: e["payload"]["id"] for e in effects}
    for round_ in range(ROUNDS):
        # The loser waited for the winner's lock and returned its recorded refund.
        assert first[round_] == second[round_] == performed[f"refund:o{round_}"]
    with RecoveryCheckpointer.from_conn_string(db) as cp:
        entries = cp.ledger()
    assert len(entries) == ROUNDS
    assert {e.status for e in entries} == {LedgerStatus.COMMITTED}
    assert all(e.extra.get("fencing") is not None for e in entries)  # the lock was held


# --- (b) two processes, one thread ------------------------------------------------------------


def _thread_racer(db: str, services_path: str, barrier: Any) -> list[str]:
    outcomes: list[str] = []
    with RecoveryCheckpointer.from_conn_string(db) as cp:
        graph = tp.create_recovery_agent(
            PlanModel(plan=[("print_label", {"parcel": "$msg"})]),
            [label_tool(services_path)],
            checkpointer=cp,
        )
        for round_ in range(ROUNDS):
            barrier.wait()
            try:
                graph.invoke(_go(f"p{round_}"), _on("t"))
                outcomes.append("ran")
            except tp.ThreadBusy:
                outcomes.append("busy")
    return outcomes


def test_two_processes_invoking_one_thread(db: str, tmp_path: Path) -> None:
    """20 rounds of ``graph.invoke`` on one thread: one runs, the other gets ThreadBusy."""
    services = Services(str(tmp_path / "labels.db"))
    first, second = race(_thread_racer, [(db, services.path), (db, services.path)])
    for a, b in zip(first, second, strict=True):
        assert sorted((a, b)) == ["busy", "ran"]
    identities = [e["identity"] for e in services.effects()]
    assert sorted(identities) == sorted(f"label:p{i}" for i in range(ROUNDS))
    with RecoveryCheckpointer.from_conn_string(db) as cp:
        assert [e.status for e in cp.ledger("t")] == [LedgerStatus.COMMITTED] * ROUNDS


# --- (c) two people answer one takeover -------------------------------------------------------


def _decide_racer(db: str, services_path: str, markers: str, barrier: Any) -> list[str]:
    outcomes: list[str] = []
    with RecoveryCheckpointer.from_conn_string(db) as cp:
        graph = ship_agent(cp, services_path, markers)
        for round_ in range(ROUNDS):
            barrier.wait()
            try:
                tp.decide(graph, f"s{round_}", tp.Decision(action="retry"))
                outcomes.append("ran")
            except tp.ThreadBusy:
                outcomes.append("busy")
            except NoPendingTakeover:
                outcomes.append("answered")  # the other one was quicker and done already
    return outcomes


def test_two_people_retry_one_takeover(db: str, tmp_path: Path) -> None:
    """20 rounds of two ``tp.decide(..., retry)`` at once: the parcel ships once."""
    services = Services(str(tmp_path / "carrier.db"))
    markers = tmp_path / "timed-out"
    markers.mkdir()
    with RecoveryCheckpointer.from_conn_string(db) as cp:
        graph = ship_agent(cp, services.path, str(markers))
        for round_ in range(ROUNDS):
            stopped = graph.invoke(_go(f"p{round_}"), _on(f"s{round_}"))
            assert "__interrupt__" in stopped  # uncertain: a person decides
    assert services.effects() == []

    first, second = race(
        _decide_racer, [(db, services.path, str(markers)), (db, services.path, str(markers))]
    )
    for a, b in zip(first, second, strict=True):
        assert sorted((a, b)) in (["busy", "ran"], ["answered", "ran"])
    identities = sorted(e["identity"] for e in services.effects())
    assert identities == sorted(f"ship:p{i}" for i in range(ROUNDS))


# --- (d) a live intent, in process ------------------------------------------------------------


class Counter:
    """Counts executions of the refund tool and answers its pre-check."""

    def __init__(self, done: Any = None) -> None:
        self.calls = 0
        self.prechecks = 0
        self.done = done

    def tool(self, *, lock: bool = False) -> BaseTool:
        def refund(order: str) -> str:
            self.calls += 1
            return f"refunded {order} here"

        def precheck(key: str, args: dict[str, Any]) -> Any:
            self.prechecks += 1
            return tp.Done(self.done) if self.done is not None else tp.NotDone()

        return tp.side_effect(
            StructuredTool.from_function(refund, name="refund", description="refund an order"),
            key=lambda args: f"refund:{args['order']}",
            precheck=precheck,
            lock=(lambda args: f"order:{args['order']}:refund") if lock else None,
        )


@pytest.fixture
def sqlite_cp(tmp_path: Path) -> Iterator[RecoveryCheckpointer]:
    with RecoveryCheckpointer.from_conn_string(f"sqlite:///{tmp_path / 'runs.db'}") as cp:
        cp.setup()
        yield cp


def _intent(thread_id: str, order: str) -> LedgerEntry:
    now = datetime.now(UTC)
    args = {"order": order}
    return LedgerEntry(
        key=f"refund:{order}",
        thread_id=thread_id,
        tool="refund",
        status=LedgerStatus.INTENDED,
        args=args,
        args_digest=args_digest(args),
        attempt=1,
        created_at=now,
        updated_at=now,
    )


def _live_owner(cp: RecoveryCheckpointer, order: str) -> tuple[LedgerEntry, Any]:
    """Another runner's refund in progress: its intent written, its thread lease held."""
    entry = _intent("owner", order)
    cp.write_ledger(entry, expect=None)
    lease = default_lease_backend(cp).acquire(thread_lease_name("owner"), "elsewhere:1:abc", 30)
    assert lease is not None
    return entry, lease


def _awaited(cp: RecoveryCheckpointer, thread_id: str) -> list[Mapping[str, Any]]:
    return [e.payload for e in cp.events(thread_id) if e.kind is tp.EventKind.INTENT_AWAITED]


def _refund_agent(cp: Any, counter: Counter, **options: Any) -> Any:
    return tp.create_recovery_agent(
        PlanModel(plan=[("refund", {"order": "o1"})]), [counter.tool()], checkpointer=cp, **options
    )


def test_live_intent_is_waited_for_then_its_result_returned(
    sqlite_cp: RecoveryCheckpointer,
) -> None:
    """The owner commits while we wait: its result comes back; no pre-check, no second call."""
    entry, _ = _live_owner(sqlite_cp, "o1")
    counter = Counter(done="refund-by-precheck")
    graph = _refund_agent(sqlite_cp, counter)

    def commit() -> None:
        done = replace(entry, status=LedgerStatus.COMMITTED, result="refund-r1")
        sqlite_cp.write_ledger(done, expect=(LedgerStatus.INTENDED, 1))

    timer = threading.Timer(0.4, commit)
    timer.start()
    try:
        values = graph.invoke(_go(), _on("waiter"))
    finally:
        timer.join()
    assert _answers(values) == ["refund-r1"]
    assert (counter.calls, counter.prechecks) == (0, 0)
    (awaited,) = _awaited(sqlite_cp, "waiter")
    assert (awaited["owner_thread"], awaited["holder"], awaited["outcome"]) == (
        "owner",
        "elsewhere:1:abc",
        "committed",
    )
    assert awaited["waited_s"] > 0


def test_live_intent_past_the_wait_raises_effect_in_progress(
    sqlite_cp: RecoveryCheckpointer,
) -> None:
    """The owner neither finishes nor dies within the wait: EffectInProgress, nothing run."""
    _live_owner(sqlite_cp, "o1")
    counter = Counter(done="refund-by-precheck")
    graph = _refund_agent(sqlite_cp, counter, lease_ttl=0.5)
    with pytest.raises(EffectInProgress) as busy:
        graph.invoke(_go(), _on("waiter"))
    assert (busy.value.key, busy.value.tool, busy.value.owner_thread) == (
        "refund:o1",
        "refund",
        "owner",
    )
    assert "'refund:o1'" in str(busy.value)
    assert "'owner'" in str(busy.value)
    assert (counter.calls, counter.prechecks) == (0, 0)
    assert sqlite_cp.ledger_entry("refund:o1").status is LedgerStatus.INTENDED  # type: ignore[union-attr]
    (awaited,) = _awaited(sqlite_cp, "waiter")
    assert awaited["outcome"] == "in_progress"


def test_intent_whose_owner_is_gone_is_reconciled(sqlite_cp: RecoveryCheckpointer) -> None:
    """The owner's lease goes while we wait, its entry still intended: an orphan, so the
    pre-check settles it (Done: its result is recorded, the tool is not called)."""
    _, lease = _live_owner(sqlite_cp, "o1")
    counter = Counter(done="refund-found-by-precheck")
    graph = _refund_agent(sqlite_cp, counter)
    timer = threading.Timer(0.4, default_lease_backend(sqlite_cp).release, args=(lease,))
    timer.start()
    try:
        values = graph.invoke(_go(), _on("waiter"))
    finally:
        timer.join()
    assert _answers(values) == ["refund-found-by-precheck"]
    assert (counter.calls, counter.prechecks) == (0, 1)
    entry = sqlite_cp.ledger_entry("refund:o1")
    assert entry is not None
    assert entry.status is LedgerStatus.COMMITTED
    (awaited,) = _awaited(sqlite_cp, "waiter")
    assert awaited["outcome"] == "intended"


def test_an_intent_taken_over_under_a_business_key_is_live_while_its_new_runner_runs(
    sqlite_cp: RecoveryCheckpointer,
) -> None:
    """Thread "first" left an orphan intent; thread "second" reconciles it (NotDone) and
    performs it again under the shared business key. While second's call runs, the entry
    is second's: a third thread waits for it instead of pre-checking and executing again,
    and first's unfinished-work check does not take it for an orphan of its own."""
    from taskpilots_graph.unfinished import orphan_intents

    sqlite_cp.write_ledger(_intent("first", "o1"), expect=None)
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def refund(order: str) -> str:
        calls.append(order)
        started.set()
        assert release.wait(10)
        return f"refunded {order}"

    prechecks: list[str] = []

    def precheck(key: str, args: dict[str, Any]) -> Any:
        prechecks.append(key)
        return tp.NotDone()

    tool = tp.side_effect(
        StructuredTool.from_function(refund, name="refund", description="refund an order"),
        key=lambda args: f"refund:{args['order']}",
        precheck=precheck,
    )
    graph = tp.create_recovery_agent(
        PlanModel(plan=[("refund", {"order": "o1"})]), [tool], checkpointer=sqlite_cp
    )
    results: dict[str, Any] = {}

    def run(thread_id: str) -> None:
        results[thread_id] = graph.invoke(_go(), _on(thread_id))

    second = threading.Thread(target=run, args=("second",))
    second.start()
    assert started.wait(10)
    entry = sqlite_cp.ledger_entry("refund:o1")
    assert entry is not None
    assert (entry.thread_id, entry.extra.get("runner")) == ("first", "second")
    assert orphan_intents(sqlite_cp.ledger("first")) == []

    third = threading.Thread(target=run, args=("third",))
    third.start()
    time.sleep(0.3)  # third is waiting on second's lease by now
    release.set()
    second.join(10)
    third.join(10)
    assert (calls, prechecks) == (["o1"], ["refund:o1"])
    assert _answers(results["third"]) == ["refunded o1"]
    (awaited,) = _awaited(sqlite_cp, "third")
    assert (awaited["owner_thread"], awaited["outcome"]) == ("second", "committed")


def test_orphan_intent_without_a_lease_is_reconciled_at_once(
    sqlite_cp: RecoveryCheckpointer,
) -> None:
    """Nobody holds the owner's lease (its worker died): no waiting, the pre-check decides."""
    sqlite_cp.write_ledger(_intent("owner", "o1"), expect=None)
    counter = Counter()  # NotDone: executed with the same key
    values = _refund_agent(sqlite_cp, counter).invoke(_go(), _on("waiter"))
    assert _answers(values) == ["refunded o1 here"]
    assert (counter.calls, counter.prechecks) == (1, 1)
    assert _awaited(sqlite_cp, "waiter") == []


async def test_async_live_intent_is_waited_for(tmp_path: Path) -> None:
    """``ainvoke`` on the async checkpointer: the same wait, the recorded result returned."""
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    with RecoveryCheckpointer.from_conn_string(url) as cp:
        cp.setup()
        entry, _ = _live_owner(cp, "o1")
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(url) as acp:
        await acp.setup()
        counter = Counter(done="refund-by-precheck")
        graph = _refund_agent(acp, counter)

        async def commit() -> None:
            await asyncio.sleep(0.4)
            done = replace(entry, status=LedgerStatus.COMMITTED, result="refund-r1")
            await acp.awrite_ledger(done, expect=(LedgerStatus.INTENDED, 1))

        committing = asyncio.create_task(commit())
        values = await graph.ainvoke(_go(), _on("waiter"))
        await committing
        assert _answers(values) == ["refund-r1"]
        assert (counter.calls, counter.prechecks) == (0, 0)
        assert [
            e.payload["outcome"]
            for e in await acp.aevents("waiter")
            if e.kind is tp.EventKind.INTENT_AWAITED
        ] == ["committed"]


# --- the graph's own entry points ---------------------------------------------------------------


def test_invoke_holds_the_thread_lease_in_the_checkpointers_database(
    sqlite_cp: RecoveryCheckpointer, tmp_path: Path
) -> None:
    """During ``graph.invoke`` the lease is in the SQLite file (another process would see
    it); a second ``invoke`` / ``stream`` of the thread gets ThreadBusy; ``tp.run`` inside
    the held lease does not wait for itself; the lease is released afterwards."""
    leases = SqliteLeaseBackend(str(tmp_path / "runs.db"))  # what another process opens
    seen: list[Any] = []
    graph: Any = None

    def lookup(order: str) -> str:
        seen.append(leases.holder(thread_lease_name("t")))
        for entry_point in (
            lambda: graph.invoke(_go(), _on("t")),
            lambda: list(graph.stream(_go(), _on("t"))),
        ):
            outcome: list[BaseException] = []

            def other(run: Any = entry_point, out: list[BaseException] = outcome) -> None:
                try:
                    run()
                except BaseException as exc:
                    out.append(exc)

            worker = threading.Thread(target=other)  # a fresh context: another runner
            worker.start()
            worker.join()
            seen.append(outcome[0])
        return f"order {order}: paid"

    graph = tp.create_recovery_agent(
        PlanModel(plan=[("lookup", {"order": "o1"})]),
        [StructuredTool.from_function(lookup, name="lookup", description="look up")],
        checkpointer=sqlite_cp,
    )
    tp.run(graph, "t", _go())
    holder, by_invoke, by_stream = seen
    assert holder is not None
    assert isinstance(by_invoke, tp.ThreadBusy)
    assert isinstance(by_stream, tp.ThreadBusy)
    assert leases.holder(thread_lease_name("t")) is None


def test_lock_is_enforced_for_the_middleware_agent(sqlite_cp: RecoveryCheckpointer) -> None:
    """``create_agent`` + ``RecoveryMiddleware``, no lease backend named: a business lock held
    elsewhere (in the checkpointer's file) keeps the tool from running; while a tool runs
    the thread's lease is held, so a second runner of the thread gets ThreadBusy."""
    from langchain.agents import create_agent

    counter = Counter()
    held = default_lease_backend(sqlite_cp).acquire(
        business_lock_name("order:o1", "refund"), "elsewhere:1:abc", 30
    )
    assert held is not None
    agent: Any = create_agent(
        PlanModel(plan=[("refund", {"order": "o1"})]),
        [counter.tool(lock=True)],
        checkpointer=sqlite_cp,
        middleware=[tp.RecoveryMiddleware(sqlite_cp, lease_ttl=0.3)],
    )
    with pytest.raises(tp.ThreadBusy):
        agent.invoke(_go(), _on("m"))
    assert counter.calls == 0
    assert sqlite_cp.ledger("m") == []  # not even an intent

    assert default_lease_backend(sqlite_cp).release(held)
    during: list[Any] = []

    def refund(order: str) -> str:
        during.append(default_lease_backend(sqlite_cp).holder(thread_lease_name("m2")))
        second: list[BaseException] = []

        def other() -> None:
            try:
                agent.invoke(_go(), _on("m2"))
            except BaseException as exc:
                second.append(exc)

        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        during.extend(second)
        return "refunded"

    tool = tp.side_effect(
        StructuredTool.from_function(refund, name="refund", description="refund an order"),
        lock=lambda args: f"order:{args['order']}:refund",
    )
    agent = create_agent(
        PlanModel(plan=[("refund", {"order": "o1"})]),
        [tool],
        checkpointer=sqlite_cp,
        middleware=[tp.RecoveryMiddleware(sqlite_cp)],
    )
    agent.invoke(_go(), _on("m2"))
    holder, busy = during
    assert holder is not None
    assert isinstance(busy, tp.ThreadBusy)
    (entry,) = sqlite_cp.ledger("m2")
    assert entry.status is LedgerStatus.COMMITTED
    assert entry.extra["fencing"] is not None


def test_unfinished_work_is_settled_once_per_call_under_the_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every entry point calls ``before_run`` exactly once, with the lease already held (an
    in-memory checkpointer: its leases live in one backend shared by the checkpointer)."""
    from taskpilots_graph import unfinished

    held: list[Any] = []
    cm = RecoveryCheckpointer.from_conn_string(":memory:")
    cp = cm.__enter__()

    def before_run(graph: Any, config: Any, input: Any) -> Any:
        thread_id = config["configurable"]["thread_id"]
        held.append(default_lease_backend(cp).holder(thread_lease_name(thread_id)))
        return input

    async def abefore_run(graph: Any, config: Any, input: Any) -> Any:
        return before_run(graph, config, input)

    monkeypatch.setattr(unfinished, "before_run", before_run)
    monkeypatch.setattr(unfinished, "abefore_run", abefore_run)
    graph = tp.create_recovery_agent(PlanModel(plan=[]), [], checkpointer=cp)
    try:
        tp.run(graph, "a", _go())
        graph.invoke(_go(), _on("b"))
        list(graph.stream(_go(), _on("c")))
        asyncio.run(graph.ainvoke(_go(), _on("d")))
        asyncio.run(tp.arun(graph, "e", _go()))
    finally:
        cm.__exit__(None, None, None)
    assert len(held) == 5
    assert all(lease is not None for lease in held)


_KILLED_HOLDER = """
import os, signal, sys
from taskpilots_graph.locks import lease_backend_from_url, new_owner, thread_lease_name
backend = lease_backend_from_url(sys.argv[1])
assert backend.acquire(thread_lease_name("k"), new_owner(), 30) is not None
os.kill(os.getpid(), signal.SIGKILL)  # releases nothing
"""


def test_lease_of_a_killed_worker_on_this_machine_is_taken_over(db: str) -> None:
    """A worker killed with SIGKILL leaves its lease for its TTL; on the same machine its
    process is known to be gone, so the next runner takes the thread over at once."""
    import subprocess
    import sys

    killed = subprocess.run([sys.executable, "-c", _KILLED_HOLDER, db], check=False)
    assert killed.returncode == -9
    with RecoveryCheckpointer.from_conn_string(db) as cp:
        graph = tp.create_recovery_agent(PlanModel(plan=[]), [], checkpointer=cp)
        values = graph.invoke(_go(), _on("k"))
        assert str(values["messages"][-1].content) == "done"
        assert default_lease_backend(cp).holder(thread_lease_name("k")) is None


def test_a_conflict_on_the_commit_says_the_run_performed_the_effect() -> None:
    """The protocol, driven by hand: another run moves the entry while our call runs, so
    our commit is refused. The error must not claim the effect was not performed."""
    from taskpilots_graph.engine._call import CallContext
    from taskpilots_graph.engine._protocol import run_call
    from taskpilots_graph.engine._requests import CheckArgs, FindRepeat, RunTool, WriteEntry
    from taskpilots_graph.errors import LedgerConflict
    from taskpilots_graph.ledger import SideEffectSpec

    ctx = CallContext(
        thread_id="t",
        checkpoint_ns="",
        tool="refund",
        args={"order": "o1"},
        tool_call_id="call-1",
        spec=SideEffectSpec(),
        key="refund:o1",
    )
    gen = run_call(ctx)
    request = next(gen)
    assert isinstance(request, CheckArgs)
    assert isinstance(gen.send(None), FindRepeat)
    intent = gen.send(None)
    assert isinstance(intent, WriteEntry)
    assert intent.entry.status is LedgerStatus.INTENDED
    assert isinstance(gen.send([]), RunTool)
    commit = gen.send("refunded o1")  # the tool ran: the effect happened
    assert isinstance(commit, WriteEntry)
    assert commit.entry.status is LedgerStatus.COMMITTED
    with pytest.raises(LedgerConflict) as refused:
        gen.throw(LedgerConflict("refund:o1"))
    assert refused.value.performed
    assert "had already performed the effect" in str(refused.value)
