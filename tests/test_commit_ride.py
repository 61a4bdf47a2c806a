"""The commit of a tool that settles a lost commit itself rides its task's writes.

A tool declared ``idempotent=True`` or with a pre-check does not pay a transaction for its
ledger commit: the checkpointer holds it for the task that ran the tool and writes it in the
transaction of that task's ``put_writes`` (result, error or interrupt alike), or on its own
first when anything reads or writes the thread's ledger before. Checked on real graphs
(``tp.ToolNode`` in a textbook loop), real SQLite files and PostgreSQL, and a SIGKILL in a
fresh process.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command, interrupt

import taskpilots_graph as tp
from taskpilots_graph.demo.services import Services
from taskpilots_graph.ledger import LedgerStatus

sys.path.insert(0, str(Path(__file__).parent))
from _commit_ride_worker import idempotent_ticket
from _models import PlanModel
from _toolnode_worker import build_graph, ticket_tools

WORKER = Path(__file__).parent / "_commit_ride_worker.py"
_WRITE = re.compile(r"^\s*(?:INSERT(?:\s+OR\s+\w+)?\s+INTO|UPDATE|REPLACE\s+INTO)\s+\"?(\w+)", re.I)


@pytest.fixture
def services(tmp_path: Path) -> Services:
    return Services(str(tmp_path / "services.db"), latency_s=0)


@pytest.fixture
def sqlite_cp(sqlite_path: str) -> Iterator[tp.RecoveryCheckpointer]:
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as saver:
        saver.setup()
        yield saver


def _config(thread_id: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id}}


def _tickets(services: Services) -> int:
    return sum(e["service"] == "create_ticket" for e in services.effects())


class Commits:
    """The tables each COMMIT on a sqlite3 connection wrote."""

    def __init__(self) -> None:
        self.commits: list[set[str]] = []
        self._tables: set[str] = set()

    def __call__(self, statement: str) -> None:
        if match := _WRITE.match(statement):
            self._tables.add(match.group(1).lower())
        elif statement.strip().upper().startswith(("COMMIT", "END")):
            self.commits.append(self._tables)
            self._tables = set()

    def ledger_commits(self) -> list[set[str]]:
        return [c for c in self.commits if "taskpilots_ledger" in c]


def _traced(cp: tp.RecoveryCheckpointer) -> Commits:
    commits = Commits()
    cp.inner.conn.set_trace_callback(commits)  # type: ignore[attr-defined]
    return commits


_READS: dict[int, Callable[[str], None]] = {}
"""The read a ``"read"`` node makes, per checkpointer."""


def _act_then(services: Services, cp: tp.RecoveryCheckpointer, after: str) -> Any:
    """A loop whose tool node opens a ticket and then, in the same task, raises
    (``after="raise"``), pauses on ``interrupt()`` (``after="interrupt"``) or reads the
    ledger entry (``after="read"``, through ``_READS``)."""
    tools = tp.ToolNode([ticket_tools(services)[1]])
    model = PlanModel(plan=[("open_ticket", {"subject": "$msg"})])

    def act(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        out = tools.invoke(state, config)
        if after == "raise":
            raise RuntimeError("the node failed after its tool")
        if after == "read":  # still inside the task: its put_writes has not begun
            _READS[id(cp)](services.effects()[-1]["request_key"])
            return dict(out)
        interrupt("confirm the ticket")
        return dict(out)

    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", act)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=cp)


# --- SIGKILL between the tool's return and its task's put_writes ---------------------------------


def _worker(kind: str, action: str, db: str, services: Services, thread_id: str) -> Any:
    return subprocess.run(
        [sys.executable, str(WORKER), kind, action, db, services.path, thread_id],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "settled"), [("precheck", "precheck_done"), ("idempotent", None)])
def test_sigkill_before_the_riding_commit_is_settled_on_resume(
    kind: str, settled: str | None, sqlite_path: str, services: Services
) -> None:
    """Killed after the ticket was opened, with its commit held for the task's writes: both
    are lost together, and the resumed run settles the call (the pre-check finds the ticket;
    the idempotent help desk hands the same ticket back): one ticket, a committed entry.

    The idempotent tool wrote no intent (its step's checkpoint, on disk under "sync", names
    the call): nothing of the call is on record until the resumed run commits it."""
    started = _worker(kind, "start", sqlite_path, services, "t-ride")
    assert started.returncode == -signal.SIGKILL, started.stderr  # the commit was held
    assert _tickets(services) == 1
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as saver:
        if kind == "idempotent":
            assert saver.ledger("t-ride") == []
        else:
            (entry,) = saver.ledger("t-ride")
            assert entry.status is LedgerStatus.INTENDED  # the commit died with the writes

    resumed = _worker(kind, "resume", sqlite_path, services, "t-ride")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[-1]) == {"type": "ai", "content": "done"}
    assert _tickets(services) == 1
    (effect,) = services.effects()
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as saver:
        (entry,) = saver.ledger("t-ride")
        assert entry.status is LedgerStatus.COMMITTED
        assert entry.key == effect["request_key"]
        assert entry.result == effect["payload"]["id"]
        assert entry.extra.get("reconciled") == settled


# --- the commit rides, and every reader sees it ------------------------------------------------


@pytest.mark.parametrize("kind", ["precheck", "idempotent"])
def test_the_commit_is_written_with_its_tasks_writes(
    kind: str, sqlite_cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """One transaction holds the commit, its event and the tool task's writes; none holds
    the commit alone. The idempotent tool writes no intent before it (``writes_intent``):
    its commit is its only ledger write."""
    declared = ticket_tools(services)[1] if kind == "precheck" else idempotent_ticket(services)
    graph = build_graph(tp.ToolNode([declared]), sqlite_cp)
    commits = _traced(sqlite_cp)
    out = graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"), durability="sync")
    assert out["messages"][-1].content == "done"
    if kind == "idempotent":
        (commit,) = commits.ledger_commits()
    else:
        intent, commit = commits.ledger_commits()
        assert "writes" not in intent
    assert {"taskpilots_ledger", "taskpilots_events", "writes"} <= commit
    (entry,) = sqlite_cp.ledger("t-1")
    assert entry.status is LedgerStatus.COMMITTED
    assert _tickets(services) == 1


def test_a_tool_without_a_way_to_settle_commits_on_its_own(
    sqlite_cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """A non-idempotent tool without a pre-check keeps its durable commit: "may have
    started" must stay told apart from "done" at every instant."""

    @tool
    def open_ticket(subject: str) -> str:
        """Open a help-desk ticket."""
        return services.create_ticket(subject, subject, tp.current_invocation().key)

    graph = build_graph(tp.ToolNode([tp.side_effect(open_ticket)]), sqlite_cp)
    commits = _traced(sqlite_cp)
    graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"), durability="sync")
    _intent, commit = commits.ledger_commits()
    assert "writes" not in commit


