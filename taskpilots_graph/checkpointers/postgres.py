"""Recovery store in the same PostgreSQL database as LangGraph's ``PostgresSaver``.

The store uses the saver's connection pool (or its single connection, under the saver's own
lock), so writing an event never opens a connection of its own. Every write commits before
the call returns: an external action may follow it, so each connection's session sets
``synchronous_commit`` back to ``on`` before its first write, whatever the server or role
default says.

Failures are typed (:mod:`._pg_connect`): a lost connection is ``StorageUnavailable``. A call
that lost its connection is retried once when it cannot have changed anything: a read, or a
write whose transaction never reached COMMIT. A write lost while it may have been committing
(a single autocommit statement, or the COMMIT itself) is ambiguous: it is never retried, the
error says so, and the next read shows what happened. The schema version is checked on the
first use of a store, as SQLite does: a worker that skipped ``setup()`` never runs on a schema
it does not know. Both forms run the same statements (:mod:`._pg_statements`, :mod:`._sqlstore`);
this module holds where they run: the connection, the transaction, the retry.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from functools import partial
from typing import Any, Final, TypeVar

import psycopg
from psycopg import AsyncConnection, Connection, errors
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from taskpilots_graph._twins import IO, Steps, arun_steps, run_steps
from taskpilots_graph.checkpointers import _schema as sql
from taskpilots_graph.checkpointers._pg_connect import connection_lost, storage_error
from taskpilots_graph.checkpointers._pg_statements import (
    PostgresBodies,
    message_params,
    ride_statements,
    written,
)
from taskpilots_graph.checkpointers._ride_rows import pending_ride
from taskpilots_graph.checkpointers._sqlstore import (
    AsyncSqlQueries,
    SqlQueries,
    Statements,
    Stmt,
    afetched,
    arun_statements,
    fetched,
    pending_migrations,
    run_statements,
)
from taskpilots_graph.checkpointers.base import HeldCommit
from taskpilots_graph.checkpointers.messages import MessageRows
from taskpilots_graph.errors import ConfigurationError, MigrationError, StorageError

__all__ = ["AsyncPostgresStore", "PostgresStore"]

_D: Final = "postgres"
_MESSAGES = sql.MESSAGES[_D]
_SETUP_TIMEOUT_S = 60.0
_DURABLE = "SET synchronous_commit = on"
_TRY_LOCK = "SELECT pg_try_advisory_lock(%s)"
_UNLOCK = "SELECT pg_advisory_unlock(%s)"

# Connections on which the session setting above has been made. Set once per connection (a
# round trip saved on every write) rather than per transaction; the setting only ever
# strengthens durability, also for the saver sharing the connection.
_durable: weakref.WeakSet[Any] = weakref.WeakSet()

T = TypeVar("T")


class _Failed(Exception):
    """A psycopg failure inside ``_within``, typed by the public method it ends."""

    def __init__(self, exc: psycopg.Error, *, sent: bool) -> None:
        super().__init__(str(exc))
        self.exc = exc
        # ``sent``: a write may have been committing; never retried, reported as ambiguous.
        self.sent = sent
        self.retry = not sent and connection_lost(exc) and not isinstance(exc, PoolTimeout)

    def typed(self, operation: str) -> StorageError:
        typed = storage_error(self.exc, operation, ambiguous=self.sent)
        assert typed is not None  # only typeable failures become _Failed
        return typed


def _failure(exc: psycopg.Error, sent: bool) -> Exception | None:
    """What a psycopg failure inside ``_within`` raises instead (``None``: itself)."""
    if isinstance(exc, errors.UndefinedTable):
        return StorageError(
            "the taskpilots tables do not exist in this database; call checkpointer.setup() "
            f"once before use ({exc.diag.message_primary})"
        )
    return None if storage_error(exc, "") is None else _Failed(exc, sent=sent)


def _retrying(operation: str, call: Callable[[], Any]) -> Steps[Any]:
    """``call()`` (awaited when async), its psycopg failures typed as store method
    ``operation``'s; retried once when it cannot have changed anything."""
    for attempt in (1, 2):
        try:
            return (yield IO(call, call))
        except _Failed as exc:
            if not exc.retry or attempt == 2:
                raise exc.typed(operation) from exc.exc
        except psycopg.Error as exc:  # outside ``_within`` (setup): typed, never retried
            if (typed := storage_error(exc, operation)) is None:
                raise
            raise typed from exc
    raise AssertionError("unreachable")


def _require_autocommit(autocommit: bool) -> None:
    if not autocommit:
        raise ConfigurationError(
            "PostgreSQL connections must be opened with autocommit=True, as LangGraph's "
            "PostgresSaver requires; use RecoveryCheckpointer.from_conn_string(url) or pass "
            "kwargs={'autocommit': True, 'prepare_threshold': 0, 'row_factory': dict_row}"
        )


