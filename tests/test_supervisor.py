"""The supervisor: health check, recovery scheduling, failure attribution, several at once.

* A run torn down mid-step drops its lease: the supervisor sees the thread orphaned, names
  the node and tool it died in, resumes it once and records why in ``run_resumed``.
* A worker killed with SIGKILL stops renewing its lease: the thread is *running* until the
  TTL passes, then orphaned and resumed, without repeating the effect it had committed.
* A thread parked in ``waiting_tool`` is left alone until ``retry_at``, then resumed.
* A thread held by a live runner, or waiting on a person, is left alone.
* Four supervisors scanning the same orphaned threads at once resume each exactly once.
* A thread whose resume keeps failing is given up on with a ``stuck_detected`` event.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from _models import PlanModel
from langchain_core.messages import HumanMessage
from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph import RecoveryCheckpointer, testing
from taskpilots_graph.config import (
    DEFAULT_DB_URL,
    POSTGRES_URL_ENV,
    REDIS_URL_ENV,
    StorageSettings,
    open_graph,
)
from taskpilots_graph.errors import ToolWaiting
from taskpilots_graph.health import Attribution, HealthStatus, ThreadHealth, with_effect_in_flight
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus
from taskpilots_graph.locks import (
    LeaseBackend,
    default_lease_backend,
    lease_backend_from_url,
    thread_lease_name,
)
from taskpilots_graph.policy import Backoff, ToolPolicy
from taskpilots_graph.runner import recover
from taskpilots_graph.supervisor import Supervisor, asupervise, supervise

PARK = ToolPolicy(backoff=Backoff(initial=60, jitter=False), wait_window=3600)  # → ToolWaiting
REPO_ROOT = Path(__file__).resolve().parent.parent


class Crash(BaseException):
    """The run is torn down mid-step (not an ``Exception``: nothing in the graph handles it)."""


def _go(text: str = "go") -> dict[str, Any]:
    return {"messages": [HumanMessage(text)]}


class World:
    """Tools whose behaviour the test switches, and a count of performed effects."""

    def __init__(self) -> None:
        self.crash: set[str] = set()  # notes whose lookup crashes (once)
        self.fail_lookup = False  # lookup raises a tool error (retried per policy)
        self.broken_lock = False  # the record tool's lock function raises
        self.effects: Counter[str] = Counter()
        self._mutex = threading.Lock()

    def tools(self) -> list[BaseTool]:
        def lookup(note: str) -> str:
            with self._mutex:
                if note in self.crash:
                    self.crash.discard(note)
                    raise Crash(note)
            if self.fail_lookup:
                raise ConnectionResetError("lookup service reset the connection")
            return f"found {note}"

        def record(note: str) -> str:
            with self._mutex:
                self.effects[note] += 1
            return f"recorded {note}"

        def lock_of(args: dict[str, Any]) -> str:
            if self.broken_lock:
                raise RuntimeError("lock service misconfigured")
            return f"note-{args['note']}:record"

        return [
            StructuredTool.from_function(lookup, name="lookup", description="look up"),
            tp.side_effect(
                StructuredTool.from_function(record, name="record", description="record"),
                lock=lock_of,
            ),
        ]


PLAN = [("lookup", {"note": "$msg"}), ("record", {"note": "$msg"})]


def _agent(cp: Any, leases: LeaseBackend | None, world: World, **options: Any) -> Any:
    return tp.create_recovery_agent(
        PlanModel(plan=PLAN),
        world.tools(),
        checkpointer=cp,
        leases=leases,
        name="notes_agent",
        **{"lease_ttl": 5.0, **options},
    )


@pytest.fixture
def embedded(sqlite_path: str) -> Iterator[tuple[RecoveryCheckpointer, LeaseBackend]]:
    """A checkpointer and SQLite leases in one file: the embedded mode."""
    url = f"sqlite:///{sqlite_path}"
    with RecoveryCheckpointer.from_conn_string(url) as cp, lease_backend_from_url(url) as leases:
        cp.setup()
        yield cp, leases


def _resumed_by_supervisor(cp: Any, thread_id: str) -> list[dict[str, Any]]:
    return [
        dict(e.payload)
        for e in cp.events(thread_id)
        if e.kind is tp.EventKind.RUN_RESUMED and e.payload.get("by") == "supervisor"
    ]


def test_orphaned_thread_is_attributed_resumed_once_then_idle(
    embedded: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """A run torn down in ``lookup`` is orphaned, resumed once with its attribution, then idle."""
    cp, leases = embedded
    world = World()
    world.crash.add("a")
    graph = _agent(cp, leases, world)
    with pytest.raises(Crash):
        tp.run(graph, "t-a", _go("a"))
    tp.run(graph, "t-b", _go("b"))  # a healthy, finished thread beside it
    assert leases.holder(thread_lease_name("t-a")) is None  # the lease was dropped

    supervisor = Supervisor(graph)
    health = {h.thread_id: h for h in supervisor.check()}
    assert health["t-b"].status is HealthStatus.IDLE
    orphan = health["t-a"]
    assert orphan.status is HealthStatus.ORPHANED
    assert orphan.attribution is not None
    assert (orphan.attribution.cause, orphan.attribution.node, orphan.attribution.tool) == (
        "worker_lost",
        "act",
        "lookup",
    )
    assert orphan.attribution.agent == "notes_agent"
    assert orphan.attribution.step is not None

    report = supervisor.tick()
    assert report.resumed == ("t-a",)
    assert world.effects == Counter({"a": 1, "b": 1})
    values = graph.get_state({"configurable": {"thread_id": "t-a"}}).values
    assert values["messages"][-1].content == "done"
    (resumed,) = _resumed_by_supervisor(cp, "t-a")
    assert Attribution.from_payload(resumed["attribution"]) == orphan.attribution

    again = supervisor.tick()
    assert again.resumed == ()
    assert {h.thread_id: h.status for h in again.threads} == {
        "t-a": HealthStatus.IDLE,
        "t-b": HealthStatus.IDLE,
    }
    assert world.effects == Counter({"a": 1, "b": 1})


def test_a_lost_worker_is_attributed_from_the_ledger_when_its_checkpoint_lags() -> None:
    """Under "async" durability the checkpoint showing the pending call may not be on disk
    when the worker dies; the ledger intent, written before the effect, names it instead."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    lost = ThreadHealth(
        "t-1",
        HealthStatus.ORPHANED,
        "cp-1",
        attribution=Attribution("t-1", "worker_lost", "tickets", node="think"),
    )

    def entry(key: str, status: LedgerStatus, minute: int) -> LedgerEntry:
        at = now.replace(minute=minute)
        return LedgerEntry(
            key=key,
            thread_id="t-1",
            tool=key,
            status=status,
            args={},
            args_digest="-",
            attempt=1,
            tool_call_id=f"call-{key}",
            created_at=at,
            updated_at=at,
        )

    entries = [
        entry("lookup_customer", LedgerStatus.COMMITTED, 1),
        entry("create_ticket", LedgerStatus.INTENDED, 2),
    ]
    why = with_effect_in_flight(lost, entries).attribution
    assert why is not None
    assert (why.node, why.step, why.tool) == ("think", "call-create_ticket", "create_ticket")
    # Nothing in flight, or a tool already named by the checkpoint: left as it was.
    assert with_effect_in_flight(lost, entries[:1]) == lost
    named = replace(lost, attribution=replace(lost.attribution, tool="send_email"))
    assert with_effect_in_flight(named, entries) == named