def test_a_ledger_read_before_put_writes_sees_the_held_commit(
    cp: tp.RecoveryCheckpointer, conn_string: str, services: Services
) -> None:
    """Between the tool's return and its task's writes the commit is held (another process
    still reads the intent); a read of the thread's ledger writes it first, so the reader,
    and every process after it, sees the call committed."""
    graph = _act_then(services, cp, "read")
    seen: list[tuple[LedgerStatus, ...]] = []
    with tp.RecoveryCheckpointer.from_conn_string(conn_string) as other:
        _READS[id(cp)] = lambda key: seen.append(
            tuple(e.status for e in (other.ledger_entry(key), cp.ledger_entry(key)) if e)
            + tuple(e.status for e in [other.ledger_entry(key)] if e)
        )
        try:
            out = graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"), durability="sync")
        finally:
            del _READS[id(cp)]
    assert out["messages"][-1].content == "done"
    intended, committed = LedgerStatus.INTENDED, LedgerStatus.COMMITTED
    assert seen == [(intended, committed, committed)]
    (entry,) = cp.ledger("t-1")
    assert entry.status is LedgerStatus.COMMITTED
    assert _tickets(services) == 1


@pytest.mark.postgres
def test_the_commit_rides_on_postgres(postgres_url: str, services: Services) -> None:
    """The pooled PostgreSQL saver carries the commit in its put_writes: the ledger row and
    the tool task's writes were written by one transaction."""
    import psycopg

    with tp.RecoveryCheckpointer.from_conn_string(postgres_url) as pg:
        pg.setup()
        graph = build_graph(tp.ToolNode([ticket_tools(services)[1]]), pg)
        out = graph.invoke({"messages": [("user", "t-p")]}, _config("t-p"), durability="sync")
        assert out["messages"][-1].content == "done"
        (entry,) = pg.ledger("t-p")
    assert entry.status is LedgerStatus.COMMITTED
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        shared = conn.execute(
            "SELECT count(*) FROM taskpilots_ledger l JOIN checkpoint_writes w "
            "ON w.thread_id = l.thread_id AND w.xmin::text = l.xmin::text "
            "WHERE l.thread_id = %s",
            ("t-p",),
        ).fetchone()
    assert shared is not None
    assert shared[0] > 0