def _check_deadline(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise MigrationError(
            f"another process held the setup lock for over {_SETUP_TIMEOUT_S:.0f} s"
        )


def _execute(cur: Any, stmt: Stmt) -> Any:
    if stmt.many:
        return cur.executemany(stmt.statement, stmt.params)
    return fetched(cur.execute(stmt.statement, stmt.params, binary=stmt.binary), stmt.fetch)


async def _aexecute(cur: Any, stmt: Stmt) -> Any:
    if stmt.many:
        return await cur.executemany(stmt.statement, stmt.params)
    await cur.execute(stmt.statement, stmt.params, binary=stmt.binary)
    return await afetched(cur, stmt.fetch)


class PostgresStore(PostgresBodies, SqlQueries):
    """Synchronous recovery store on a psycopg ``ConnectionPool`` or ``Connection``."""

    def __init__(self, conn: Connection[Any] | ConnectionPool[Any], lock: threading.Lock) -> None:
        self.conn = conn
        # Only used for a single shared connection: the saver serialises on the same lock.
        self.lock = lock
        self.schema_checked = False

    @contextmanager
    def _connection(self) -> Iterator[Connection[Any]]:
        if isinstance(self.conn, ConnectionPool):
            with self.conn.connection() as conn:
                yield conn
        else:
            with self.lock:
                yield self.conn

    def _within(self, operation: str, body: Callable[[], Statements[T]], *, write: bool) -> T:
        # Reads, and writes of one statement (``Stmt.alone``), run as single autocommit
        # statements: no BEGIN/COMMIT round trips.
        def once() -> T:
            sent = opened = False  # a write may be committing; a transaction block is open
            try:
                with self._connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
                    run_statements(self._schema(), partial(_execute, cur))
                    if not write:
                        return run_statements(body(), partial(_execute, cur))
                    if conn not in _durable:
                        cur.execute(_DURABLE)
                        _durable.add(conn)
                    with ExitStack() as block:

                        def execute(stmt: Stmt) -> Any:
                            nonlocal sent, opened
                            if not opened and stmt.alone:
                                sent = True
                            elif not opened:
                                block.enter_context(conn.transaction())
                                opened = True
                            return _execute(cur, stmt)

                        result = run_statements(body(), execute)
                        sent = True  # the COMMIT follows
                    return result
            except psycopg.Error as exc:
                if (failure := _failure(exc, sent)) is None:
                    raise
                raise failure from exc

        result: T = run_steps(_retrying(operation, once))
        return result

    def setup(self, inner_setup: Callable[[], None] | None = None) -> None:
        """Run ``inner_setup`` (the saver's own) and the store's migrations, one process at once.

        A session-level advisory lock is *polled* rather than waited for: the saver's setup
        builds indexes ``CONCURRENTLY``, which waits for every open transaction, and a session
        blocked inside ``pg_advisory_lock`` holds one: the two would wait on each other.
        """
        run_steps(_retrying("setup", partial(self._migrate, inner_setup)))

    def _migrate(self, inner_setup: Callable[[], None] | None) -> None:
        deadline = time.monotonic() + _SETUP_TIMEOUT_S
        with self._connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
            _require_autocommit(conn.autocommit)
            while not cur.execute(_TRY_LOCK, (sql.SETUP_LOCK_KEY,)).fetchone()[0]:  # type: ignore[index]
                _check_deadline(deadline)
                time.sleep(0.05)
            try:
                if inner_setup is not None:
                    self._unlocked(inner_setup)
                with conn.transaction():
                    cur.execute(sql.CREATE_MIGRATIONS_TABLE[_D])
                    current = cur.execute(sql.SELECT_VERSION).fetchone()[0]  # type: ignore[index]
                    for version, script in pending_migrations(_D, current):
                        # Scripts hold several statements, which cannot be prepared
                        # (the pool's connections prepare everything: prepare_threshold=0).
                        cur.execute(script, prepare=False)
                        cur.execute(sql.INSERT_VERSION[_D], (version,))
                self.schema_checked = True
            finally:
                cur.execute(_UNLOCK, (sql.SETUP_LOCK_KEY,))

    def _unlocked(self, fn: Callable[[], None]) -> None:
        # With a single shared connection the saver takes ``self.lock`` itself.
        if isinstance(self.conn, ConnectionPool):
            fn()
        else:
            self.lock.release()
            try:
                fn()
            finally:
                self.lock.acquire()

    def messages_write(self, rows: MessageRows) -> None:
        """Insert a checkpoint's new messages, sequences and references: one statement,
        in the saver's transaction inside a ride (see :class:`._ride_rows.Ride`), otherwise
        committed before the saver writes the checkpoint that refers to them."""
        if (ride := pending_ride(self)) is None:
            self._within("messages_write", partial(self._messages_write, rows), write=True)
            return
        if not self.schema_checked:  # the saver's put checks no version
            self._within("messages_write", self._schema, write=False)
        ride.take(rows, write=lambda cur: cur.execute(_MESSAGES["write"], message_params(rows)))

    def ledger_ride(self, held: Sequence[HeldCommit]) -> Callable[[Any], None] | None:
        """The insert of held commits on the saver's cursor (its put_writes transaction),
        or ``None`` when a commit's events span threads (then it is written on its own).

        A commit that finds its intent moved raises ``LedgerConflict``: the saver's
        transaction rolls back the task's writes with it.
        """
        statements = ride_statements(held)
        if statements is None:
            return None
        if not self.schema_checked:  # the saver's put_writes checks no version
            self._within("ledger_ride", self._schema, write=False)

        def write(cur: Any) -> None:
            # The saver's cursor yields dicts; the ledger statement's row is read as a tuple.
            with cur.connection.cursor(row_factory=tuple_row) as own:
                for key, (statement, params, events) in statements:
                    written(key, own.execute(statement, params).fetchone(), events)

        return write


class AsyncPostgresStore(PostgresBodies, AsyncSqlQueries):
    """Asynchronous recovery store on a psycopg ``AsyncConnectionPool`` or ``AsyncConnection``.

    Over a pool, calls run concurrently on separate connections; no per-instance lock
    funnels them (the bottleneck of ``AsyncPostgresSaver``, LangGraph #7259).
    """

    def __init__(
        self, conn: AsyncConnection[Any] | AsyncConnectionPool[Any], lock: asyncio.Lock
    ) -> None:
        self.conn = conn
        self.lock = lock
        self.schema_checked = False

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[AsyncConnection[Any]]:
        if isinstance(self.conn, AsyncConnectionPool):
            async with self.conn.connection() as conn:
                yield conn
        else:
            async with self.lock:
                yield self.conn

    async def _within(self, operation: str, body: Callable[[], Statements[T]], *, write: bool) -> T:
        async def once() -> T:
            sent = opened = False
            try:
                async with self._connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
                    await arun_statements(self._schema(), partial(_aexecute, cur))
                    if not write:
                        return await arun_statements(body(), partial(_aexecute, cur))
                    if conn not in _durable:
                        await cur.execute(_DURABLE)
                        _durable.add(conn)
                    async with AsyncExitStack() as block:

                        async def execute(stmt: Stmt) -> Any:
                            nonlocal sent, opened
                            if not opened and stmt.alone:
                                sent = True
                            elif not opened:
                                await block.enter_async_context(conn.transaction())
                                opened = True
                            return await _aexecute(cur, stmt)

                        result = await arun_statements(body(), execute)
                        sent = True
                    return result
            except psycopg.Error as exc:
                if (failure := _failure(exc, sent)) is None:
                    raise
                raise failure from exc

        result: T = await arun_steps(_retrying(operation, once))
        return result

    async def setup(self, inner_setup: Callable[[], Awaitable[None]] | None = None) -> None:
        """Async twin of :meth:`PostgresStore.setup`."""
        await arun_steps(_retrying("setup", partial(self._migrate, inner_setup)))

    async def _migrate(self, inner_setup: Callable[[], Awaitable[None]] | None) -> None:
        deadline = time.monotonic() + _SETUP_TIMEOUT_S
        async with self._connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
            _require_autocommit(conn.autocommit)
            while not (await (await cur.execute(_TRY_LOCK, (sql.SETUP_LOCK_KEY,))).fetchone())[0]:  # type: ignore[index]
                _check_deadline(deadline)
                await asyncio.sleep(0.05)
            try:
                if inner_setup is not None:
                    await self._unlocked(inner_setup)
                async with conn.transaction():
                    await cur.execute(sql.CREATE_MIGRATIONS_TABLE[_D])
                    (current,) = await (await cur.execute(sql.SELECT_VERSION)).fetchone()  # type: ignore[misc]
                    for version, script in pending_migrations(_D, current):
                        await cur.execute(script, prepare=False)
                        await cur.execute(sql.INSERT_VERSION[_D], (version,))
                self.schema_checked = True
            finally:
                await cur.execute(_UNLOCK, (sql.SETUP_LOCK_KEY,))

    async def _unlocked(self, fn: Callable[[], Awaitable[None]]) -> None:
        if isinstance(self.conn, AsyncConnectionPool):
            await fn()
        else:
            self.lock.release()
            try:
                await fn()
            finally:
                await self.lock.acquire()

    async def messages_write(self, rows: MessageRows) -> None:
        """Async twin of :meth:`PostgresStore.messages_write`."""
        if (ride := pending_ride(self)) is None:
            await self._within("messages_write", partial(self._messages_write, rows), write=True)
            return
        if not self.schema_checked:
            await self._within("messages_write", self._schema, write=False)

        async def write(cur: Any) -> None:
            await cur.execute(_MESSAGES["write"], message_params(rows))

        ride.take(rows, awrite=write)
