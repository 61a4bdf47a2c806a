"""The PostgreSQL store's writes as statements, shared by its sync and async form (I/O free).

A thread's events and decisions are one statement, after a ledger write or on their own: a
write of one thread needs no transaction block (see ``Stmt.alone``), and a held commit rides
the saver's transaction as one statement per commit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from taskpilots_graph.checkpointers import _schema as sql
from taskpilots_graph.checkpointers._migrations import SCHEMA_VERSION
from taskpilots_graph.checkpointers._rows import ledger_write_sql
from taskpilots_graph.checkpointers._sqlstore import (
    SqlBodies,
    Statements,
    Stmt,
    pending_migrations,
    writes,
)
from taskpilots_graph.checkpointers.base import DecisionRecord, HeldCommit, PendingRecord
from taskpilots_graph.checkpointers.messages import MessageRows
from taskpilots_graph.errors import LedgerConflict, MigrationError
from taskpilots_graph.events import Event, EventRecord

__all__ = ["PostgresBodies", "Write", "message_params", "ride_statements", "written"]

_D: Final = "postgres"
_LEDGER = sql.LEDGER[_D]

Write = tuple[str, dict[str, Any], list[EventRecord]]
"""A statement writing one thread's records, its parameters, and the events it writes."""

# One statement per thread: its events and decisions, after a ledger write or on their own.
_WRITES: Final = {
    statement: sql.write_pg(statement) for statement in (None, _LEDGER["insert"], _LEDGER["update"])
}


def _events_json(records: Sequence[EventRecord]) -> str:
    # One JSON text rather than arrays: psycopg adapts a list element by element in Python,
    # and the payloads are JSON already (spliced in, not encoded again).
    rows = ",".join(
        f"[{json.dumps(r.kind.value)},{r.ts!r},{json.dumps(r.checkpoint_ns)},"
        f"{json.dumps(r.checkpoint_id)},{r.payload}]"
        for r in records
    )
    return f"[{rows}]"


def _by_thread(records: Sequence[PendingRecord]) -> dict[str, list[PendingRecord]]:
    groups: dict[str, list[PendingRecord]] = {}
    for record in records:
        groups.setdefault(record.thread_id, []).append(record)
    return groups


def _write(
    ledger_statement: str | None,
    params: dict[str, Any],
    thread_id: str,
    records: Sequence[PendingRecord],
) -> Write:
    """The statement writing one thread's ``records`` (after the ledger write, if any)."""
    events = [r for r in records if isinstance(r, EventRecord)]
    decisions = [
        [r.checkpoint_ns, r.input_digest, r.message, r.created_at]
        for r in records
        if isinstance(r, DecisionRecord)
    ]
    combined = {
        **params,
        "_t": thread_id,
        "_n": len(events),
        "_events": _events_json(events),
        "_decisions": json.dumps(decisions),
    }
    return _WRITES[ledger_statement], combined, events


def written(key: str | None, row: Any, events: Sequence[EventRecord]) -> list[Event]:
    """The events a write statement stored, from its row ``(count, seqs)``.

    Raises:
        LedgerConflict: The ledger write (``key``) wrote nothing.
    """
    count, seqs = row
    if count != 1:
        assert key is not None  # only a ledger write can write nothing
        raise LedgerConflict(key)
    return [record.to_event(seq) for record, seq in zip(events, seqs, strict=True)]


def _one_statement(
    statement: str, params: dict[str, Any], records: Sequence[PendingRecord]
) -> Write | None:
    """The ledger write and ``records`` as one statement, when they are of one thread."""
    groups = _by_thread(records)
    if len(groups) > 1:
        return None  # rare (a business key of another thread): one transaction instead
    thread_id, group = next(iter(groups.items()), ("", []))
    return _write(statement, params, thread_id, group)


def ride_statements(held: Sequence[HeldCommit]) -> list[tuple[str, Write]] | None:
    """Each held commit with its events as one statement, or ``None`` if one cannot be."""
    statements = []
    for commit in held:
        statement, params = ledger_write_sql(_D, commit.entry, commit.expect)
        if (one := _one_statement(statement, params, commit.events)) is None:
            return None
        statements.append((commit.entry.key, one))
    return statements


def message_params(rows: MessageRows) -> dict[str, Any]:
    """Parameters of ``MESSAGES["write"]``: one array per column (unnest-ed server side)."""
    return {
        "thread_id": rows.thread_id,
        "s_seq": [s.seq for s in rows.sequences],
        "s_ns": [s.checkpoint_ns for s in rows.sequences],
        "s_channel": [s.channel for s in rows.sequences],
        "s_parent": [s.parent_seq for s in rows.sequences],
        "s_parent_len": [s.parent_len for s in rows.sequences],
        "m_key": [m.key for m in rows.messages],
        "m_id": [m.message_id for m in rows.messages],
        "m_type": [m.type for m in rows.messages],
        "m_payload": [m.payload for m in rows.messages],
        "r_seq": [seq for seq, _, _ in rows.refs],
        "r_position": [position for _, position, _ in rows.refs],
        "r_key": [key for _, _, key in rows.refs],
    }


class PostgresBodies(SqlBodies):
    """The bodies whose PostgreSQL statements differ from SQLite's."""

    _dialect = _D
    schema_checked: bool

    def _schema(self) -> Statements[None]:
        """Check, on the store's first use, that the schema is at this library's version."""
        if self.schema_checked:
            return
        (current,) = yield Stmt(sql.SELECT_VERSION, None, "one")
        if pending_migrations(_D, current):  # (a newer schema raises there)
            raise MigrationError(
                f"the database schema is at version {current}, older than this library's "
                f"{SCHEMA_VERSION}; call checkpointer.setup() once to migrate it"
            )
        self.schema_checked = True

    @writes
    def _append_events(self, records: Sequence[PendingRecord]) -> Statements[list[Event]]:
        groups = _by_thread(records)
        stored: list[Event] = []
        for thread_id, group in groups.items():
            statement, params, events = _write(None, {}, thread_id, group)
            row = yield Stmt(statement, params, "one", alone=len(groups) == 1)
            stored += written(None, row, events)
        return stored

    def _ledger_and_events(
        self, key: str, statement: str, params: Any, events: Sequence[PendingRecord]
    ) -> Statements[list[Event]]:
        if (one := _one_statement(statement, params, events)) is None:
            return (yield from super()._ledger_and_events(key, statement, params, events))
        return written(key, (yield Stmt(one[0], one[1], "one", alone=True)), one[2])

    def _messages_write(self, rows: MessageRows) -> Statements[None]:
        yield Stmt(sql.MESSAGES[_D]["write"], message_params(rows), alone=True)
