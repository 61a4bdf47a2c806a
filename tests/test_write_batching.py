"""Fewer durable writes, same guarantees: decisions ride in the ledger intent's transaction.

A model decision that leads to a side effect must be on disk before the effect runs (a crash
would otherwise make the model decide again, with new tool-call ids and so new keys). It is
no longer written on its own: it waits in memory and is written with the ledger intent. On
PostgreSQL the intent, its events and the decision are one statement.

The tests look from outside the library (a separate connection) while the side effect runs:
the decision and the intent must both be there. Then the edges: a refused ledger write
writes none of what rode with it and keeps it waiting; records of two threads fall back to
one transaction; a deferred decision is visible to readers at once and is forgotten by a
rewind. Under a thread's lease, the decisions recorded for the thread are read once per run
instead of once per model call, and a recorded decision is still replayed. Every test runs
on a real SQLite file and a real PostgreSQL database.
"""

from __future__ import annotations

import sqlite3
import uuid
from contextlib import closing
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from _slow_puts import slow_puts
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import StructuredTool

from taskpilots_graph import (
    EventKind,
    LedgerEntry,
    LedgerStatus,
    RecoveryCheckpointer,
    create_recovery_agent,
    current_invocation,
    run,
    side_effect,
)
from taskpilots_graph.errors import LedgerConflict
from taskpilots_graph.events import prepare_event
from taskpilots_graph.ledger import args_digest
from taskpilots_graph.locks import MemoryLeaseBackend
from taskpilots_graph.nodes._context import dump_message, messages_digest
from taskpilots_graph.testing import ScriptedModel

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _rows(conn_string: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    """One query on a connection of its own (``?`` placeholders): what another process sees."""
    if conn_string.startswith("postgresql://"):
        with psycopg.connect(conn_string, autocommit=True) as pg:
            return pg.execute(statement.replace("?", "%s"), params).fetchall()
    with closing(sqlite3.connect(conn_string.removeprefix("sqlite:///"))) as lite:
        return lite.execute(statement, params).fetchall()


def _decisions(conn_string: str, thread_id: str) -> int:
    rows = _rows(
        conn_string, "SELECT COUNT(*) FROM taskpilots_decisions WHERE thread_id = ?", thread_id
    )
    return int(rows[0][0])


def _events(conn_string: str, thread_id: str) -> list[tuple[int, str]]:
    statement = "SELECT seq, kind FROM taskpilots_events WHERE thread_id = ? ORDER BY seq"
    return [(int(seq), str(kind)) for seq, kind in _rows(conn_string, statement, thread_id)]


def _entry(thread_id: str, key: str) -> LedgerEntry:
    return LedgerEntry(
        key=key,
        thread_id=thread_id,
        checkpoint_ns="",
        tool="charge",
        tool_call_id="call-1",
        status=LedgerStatus.INTENDED,
        args={"order": "o-1"},
        args_digest=args_digest({"order": "o-1"}),
        attempt=1,
        created_at=NOW,
        updated_at=NOW,
    )


def _event(thread_id: str, kind: EventKind = EventKind.TOOL_INVOKED) -> Any:
    return prepare_event(thread_id, kind, {"n": 1}, checkpoint_id=None, checkpoint_ns="")


def test_decision_is_on_disk_with_the_intent_before_the_effect_runs(
    cp: RecoveryCheckpointer, conn_string: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``"async"`` durability, a step whose checkpoint is not on disk in time for its
    side effect records the model's decision in the intent's transaction."""
    slow_puts(monkeypatch, cp)
    seen: list[tuple[int, list[tuple[Any, ...]]]] = []

    def charge(order: str) -> str:
        """Charge an order."""
        key = current_invocation().key
        status = _rows(conn_string, "SELECT status FROM taskpilots_ledger WHERE key = ?", key)
        seen.append((_decisions(conn_string, thread_id), status))
        return f"charged {order}"

    def lookup(order: str) -> str:
        """Read an order."""
        return f"order {order}"

    tools = [
        side_effect(StructuredTool.from_function(charge), idempotent=True),
        StructuredTool.from_function(lookup),
    ]
    plan = [
        ("lookup", {"order": "o-1"}),
        ("charge", {"order": "o-1"}),
        ("charge", {"order": "o-2"}),
    ]
    agent = create_recovery_agent(ScriptedModel(plan=plan), tools, checkpointer=cp)
    thread_id = f"t-{uuid.uuid4().hex[:8]}"
    agent.invoke(
        {"messages": [("user", "charge both")]}, {"configurable": {"thread_id": thread_id}}
    )

    # Inside each effect, another connection already sees its decision and its intent.
    assert seen == [(1, [("intended",)]), (2, [("intended",)])]
    # The read-only step's decision was not written: only decisions that lead to effects.
    assert _decisions(conn_string, thread_id) == 2
    assert [e.status for e in cp.ledger(thread_id)] == [LedgerStatus.COMMITTED] * 2


def test_a_refused_write_writes_nothing_that_rode_with_it_and_keeps_it_waiting(
    cp: RecoveryCheckpointer, conn_string: str
) -> None:
    thread_id = f"t-{uuid.uuid4().hex[:8]}"
    key = f"biz:{thread_id}"
    cp.write_ledger(_entry(thread_id, key), expect=None, events=[_event(thread_id)])
    before = _events(conn_string, thread_id)
    cp.defer_records([_event(thread_id, EventKind.STEP_COMPLETED)])
    cp.defer_decision(thread_id, "", "digest-1", '{"type": "ai"}')

    with pytest.raises(LedgerConflict):  # the key exists: an insert is refused
        cp.write_ledger(_entry(thread_id, key), expect=None, events=[_event(thread_id)])

    assert _events(conn_string, thread_id) == before
    assert _decisions(conn_string, thread_id) == 0
    # Still waiting, and written by the thread's next durable write.
    assert cp.decision(thread_id, "", "digest-1") == '{"type": "ai"}'
    cp.append_records([], flush=thread_id)
    assert _decisions(conn_string, thread_id) == 1
    assert [kind for _, kind in _events(conn_string, thread_id)][-1] == "step_completed"


def test_records_of_two_threads_are_written_together_with_gapless_seqs(
    cp: RecoveryCheckpointer, conn_string: str
) -> None:
    mine, other = f"t-{uuid.uuid4().hex[:8]}", f"u-{uuid.uuid4().hex[:8]}"
    cp.append_records([_event(other)])
    # A business key first written by another thread: the entry keeps that thread, the
    # events and the deferred decision belong to this one (the rare multi-thread batch).
    cp.defer_decision(mine, "", "digest-2", '{"type": "ai"}')
    cp.defer_records([_event(other, EventKind.STEP_COMPLETED)])
    entry = _entry(other, f"biz:{other}")
    stored = cp.write_ledger(entry, expect=None, events=[_event(mine), _event(other)])

    assert sorted((e.thread_id, e.seq) for e in stored) == [(mine, 1), (other, 2), (other, 3)]
    assert _events(conn_string, other) == [
        (1, "tool_invoked"),
        (2, "step_completed"),
        (3, "tool_invoked"),
    ]
    assert _events(conn_string, mine) == [(1, "tool_invoked")]
    assert _decisions(conn_string, mine) == 1


def test_rewind_forgets_deferred_decisions_too(cp: RecoveryCheckpointer) -> None:
    thread_id = f"t-{uuid.uuid4().hex[:8]}"
    cp.defer_decision(thread_id, "", "digest-3", '{"type": "ai"}')
    assert cp.decision(thread_id, "", "digest-3") == '{"type": "ai"}'

    assert cp.forget_decisions(thread_id, since=0.0) == 1
    assert cp.decision(thread_id, "", "digest-3") is None


def test_under_the_lease_recorded_inputs_are_read_once_and_a_recorded_decision_replays(
    cp: RecoveryCheckpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    charged: list[str] = []

    def charge(order: str) -> str:
        """Charge an order."""
        charged.append(order)
        return f"charged {order}"

    # What an earlier run decided on this very input before it crashed, its checkpoint lost:
    # a call the scripted model would never make.
    goal = HumanMessage("charge")
    recorded = AIMessage(
        "", tool_calls=[{"name": "charge", "args": {"order": "from-record"}, "id": "call_rec"}]
    )
    thread_id = f"t-{uuid.uuid4().hex[:8]}"
    cp.record_decision(thread_id, "", messages_digest([goal]), dump_message(recorded))

    reads: list[str] = []
    store_call = cp._call

    def counting(method: str, *args: Any, **kwargs: Any) -> Any:
        reads.append(method)
        return store_call(method, *args, **kwargs)

    monkeypatch.setattr(cp, "_call", counting)
    plan = [("charge", {"order": f"o-{i}"}) for i in range(4)]
    agent = create_recovery_agent(
        ScriptedModel(plan=plan),
        [side_effect(StructuredTool.from_function(charge), idempotent=True)],
        checkpointer=cp,
        leases=MemoryLeaseBackend(),
    )
    run(agent, thread_id, {"messages": [goal]})

    assert charged[0] == "from-record"  # replayed, not decided anew
    assert charged[1:] == ["o-1", "o-2", "o-3"]  # the recorded call counts as the first
    assert reads.count("decision_digests") == 1  # one read for the whole run ...
    assert reads.count("decision_get") == 1  # ... and one for the input that has a record
