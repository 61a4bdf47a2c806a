"""Recovery store in the same SQLite file as LangGraph's ``SqliteSaver`` / ``AsyncSqliteSaver``.

The store borrows the saver's connection and lock instead of opening its own: SQLite allows one
writer per file, and a second connection in the same process would only wait on the first.
Tables are created lazily on first use, as ``SqliteSaver`` does, and migrated inside
``BEGIN IMMEDIATE`` so that two processes opening one file at once apply each migration once.
The sync and the async store run the same bodies (:mod:`._sqlstore`, :mod:`.._twins`).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Final, TypeVar

from taskpilots_graph._twins import IO, Steps, arun_steps, run_steps
from taskpilots_graph.checkpointers import _schema as sql
from taskpilots_graph.checkpointers._ride_rows import pending_ride
from taskpilots_graph.checkpointers._rows import ledger_write_sql
from taskpilots_graph.checkpointers._sqlite_connect import committing, mapped_errors, sqlite_error
from taskpilots_graph.checkpointers._sqlstore import (
    AsyncSqlQueries,
    Fetch,
    SqlBodies,
    SqlQueries,
    Statements,
    Stmt,
    afetched,
    arun_statements,
    fetched,
    pending_migrations,
    run_statements,
    writes,
)
from taskpilots_graph.checkpointers.base import DecisionRecord, HeldCommit, PendingRecord
from taskpilots_graph.checkpointers.messages import MessageRows
from taskpilots_graph.errors import LedgerConflict
from taskpilots_graph.events import Event, EventRecord

__all__ = ["AsyncSqliteStore", "SqliteStore"]

_D: Final = "sqlite"
_LEDGER = sql.LEDGER[_D]
_MESSAGES = sql.MESSAGES[_D]
_HAS_MIGRATIONS: Final = (
    f"SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '{sql.MIGRATIONS_TABLE}'"
)
_JOURNAL_MODE: Final = "PRAGMA journal_mode"
_SYNCHRONOUS: Final = "PRAGMA synchronous"

T = TypeVar("T")


def _statements(script: str) -> list[str]:
    # Migrations hold plain DDL (no triggers, no string literals with ';'), so a split is
    # exact; executescript() is avoided because it commits the surrounding transaction.
    return [s.strip() for s in script.split(";") if s.strip()]


def _up_to_date(version: Any) -> bool:
    """The file's schema is already this library's (``pending_migrations`` refuses a newer one)."""
    return version is not None and not pending_migrations(_D, int(version))


def _append_params(record: EventRecord) -> tuple[Any, ...]:
    return (
        record.thread_id,
        record.kind.value,
        record.ts,
        record.checkpoint_ns,
        record.checkpoint_id,
        record.payload,
        record.thread_id,
    )


def _execute(cur: Any, stmt: Stmt) -> Any:
    """Run ``stmt`` on a sqlite3 cursor or connection."""
    if stmt.many:
        return cur.executemany(stmt.statement, stmt.params)
    return fetched(cur.execute(stmt.statement, stmt.params), stmt.fetch)


async def _aexecute(conn: Any, stmt: Stmt) -> Any:
    """Run ``stmt`` on an aiosqlite connection."""
    if stmt.many:
        return await conn.executemany(stmt.statement, stmt.params)
    async with conn.execute(stmt.statement, stmt.params) as cur:
        return await afetched(cur, stmt.fetch)


def _step(conn: Any, statement: str, params: Any = (), fetch: Fetch = "count") -> IO:
    """A statement on a sqlite3 or an aiosqlite connection, as a step of :mod:`.._twins`."""
    stmt = Stmt(statement, params, fetch)
    return IO(partial(_execute, conn, stmt), partial(_aexecute, conn, stmt))


def _fsync_skipped(in_transaction: bool) -> Statements[int | None]:
    """Let the next commit skip its fsync where that is safe; the level to restore after.

    Message rows are committed just before the checkpoint that refers to them, and that
    checkpoint's commit syncs. In WAL mode the log is one append-only file, so its sync
    makes every earlier commit durable too: a crash can lose the rows only together with
    the checkpoint, never leave one pointing at missing rows. Outside WAL mode (or inside
    an open transaction, where the level cannot change) nothing changes (``None``).
    """
    if in_transaction or (yield Stmt(_JOURNAL_MODE, (), "one"))[0] != "wal":
        return None
    level = int((yield Stmt(_SYNCHRONOUS, (), "one"))[0])
    yield Stmt(f"{_SYNCHRONOUS} = NORMAL")
    return level


def _no_fsync(conn: sqlite3.Connection) -> int | None:
    """:func:`_fsync_skipped` on a sqlite3 connection."""
    return run_statements(_fsync_skipped(conn.in_transaction), partial(_execute, conn))


def _messages_write(rows: MessageRows) -> Statements[None]:
    """The inserts of ``messages_write``, in order (an empty one is left out)."""
    t = rows.thread_id
    messages = [(t, m.key, m.message_id, m.type, m.payload) for m in rows.messages]
    sequences = [
        (t, s.seq, s.checkpoint_ns, s.channel, s.parent_seq, s.parent_len) for s in rows.sequences
    ]
    refs = [(t, seq, position, key) for seq, position, key in rows.refs]
    for name, params in (("message", messages), ("sequence", sequences), ("ref", refs)):
        if params:
            yield Stmt(_MESSAGES[name], params, many=True)


class _SqliteBodies(SqlBodies):
    """What the sync and the async SQLite store run alike."""

    _dialect = _D
    conn: Any
    is_setup: bool

    @writes
    def _append_events(self, records: Sequence[PendingRecord]) -> Statements[list[Event]]:
        stored = []
        for record in records:
            if isinstance(record, DecisionRecord):
                yield Stmt(_LEDGER["decision_put"], record.params())
            else:
                (seq,) = yield Stmt(sql.APPEND_EVENT[_D], _append_params(record), "one")
                stored.append(record.to_event(seq))
        return stored

    def _ride(self, held: Sequence[HeldCommit]) -> Statements[None]:
        for commit in held:
            statement, params = ledger_write_sql(_D, commit.entry, commit.expect)
            if (yield Stmt(statement, params)) != 1:
                raise LedgerConflict(commit.entry.key, performed=True)
            yield from self._append_events(commit.events)

    def _migrate(self) -> Steps[None]:
        """Create or migrate the tables on first use (under the store's lock)."""
        if self.is_setup:
            return
        conn = self.conn
        if (yield _step(conn, _HAS_MIGRATIONS, fetch="one")) is not None and _up_to_date(
            (yield _step(conn, sql.SELECT_VERSION, fetch="one"))[0]
        ):
            self.is_setup = True  # no write: a read-only file opens for inspection
            return
        yield _step(conn, sql.CREATE_MIGRATIONS_TABLE[_D])
        yield IO(conn.commit, conn.commit)
        yield _step(conn, "BEGIN IMMEDIATE")
        try:
            (current,) = yield _step(conn, sql.SELECT_VERSION, fetch="one")
            for version, script in pending_migrations(_D, current):
                for statement in _statements(script):
                    yield _step(conn, statement)
                yield _step(conn, sql.INSERT_VERSION[_D], (version,))
            yield IO(conn.commit, conn.commit)
        except BaseException:
            yield IO(conn.rollback, conn.rollback)
            raise
        self.is_setup = True


class SqliteStore(_SqliteBodies, SqlQueries):
    """Synchronous recovery store sharing a ``SqliteSaver``'s connection and lock."""

    def __init__(self, conn: sqlite3.Connection, lock: threading.Lock) -> None:
        self.conn = conn
        self.lock = lock
        self.is_setup = False

    def _within(
        self,
        operation: str,
        body: Callable[[], Statements[T]],
        *,
        write: bool = True,
        fsync: bool = True,
    ) -> T:
        # ``write`` aside: every body runs in a transaction that commits.
        with self.lock, mapped_errors(operation):
            run_steps(self._migrate())
            level = None if fsync else _no_fsync(self.conn)
            try:
                with committing(self.conn) as cur:
                    return run_statements(body(), partial(_execute, cur))
            finally:
                if level is not None:
                    self.conn.execute(f"{_SYNCHRONOUS} = {level}")

    def _on_saver(self, cur: sqlite3.Cursor, body: Statements[None]) -> None:
        # Runs under the saver's lock, which is this store's lock too.
        run_steps(self._migrate())
        run_statements(body, partial(_execute, cur))

    def setup(self, inner_setup: Callable[[], None] | None = None) -> None:
        """Run ``inner_setup`` under the shared lock, then migrate the store's tables."""
        if inner_setup is not None:
            with self.lock:
                inner_setup()
        with self.lock, mapped_errors("setup"):
            run_steps(self._migrate())

    def messages_write(self, rows: MessageRows) -> None:
        """Insert a checkpoint's new messages, sequences and references in one transaction.

        Inside a ride (:func:`~taskpilots_graph.checkpointers._ride_rows.riding`) the rows are
        handed to the saver's ``put`` and committed with the checkpoint. Otherwise in a
        transaction of their own, committed before the saver writes the checkpoint: a crash
        in between leaves unreferenced rows, never a checkpoint that refers to missing ones.
        """
        if (ride := pending_ride(self)) is not None:
            ride.take(rows, write=lambda cur: self._on_saver(cur, _messages_write(rows)))
            return
        self._within("messages_write", partial(_messages_write, rows), fsync=False)

    def ledger_ride(self, held: Sequence[HeldCommit]) -> Callable[[sqlite3.Cursor], None]:
        """The insert of held commits on the saver's cursor (its put_writes transaction).

        A commit that finds its intent moved raises ``LedgerConflict``: the saver rolls
        back the task's writes with it.
        """
        return lambda cur: self._on_saver(cur, self._ride(held))


class AsyncSqliteStore(_SqliteBodies, AsyncSqlQueries):
    """Asynchronous recovery store sharing an ``AsyncSqliteSaver``'s connection and lock."""

    def __init__(self, conn: Any, lock: asyncio.Lock) -> None:
        self.conn = conn  # aiosqlite.Connection (untyped library)
        self.lock = lock
        self.is_setup = False

    async def _within(
        self,
        operation: str,
        body: Callable[[], Statements[T]],
        *,
        write: bool = True,
        fsync: bool = True,
    ) -> T:
        run = partial(_aexecute, self.conn)
        async with self.lock:
            with mapped_errors(operation):
                await arun_steps(self._migrate())
                skipped = _fsync_skipped(self.conn.in_transaction)
                level = None if fsync else await arun_statements(skipped, run)
            try:
                result = await arun_statements(body(), run)
                with mapped_errors(operation):
                    await self.conn.commit()
                return result
            except BaseException as exc:
                await self.conn.rollback()
                typed = sqlite_error(exc, operation) if isinstance(exc, sqlite3.Error) else None
                if typed is None:
                    raise
                raise typed from exc
            finally:
                if level is not None:
                    await self.conn.execute(f"{_SYNCHRONOUS} = {level}")

    async def _on_saver(self, conn: Any, body: Statements[None]) -> None:
        # Runs under the saver's lock, which is this store's lock too.
        await arun_steps(self._migrate())
        await arun_statements(body, partial(_aexecute, conn))

    async def setup(self, inner_setup: Callable[[], Awaitable[None]] | None = None) -> None:
        """Await ``inner_setup`` (it takes the shared lock itself), then migrate."""
        if inner_setup is not None:
            await inner_setup()
        async with self.lock:
            with mapped_errors("setup"):
                await arun_steps(self._migrate())

    async def messages_write(self, rows: MessageRows) -> None:
        """Async twin of :meth:`SqliteStore.messages_write`."""
        if (ride := pending_ride(self)) is not None:
            ride.take(rows, awrite=lambda conn: self._on_saver(conn, _messages_write(rows)))
            return
        await self._within("messages_write", partial(_messages_write, rows), fsync=False)