def test_a_put_before_the_tasks_put_writes_writes_the_commit_first(
    sqlite_cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """LangGraph may put the next checkpoint before the tool task's put_writes ran (both in
    its background executor): that checkpoint never becomes durable before the commit."""
    put_writes = sqlite_cp.put_writes

    def slow(config: Any, writes: Any, task_id: str, *rest: Any) -> None:
        held = sqlite_cp._held_commits().get(config["configurable"]["thread_id"], [])
        if any(commit.task_id == task_id for commit in held):
            time.sleep(0.5)  # the put of the next checkpoint overtakes this one
        put_writes(config, writes, task_id, *rest)

    sqlite_cp.put_writes = slow  # type: ignore[method-assign]
    graph = build_graph(tp.ToolNode([ticket_tools(services)[1]]), sqlite_cp)
    commits = _traced(sqlite_cp)
    out = graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"), durability="sync")
    assert out["messages"][-1].content == "done"
    ledger = [i for i, c in enumerate(commits.commits) if "taskpilots_ledger" in c]
    assert len(ledger) == 2
    intent, commit = ledger
    checkpoints = [i for i, c in enumerate(commits.commits) if "checkpoints" in c]
    assert next(i for i in checkpoints if i > intent) > commit
    (entry,) = sqlite_cp.ledger("t-1")
    assert entry.status is LedgerStatus.COMMITTED


# --- never lost: the task raises, or pauses ------------------------------------------------------


def test_a_held_commit_rides_the_error_of_its_task(
    sqlite_cp: tp.RecoveryCheckpointer, sqlite_path: str, services: Services
) -> None:
    """The node fails after its tool succeeded: LangGraph puts the task's error, and the
    commit is written with it."""
    graph = _act_then(services, sqlite_cp, "raise")
    commits = _traced(sqlite_cp)
    with pytest.raises(RuntimeError, match="failed after its tool"):
        graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"), durability="sync")
    sqlite_cp.inner.conn.set_trace_callback(None)  # type: ignore[attr-defined]
    assert any({"taskpilots_ledger", "writes"} <= c for c in commits.ledger_commits())
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as other:
        (entry,) = other.ledger("t-1")
    assert entry.status is LedgerStatus.COMMITTED
    assert _tickets(services) == 1


def test_a_held_commit_rides_the_interrupt_of_its_task(
    sqlite_cp: tp.RecoveryCheckpointer, sqlite_path: str, services: Services
) -> None:
    """The node pauses on ``interrupt()`` after its tool: the commit is written with the
    interrupt, and the node's re-run on resume returns the recorded result."""
    graph = _act_then(services, sqlite_cp, "interrupt")
    commits = _traced(sqlite_cp)
    paused = graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"), durability="sync")
    sqlite_cp.inner.conn.set_trace_callback(None)  # type: ignore[attr-defined]
    assert "__interrupt__" in paused
    assert any({"taskpilots_ledger", "writes"} <= c for c in commits.ledger_commits())
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as other:
        (entry,) = other.ledger("t-1")
    assert entry.status is LedgerStatus.COMMITTED

    out = graph.invoke(Command(resume="yes"), _config("t-1"), durability="sync")
    assert out["messages"][-1].content == "done"
    assert _tickets(services) == 1


@pytest.mark.parametrize("kind", ["precheck", "idempotent"])
def test_the_same_command_twice_through_stream_and_run_opens_one_ticket(
    kind: str, sqlite_cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """The recovery agent through ``stream`` (``durability="sync"``: the commit rides its
    task's writes), then the same command through ``tp.run`` and ``invoke`` under LangGraph's
    default durability: the repeats find the effect committed and open no second ticket."""
    declared = ticket_tools(services)[1] if kind == "precheck" else idempotent_ticket(services)
    graph = tp.create_recovery_agent(
        PlanModel(plan=[("open_ticket", {"subject": "$msg"})]), [declared], checkpointer=sqlite_cp
    )
    commits = _traced(sqlite_cp)
    command = {"messages": [("user", "t-1")]}
    chunks = list(graph.stream(command, _config("t-1"), stream_mode="updates", durability="sync"))
    assert chunks
    assert any("writes" in c for c in commits.ledger_commits())  # the commit rode
    tp.run(graph, "t-1", command)  # LangGraph's default durability from here on
    graph.invoke(command, _config("t-1"))
    assert _tickets(services) == 1
    (entry,) = sqlite_cp.ledger("t-1")
    assert entry.status is LedgerStatus.COMMITTED


# --- a commit on its way keeps the thread's events in order ------------------------------------


def test_an_append_waits_for_a_commit_being_carried(cp: tp.RecoveryCheckpointer) -> None:
    """While a task's put_writes carries a held commit (taken from the holding map, not yet
    durable), an append of the thread's later events waits for it: the log keeps the call's
    ``tool_succeeded`` before the step's ``step_completed``, even though nothing is held."""
    import threading
    from dataclasses import replace
    from datetime import UTC, datetime

    from taskpilots_graph.events import EventKind, prepare_event
    from taskpilots_graph.ledger import LedgerEntry, args_digest

    now = datetime.now(UTC)
    intended = LedgerEntry(
        key="k-carried", thread_id="t-order", checkpoint_ns="", tool="open_ticket",
        tool_call_id="call-1", status=LedgerStatus.INTENDED, args={"s": 1},
        args_digest=args_digest({"s": 1}), attempt=1, created_at=now, updated_at=now,
    )  # fmt: skip

    def event(kind: EventKind) -> Any:
        return prepare_event(
            "t-order", kind, {"key": "k-carried"}, checkpoint_id=None, checkpoint_ns=""
        )

    cp.write_ledger(intended, expect=None, events=[event(EventKind.TOOL_INVOKED)])
    committed = replace(intended, status=LedgerStatus.COMMITTED)
    held = cp.hold_commit(
        committed,
        expect=(LedgerStatus.INTENDED, 1),
        events=[event(EventKind.TOOL_SUCCEEDED)],
        task_id="task-1",
    )
    assert held  # this saver carries commits in its put_writes

    carrying, release = threading.Event(), threading.Event()
    carry = cp._carry

    def slow_carry(*args: Any) -> None:
        carrying.set()
        release.wait(10)
        carry(*args)

    cp._carry = slow_carry  # type: ignore[method-assign]
    config = {"configurable": {"thread_id": "t-order", "checkpoint_ns": "", "checkpoint_id": "c1"}}
    writer = threading.Thread(target=cp.put_writes, args=(config, [("messages", "x")], "task-1"))
    writer.start()
    assert carrying.wait(10)
    appender = threading.Thread(target=cp.append_records, args=([event(EventKind.STEP_COMPLETED)],))
    appender.start()
    appender.join(0.5)
    waited = appender.is_alive()  # still waiting for the commit on its way
    release.set()
    writer.join(10)
    appender.join(10)

    assert waited
    kinds = [e.kind for e in cp.events("t-order")]
    assert kinds == [EventKind.TOOL_INVOKED, EventKind.TOOL_SUCCEEDED, EventKind.STEP_COMPLETED]
    assert cp.ledger_entry("k-carried").status is LedgerStatus.COMMITTED
