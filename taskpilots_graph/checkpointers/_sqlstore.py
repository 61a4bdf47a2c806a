"""The recovery-store methods written once for both SQL backends, sync and async.

A method's body is a generator of statements (:class:`Stmt`): it yields each statement it
needs and receives what the statement gives back. Each store (SQLite and PostgreSQL, sync
and async) runs a body with ``_within(operation, body, *, write)``: on its connection, in
its transaction, with its failures typed, each statement executed on its cursor through
:func:`run_statements` or :func:`arun_statements`. :func:`sync_method` and
:func:`async_method` make body ``_name`` the store method ``name``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from typing import Any, Concatenate, Literal, NamedTuple, ParamSpec, TypeVar

from taskpilots_graph.checkpointers import _schema as sql
from taskpilots_graph.checkpointers._migrations import MIGRATIONS, SCHEMA_VERSION
from taskpilots_graph.checkpointers._rows import (
    decision_params,
    ledger_list_sql,
    ledger_write_sql,
    repeat_params,
    row_to_committed,
    row_to_entry,
)
from taskpilots_graph.checkpointers.artifacts import ARTIFACTS_TABLE, PreparedArtifact, stored_bytes
from taskpilots_graph.checkpointers.base import PendingRecord, rows_to_events
from taskpilots_graph.checkpointers.messages import LoadedRow
from taskpilots_graph.compaction import CompactionPolicy
from taskpilots_graph.errors import LedgerConflict, MigrationError
from taskpilots_graph.events import Event
from taskpilots_graph.ledger import CommittedEffect, LedgerEntry, LedgerStatus, world_keys

__all__ = [
    "AsyncSqlQueries",
    "Fetch",
    "SqlBodies",
    "SqlQueries",
    "Statements",
    "Stmt",
    "afetched",
    "arun_statements",
    "async_method",
    "fetched",
    "pending_migrations",
    "run_statements",
    "sync_method",
    "writes",
]

P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S", bound="SqlBodies")

Fetch = Literal["one", "all", "count"]
"""What a statement gives back: the first row, every row, or the number of rows changed."""


class Stmt(NamedTuple):
    """One statement of a body, in the store's dialect."""

    statement: str
    params: Any = ()
    fetch: Fetch = "count"
    many: bool = False
    """Run once per row of ``params`` (``executemany``); gives back nothing."""
    binary: bool | None = None
    """PostgreSQL's result format: bytes come back raw, not as hex text twice their size."""
    alone: bool = False
    """The statement is the whole write: PostgreSQL commits it without a transaction block
    (no BEGIN/COMMIT round trips). Later statements still open one."""


Statements = Generator[Stmt, Any, T]


def pending_migrations(dialect: sql.Dialect, current: int) -> list[tuple[int, str]]:
    """The migrations a schema at version ``current`` still needs, with their versions.

    Raises:
        MigrationError: The schema is newer than this library's.
    """
    if current > SCHEMA_VERSION:
        raise MigrationError(
            f"the database schema is at version {current}, newer than this library's "
            f"{SCHEMA_VERSION}; upgrade taskpilots-graph"
        )
    return [(v, MIGRATIONS[dialect][v - 1]) for v in range(current + 1, SCHEMA_VERSION + 1)]


def fetched(cur: Any, fetch: Fetch) -> Any:
    """What ``fetch`` asks of a cursor that has executed a statement."""
    if fetch == "one":
        return cur.fetchone()
    return cur.fetchall() if fetch == "all" else cur.rowcount


async def afetched(cur: Any, fetch: Fetch) -> Any:
    """Async form of :func:`fetched`."""
    if fetch == "one":
        return await cur.fetchone()
    return await cur.fetchall() if fetch == "all" else cur.rowcount


def run_statements(steps: Statements[T], execute: Callable[[Stmt], Any]) -> T:
    """Run a body, each of its statements with ``execute``; a failure ends the body."""
    result: Any = None
    while True:
        try:
            stmt = steps.send(result)
        except StopIteration as stop:
            value: T = stop.value
            return value
        result = execute(stmt)


async def arun_statements(steps: Statements[T], execute: Callable[[Stmt], Awaitable[Any]]) -> T:
    """Async form of :func:`run_statements`."""
    result: Any = None
    while True:
        try:
            stmt = steps.send(result)
        except StopIteration as stop:
            value: T = stop.value
            return value
        result = await execute(stmt)


def writes(body: Callable[P, T]) -> Callable[P, T]:
    """Mark a body that changes rows: its store commits it durably (``write=True``)."""
    body.__dict__["writes"] = True
    return body