def test_thread_held_by_a_live_runner_is_left_alone(
    embedded: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """Work left but the lease is held (heartbeat alive): running, not resumed."""
    cp, leases = embedded
    world = World()
    world.crash.add("a")
    graph = _agent(cp, leases, world)
    with pytest.raises(Crash):
        tp.run(graph, "t-a", _go("a"))
    other = leases.acquire(thread_lease_name("t-a"), "host:42:live-worker", 30)
    assert other is not None
    report = supervise(graph, once=True)
    (health,) = report.threads
    assert (health.status, health.holder) == (HealthStatus.RUNNING, "host:42:live-worker")
    assert report.resumed == ()
    assert world.effects == Counter()
    leases.release(other)
    assert supervise(graph, once=True).resumed == ("t-a",)
    assert world.effects == Counter({"a": 1})


def test_waiting_tool_thread_is_resumed_only_once_due(
    embedded: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """``waiting_tool`` before ``retry_at``: waiting; after it: due, attributed, resumed."""
    cp, leases = embedded
    world = World()
    world.fail_lookup = True
    graph = _agent(cp, leases, world, default_policy=PARK)
    with testing.fake_clock() as clock:
        with pytest.raises(ToolWaiting) as waiting:
            tp.run(graph, "t-w", _go("w"))
        supervisor = Supervisor(graph)
        report = supervisor.tick()
        (health,) = report.threads
        assert health.status is HealthStatus.WAITING
        assert health.retry_at == pytest.approx(waiting.value.retry_at)
        assert report.resumed == ()

        world.fail_lookup = False
        clock.advance(waiting.value.retry_at - clock.now() + 1)
        (due,) = supervisor.check()
        assert due.status is HealthStatus.DUE
        assert due.attribution is not None
        assert (due.attribution.cause, due.attribution.tool, due.attribution.failure) == (
            "retry_due",
            "lookup",
            "transient",
        )
        assert supervisor.tick().resumed == ("t-w",)
    assert world.effects == Counter({"w": 1})
    assert graph.get_state({"configurable": {"thread_id": "t-w"}}).values["messages"][
        -1
    ].content == ("done")


def test_thread_waiting_on_a_person_is_left_alone(
    embedded: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """A tool waiting on a person's answer (an interrupt): takeover, never resumed."""
    cp, leases = embedded
    graph = _interrupting_graph(cp, leases)
    tp.run(graph, "t-p", _go("p"))
    supervisor = Supervisor(graph)
    for _ in range(2):  # the second scan answers from memory: same verdict
        report = supervisor.tick()
        (health,) = report.threads
        assert health.status is HealthStatus.TAKEOVER
        assert report.resumed == ()
    state = graph.get_state({"configurable": {"thread_id": "t-p"}})
    assert state.interrupts  # still waiting on the person


def _interrupting_graph(cp: Any, leases: LeaseBackend) -> Any:
    """An agent whose only tool needs a person's answer (LangGraph ``interrupt``)."""
    from langgraph.types import interrupt

    def approve(note: str) -> str:
        return str(interrupt({"question": f"approve {note}?"}))

    return tp.create_recovery_agent(
        PlanModel(plan=[("approve", {"note": "$msg"})]),
        [StructuredTool.from_function(approve, name="approve", description="ask a person")],
        checkpointer=cp,
        leases=leases,
    )


def test_resume_that_keeps_failing_is_given_up_with_a_stuck_event(
    embedded: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """Three failed resumes of one checkpoint: failing, one ``stuck_detected`` event."""
    cp, leases = embedded
    world = World()
    world.broken_lock = True
    graph = _agent(cp, leases, world)
    with pytest.raises(RuntimeError):
        tp.run(graph, "t-s", _go("s"))
    supervisor = Supervisor(graph, max_failures=3, failure_backoff=0)
    failures = [supervisor.tick().failed for _ in range(3)]
    assert [len(f) for f in failures] == [1, 1, 1]
    assert "lock service misconfigured" in failures[0][0][1]
    report = supervisor.tick()
    (health,) = report.threads
    assert health.status is HealthStatus.FAILING
    assert report.failed == ()  # given up: not tried again at this checkpoint
    stuck = [e for e in cp.events("t-s") if e.kind is tp.EventKind.STUCK_DETECTED]
    assert len(stuck) == 1
    assert stuck[0].payload["attribution"]["tool"] == "record"
    assert world.effects == Counter()


def test_supervisor_uses_the_checkpointers_leases_when_none_is_named(
    embedded: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """No lease backend named: the thread leases live in the checkpointer's own file, and
    the supervisor reads them there; a bad interval is still a configuration error."""
    cp, _ = embedded
    graph = _agent(cp, None, World())
    assert Supervisor(graph).leases is default_lease_backend(cp)
    with pytest.raises(tp.ConfigurationError, match="interval"):
        supervise(_agent(cp, embedded[1], World()), interval=0)


async def test_async_supervisor_resumes_an_orphaned_thread(sqlite_path: str) -> None:
    """``asupervise(once=True)`` on an ``AsyncRecoveryCheckpointer``: resumed once."""
    url = f"sqlite:///{sqlite_path}"
    world = World()
    world.crash.add("a")
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(url) as acp:
        await acp.setup()
        with lease_backend_from_url(url) as leases:
            graph = _agent(acp, leases, world)
            with pytest.raises(Crash):
                await tp.arun(graph, "t-a", _go("a"))
            report = await asupervise(graph, once=True)
            assert report.resumed == ("t-a",)
            again = await asupervise(graph, once=True)
            assert [h.status for h in again.threads] == [HealthStatus.IDLE]
            events = await acp.aevents("t-a")
    assert world.effects == Counter({"a": 1})
    resumed = [e for e in events if e.kind is tp.EventKind.RUN_RESUMED]
    assert [e.payload["attribution"]["tool"] for e in resumed] == ["lookup"]


@pytest.mark.postgres
@pytest.mark.redis
def test_four_supervisors_resume_each_orphaned_thread_exactly_once(
    postgres_url: str, redis_url: str
) -> None:
    """4 supervisors (own connections) tick at once over 24 orphans: one resume each."""
    world = World()
    threads = [f"t-{i}" for i in range(24)]
    world.crash.update(threads)
    with (
        RecoveryCheckpointer.from_conn_string(postgres_url) as cp,
        lease_backend_from_url(redis_url) as leases,
    ):
        cp.setup()
        graph = _agent(cp, leases, world)
        for tid in threads:
            with pytest.raises(Crash):
                tp.run(graph, tid, _go(tid))
        barrier = threading.Barrier(4)
        reports: list[Any] = []
        errors: list[BaseException] = []

        def one_supervisor() -> None:
            try:
                with (
                    RecoveryCheckpointer.from_conn_string(postgres_url) as own_cp,
                    lease_backend_from_url(redis_url) as own_leases,
                ):
                    own = _agent(own_cp, own_leases, world)
                    barrier.wait()
                    reports.append(supervise(own, once=True))
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=one_supervisor) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
        assert not errors, errors
        resumed = Counter(t for r in reports for t in r.resumed)
        assert resumed == Counter(dict.fromkeys(threads, 1))  # each by exactly one
        assert world.effects == Counter(dict.fromkeys(threads, 1))  # no effect twice
        for tid in threads:
            assert len(_resumed_by_supervisor(cp, tid)) == 1
            (entry,) = cp.ledger(tid)
            assert entry.status == "committed"


# --- a real worker, killed ---------------------------------------------------------------------

_WORKER = textwrap.dedent(
    """
    import sys
    from langchain_core.messages import HumanMessage
    import taskpilots_graph as tp
    from taskpilots_graph.demo.model import ScriptedTicketModel
    from taskpilots_graph.demo.services import Services
    from taskpilots_graph.demo.workflow import PROMPT, recovery_tools
    from taskpilots_graph.locks import lease_backend_from_url

    db, lease_url, services_path, ticket = sys.argv[1:]
    with tp.RecoveryCheckpointer.from_conn_string(db) as cp, \\
            lease_backend_from_url(lease_url) as leases:
        graph = tp.create_recovery_agent(
            ScriptedTicketModel(), recovery_tools(Services(services_path)),
            checkpointer=cp, prompt=PROMPT, leases=leases, lease_ttl=1.0,
            )
        tp.run(graph, "ticket", {"messages": [HumanMessage(ticket)]})
    """
)


@pytest.mark.postgres
@pytest.mark.redis
def test_worker_killed_by_sigkill_is_detected_after_its_ttl_and_resumed(
    postgres_url: str, redis_url: str, tmp_path: Path
) -> None:
    """SIGKILL right after the ticket is created: running until the TTL, then orphaned,
    resumed once; the ticket is not created twice (pre-check), the thread completes."""
    from taskpilots_graph.demo.batch import make_batch
    from taskpilots_graph.demo.model import ScriptedTicketModel
    from taskpilots_graph.demo.services import Services
    from taskpilots_graph.demo.workflow import PROMPT, recovery_tools

    customers, tickets = make_batch(1)
    services = Services(str(tmp_path / "services.db"))
    services.seed_customers(customers)
    services.plant_kill("create_ticket", "after")
    with RecoveryCheckpointer.from_conn_string(postgres_url) as cp:
        cp.setup()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
    args = [postgres_url, redis_url, services.path, json.dumps(tickets[0])]
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, *args], env=env, capture_output=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    killed_at = time.monotonic()
    with (
        RecoveryCheckpointer.from_conn_string(postgres_url) as cp,
        lease_backend_from_url(redis_url) as leases,
    ):
        graph = tp.create_recovery_agent(
            ScriptedTicketModel(),
            recovery_tools(services),
            checkpointer=cp,
            prompt=PROMPT,
            leases=leases,
            lease_ttl=1.0,
            name="tickets",
        )
        supervisor = Supervisor(graph)
        seen: list[HealthStatus] = []
        report = None
        while time.monotonic() - killed_at < 30:
            report = supervisor.tick()
            (health,) = report.threads
            seen.append(health.status)
            if report.resumed:
                break
            time.sleep(0.1)
        assert report is not None
        assert report.resumed == ("ticket",)
        # Either the scan caught the dead worker's lease still ticking, or the TTL had
        # already run out while the parent process started; never anything else.
        assert set(seen) <= {HealthStatus.RUNNING, HealthStatus.ORPHANED}
        (resumed,) = _resumed_by_supervisor(cp, "ticket")
        assert resumed["attribution"]["tool"] == "create_ticket"
        assert resumed["attribution"]["failure"] == "worker_lost"
        last = graph.get_state({"configurable": {"thread_id": "ticket"}}).values["messages"][-1]
        assert "closed." in str(last.content)
    counts = {c.service: c for c in services.effect_counts()}
    assert counts["create_ticket"].performed == 1
    assert sum(c.duplicates for c in counts.values()) == 0


def test_recover_is_a_no_op_for_a_finished_thread(
    embedded: tuple[RecoveryCheckpointer, LeaseBackend],
) -> None:
    """``recover`` re-checks under the lease: a finished or unknown thread is not run."""
    cp, leases = embedded
    world = World()
    graph = _agent(cp, leases, world)
    tp.run(graph, "t-done", _go("d"))
    assert recover(graph, "t-done") is False
    assert recover(graph, "t-unknown") is False
    assert world.effects == Counter({"d": 1})


# --- configuration -----------------------------------------------------------------------------


def notes_with_leases(*, checkpointer: Any, leases: LeaseBackend) -> Any:
    """A graph factory as ``--graph test_supervisor:notes_with_leases`` names it."""
    return _agent(checkpointer, leases, World())


def notes_without_leases(checkpointer: Any) -> Any:
    """A factory that takes only the checkpointer: its graph has no lease backend."""
    return _agent(checkpointer, None, World())


def test_settings_come_from_arguments_then_environment_then_the_embedded_default(
    tmp_path: Path,
) -> None:
    """Explicit URLs win; then TASKPILOTS_POSTGRES_URL / TASKPILOTS_REDIS_URL; else SQLite."""
    pg, rd = "postgresql://u@db:5432/runs", "redis://cache:6379/0"
    assert StorageSettings.resolve(environ={}) == StorageSettings(DEFAULT_DB_URL, DEFAULT_DB_URL)
    env = {POSTGRES_URL_ENV: pg, REDIS_URL_ENV: rd}
    assert StorageSettings.resolve(environ=env) == StorageSettings(pg, rd)
    assert StorageSettings.resolve(environ={POSTGRES_URL_ENV: pg}) == StorageSettings(pg, pg)
    mine = f"sqlite:///{tmp_path / 'x' / 'runs.db'}"
    assert StorageSettings.resolve(db=mine, environ=env) == StorageSettings(mine, rd)
    assert (tmp_path / "x").is_dir()  # the embedded file's folder is created
    with pytest.raises(tp.ConfigurationError, match="cannot be shared"):
        StorageSettings.resolve(db=":memory:", environ={})


def test_graph_references_name_a_graph_or_a_factory(sqlite_path: str) -> None:
    """``module:attr`` loads a factory given what it asks for; mistakes are typed errors."""
    url = f"sqlite:///{sqlite_path}"
    with open_graph("test_supervisor:notes_with_leases", StorageSettings(url, url)) as graph:
        assert Supervisor(graph).check() == []
    with open_graph("test_supervisor:notes_without_leases", StorageSettings(url, url)) as graph:
        assert Supervisor(graph).check() == []  # its leases: the database's own
    for ref, message in [
        ("no_colon", "looks like"),
        ("no_such_module_here:graph", "cannot import"),
        ("test_supervisor:missing", "has no attribute"),
        ("test_supervisor:PLAN", "name a compiled graph or a factory"),
    ]:
        with (
            pytest.raises(tp.ConfigurationError, match=message),
            open_graph(ref, StorageSettings(url, url)),
        ):
            pass