def sync_method(body: Callable[Concatenate[S, P], Statements[T]]) -> Callable[Concatenate[S, P], T]:
    """The store method ``name`` running the store's body ``_name`` (an override too)."""
    name, write = body.__name__, body.__dict__.get("writes", False)

    @functools.wraps(body)
    def method(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        steps = getattr(self, name)
        result: T = self._within(name[1:], lambda: steps(*args, **kwargs), write=write)
        return result

    method.__name__ = name[1:]
    return method


def async_method(
    body: Callable[Concatenate[S, P], Statements[T]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """Async form of :func:`sync_method`."""
    name, write = body.__name__, body.__dict__.get("writes", False)

    @functools.wraps(body)
    async def method(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        steps = getattr(self, name)
        result: T = await self._within(name[1:], lambda: steps(*args, **kwargs), write=write)
        return result

    method.__name__ = name[1:]
    return method


class SqlBodies:
    """The bodies of the store methods, in the store's ``_dialect``."""

    _dialect: sql.Dialect
    _within: Callable[..., Any]
    """``_within(operation, body, *, write)``: run ``body()`` as store method
    ``operation``; ``write``: it changes rows."""

    @writes
    def _append_events(self, records: Sequence[PendingRecord]) -> Statements[list[Event]]:
        """The backend's statements writing ``records`` (within a ledger write too)."""
        raise NotImplementedError

    def _events(self, thread_id: str, *, after_seq: int = 0) -> Statements[list[Event]]:
        statement = sql.SELECT_EVENTS[self._dialect]
        return rows_to_events((yield Stmt(statement, (thread_id, after_seq), "all")))

    def _messages_read(self, thread_id: str, seq: int, length: int) -> Statements[list[LoadedRow]]:
        """The rows of positions ``0..length-1`` of sequence ``seq``, by position."""
        params = {"thread_id": thread_id, "seq": seq, "len": length}
        rows = yield Stmt(sql.MESSAGES[self._dialect]["read"], params, "all", binary=True)
        return [(int(p), bytes(k), str(t), bytes(b)) for p, k, t, b in rows]

    def _ledger_get(self, key: str) -> Statements[LedgerEntry | None]:
        row = yield Stmt(sql.LEDGER[self._dialect]["get"], {"key": key}, "one")
        return None if row is None else row_to_entry(row)

    def _ledger(self, thread_id: str | None = None) -> Statements[list[LedgerEntry]]:
        statement, params = ledger_list_sql(self._dialect, thread_id)
        return [row_to_entry(row) for row in (yield Stmt(statement, params, "all"))]

    def _ledger_repeat(
        self, thread_id: str, tool: str, args_digest: str
    ) -> Statements[CommittedEffect | None]:
        params = repeat_params(thread_id, tool, args_digest)
        row = yield Stmt(sql.LEDGER[self._dialect]["repeat"], params, "one")
        return None if row is None else row_to_committed(row)

    def _ledger_committed_digests(self, thread_id: str) -> Statements[list[tuple[str, str]]]:
        statement = sql.LEDGER[self._dialect]["committed_digests"]
        rows = yield Stmt(statement, {"thread_id": thread_id}, "all")
        return [(str(tool), str(digest)) for tool, digest in rows]

    @writes
    def _ledger_write(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[PendingRecord] = (),
    ) -> Statements[list[Event]]:
        statement, params = ledger_write_sql(self._dialect, entry, expect)
        return (yield from self._ledger_and_events(entry.key, statement, params, events))

    def _ledger_and_events(
        self, key: str, statement: str, params: Any, events: Sequence[PendingRecord]
    ) -> Statements[list[Event]]:
        """Ledger write ``statement`` of ``key`` and then ``events``, in one transaction."""
        if (yield Stmt(statement, params)) != 1:
            raise LedgerConflict(key)
        return (yield from self._append_events(events))

    def _decision_get(
        self, thread_id: str, checkpoint_ns: str, input_digest: str
    ) -> Statements[str | None]:
        params = decision_params(thread_id, checkpoint_ns, input_digest)
        row = yield Stmt(sql.LEDGER[self._dialect]["decision_get"], params, "one")
        return None if row is None else str(row[0])

    def _decision_digests(self, thread_id: str, checkpoint_ns: str) -> Statements[list[str]]:
        params = {"thread_id": thread_id, "checkpoint_ns": checkpoint_ns}
        rows = yield Stmt(sql.LEDGER[self._dialect]["decision_digests"], params, "all")
        return [str(row[0]) for row in rows]

    @writes
    def _decision_forget(self, thread_id: str, since: float) -> Statements[int]:
        params = {"thread_id": thread_id, "since": since}
        return int((yield Stmt(sql.LEDGER[self._dialect]["decision_forget"], params)))

    @writes
    def _put_artifact(self, artifact: PreparedArtifact) -> Statements[None]:
        statements = sql.ARTIFACTS[self._dialect]
        key = {"id": artifact.ref.id, "thread_id": artifact.thread_id}
        if (yield Stmt(statements["exists"], key, "one")) is None:
            yield Stmt(statements["put"], artifact.params())

    def _get_artifact(self, artifact_id: str) -> Statements[bytes | None]:
        params = {"id": artifact_id}
        row = yield Stmt(sql.ARTIFACTS[self._dialect]["get"], params, "one", binary=True)
        return None if row is None else stored_bytes(row[0], artifact_id, where=ARTIFACTS_TABLE)

    @writes
    def _delete_artifacts(self, thread_id: str) -> Statements[None]:
        yield Stmt(sql.ARTIFACTS[self._dialect]["delete"], {"thread_id": thread_id})

    @writes
    def _delete_thread(self, thread_id: str, *, forget_effects: bool = False) -> Statements[None]:
        for statement in sql.DELETE_THREAD[self._dialect]:
            yield Stmt(statement, (thread_id,))
        statement, params = ledger_list_sql(self._dialect, thread_id)
        entries = [row_to_entry(row) for row in (yield Stmt(statement, params, "all"))]
        kept = set() if forget_effects else world_keys(entries)
        forgotten = [(entry.key,) for entry in entries if entry.key not in kept]
        if forgotten:
            yield Stmt(sql.DELETE_LEDGER[self._dialect], forgotten, many=True)

    @writes
    def _prune_checkpoints(self, thread_id: str, keep: Sequence[str]) -> Statements[int]:
        first, *rest = sql.PRUNE_CHECKPOINTS[self._dialect]
        # SQLite takes the list as JSON text (json_each), PostgreSQL as an array.
        kept = json.dumps(list(keep)) if self._dialect == "sqlite" else list(keep)
        removed = yield Stmt(first, (thread_id, kept))
        for statement in rest:
            yield Stmt(statement, (thread_id,))
        return int(removed)

    @writes
    def _compact_events(self, thread_id: str, policy: CompactionPolicy) -> Statements[int]:
        # Read and rewrite need not be one snapshot: appends only add newer events, and a
        # concurrent compaction computes the same reduction of the same old payloads.
        rows = yield Stmt(sql.SELECT_EVENTS[self._dialect], (thread_id, 0), "all")
        plan = policy.plan(rows_to_events(rows))
        if plan:
            params = [(change.encoded, change.thread_id, change.seq) for change in plan]
            yield Stmt(sql.COMPACT_EVENT[self._dialect], params, many=True)
        return len(plan)


class SqlQueries(SqlBodies):
    """The sync store methods of :class:`SqlBodies`."""

    append_events = sync_method(SqlBodies._append_events)
    events = sync_method(SqlBodies._events)
    messages_read = sync_method(SqlBodies._messages_read)
    ledger_get = sync_method(SqlBodies._ledger_get)
    ledger = sync_method(SqlBodies._ledger)
    ledger_repeat = sync_method(SqlBodies._ledger_repeat)
    ledger_committed_digests = sync_method(SqlBodies._ledger_committed_digests)
    ledger_write = sync_method(SqlBodies._ledger_write)
    decision_get = sync_method(SqlBodies._decision_get)
    decision_digests = sync_method(SqlBodies._decision_digests)
    decision_forget = sync_method(SqlBodies._decision_forget)
    put_artifact = sync_method(SqlBodies._put_artifact)
    get_artifact = sync_method(SqlBodies._get_artifact)
    delete_artifacts = sync_method(SqlBodies._delete_artifacts)
    delete_thread = sync_method(SqlBodies._delete_thread)
    prune_checkpoints = sync_method(SqlBodies._prune_checkpoints)
    compact_events = sync_method(SqlBodies._compact_events)


class AsyncSqlQueries(SqlBodies):
    """The async store methods of :class:`SqlBodies`."""

    append_events = async_method(SqlBodies._append_events)
    events = async_method(SqlBodies._events)
    messages_read = async_method(SqlBodies._messages_read)
    ledger_get = async_method(SqlBodies._ledger_get)
    ledger = async_method(SqlBodies._ledger)
    ledger_repeat = async_method(SqlBodies._ledger_repeat)
    ledger_committed_digests = async_method(SqlBodies._ledger_committed_digests)
    ledger_write = async_method(SqlBodies._ledger_write)
    decision_get = async_method(SqlBodies._decision_get)
    decision_digests = async_method(SqlBodies._decision_digests)
    decision_forget = async_method(SqlBodies._decision_forget)
    put_artifact = async_method(SqlBodies._put_artifact)
    get_artifact = async_method(SqlBodies._get_artifact)
    delete_artifacts = async_method(SqlBodies._delete_artifacts)
    delete_thread = async_method(SqlBodies._delete_thread)
    prune_checkpoints = async_method(SqlBodies._prune_checkpoints)
    compact_events = async_method(SqlBodies._compact_events)
