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
it does not know.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final, ParamSpec, TypeVar

import psycopg
from psycopg import AsyncConnection, Connection, errors
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from taskpilots_graph.checkpointers import _schema as sql
from taskpilots_graph.checkpointers._pg_connect import connection_lost, storage_error
from taskpilots_graph.checkpointers._rows import ledger_write_sql
from taskpilots_graph.checkpointers._sqlstore import (
    STATEMENTS,
    AsyncSqlQueries,
    Fetch,
    SqlQueries,
    afetched,
    artifact_key,
    compaction_params,
    fetched,
    pending_migrations,
)
from taskpilots_graph.checkpointers.artifacts import PreparedArtifact
from taskpilots_graph.checkpointers.base import (
    DecisionRecord,
    HeldCommit,
    PendingRecord,
    rows_to_events,
)
from taskpilots_graph.checkpointers.messages import MessageRows, pending_ride
from taskpilots_graph.compaction import CompactionPolicy
from taskpilots_graph.errors import (
    ConfigurationError,
    LedgerConflict,
    MigrationError,
    StorageError,
)
from taskpilots_graph.events import Event, EventRecord
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus

__all__ = ["AsyncPostgresStore", "PostgresStore"]

_D: Final = "postgres"
_LEDGER = sql.LEDGER[_D]
_ARTIFACTS = sql.ARTIFACTS[_D]
_MESSAGES = sql.MESSAGES[_D]
_SETUP_TIMEOUT_S = 60.0
_DURABLE = "SET synchronous_commit = on"

# Connections on which the session setting above has been made. Set once per connection (a
# round trip saved on every write) rather than per transaction; the setting only ever
# strengthens durability, also for the saver sharing the connection.
_durable: weakref.WeakSet[Any] = weakref.WeakSet()

P = ParamSpec("P")
R = TypeVar("R")


class _Failed(Exception):
    """A psycopg failure inside ``_transaction``, typed by the public method it ends."""

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


def _retry_or_raise(exc: _Failed | psycopg.Error, operation: str, attempt: int) -> None:
    """Return to retry (once) a call that cannot have changed anything; else raise typed."""
    if isinstance(exc, _Failed):
        if exc.retry and attempt == 1:
            return
        raise exc.typed(operation) from exc.exc
    if (typed := storage_error(exc, operation)) is None:  # outside _transaction (setup)
        raise exc
    raise typed from exc


def _retrying(operation: str, call: Callable[[], R]) -> R:
    """``call()``, its psycopg failures typed as store method ``operation``'s."""
    for attempt in (1, 2):
        try:
            return call()
        except (_Failed, psycopg.Error) as exc:
            _retry_or_raise(exc, operation, attempt)
    raise AssertionError("unreachable")


async def _aretrying(operation: str, call: Callable[[], Awaitable[R]]) -> R:
    """Async twin of :func:`_retrying`."""
    for attempt in (1, 2):
        try:
            return await call()
        except (_Failed, psycopg.Error) as exc:
            _retry_or_raise(exc, operation, attempt)
    raise AssertionError("unreachable")


def _guarded(method: Callable[P, R]) -> Callable[P, R]:
    """Type the store's psycopg failures; retry once a call that cannot have changed anything."""

    @functools.wraps(method)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return _retrying(method.__name__, lambda: method(*args, **kwargs))

    return run


def _aguarded(method: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Async twin of :func:`_guarded`."""

    @functools.wraps(method)
    async def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return await _aretrying(method.__name__, lambda: method(*args, **kwargs))

    return run


def _schema_error(current: int) -> StorageError | None:
    """Why a store may not run on a schema at version ``current`` (``None``: it may)."""
    if current > sql.SCHEMA_VERSION:
        return MigrationError(
            f"the database schema is at version {current}, newer than this library's "
            f"{sql.SCHEMA_VERSION}; upgrade taskpilots-graph"
        )
    if current < sql.SCHEMA_VERSION:
        return MigrationError(
            f"the database schema is at version {current}, older than this library's "
            f"{sql.SCHEMA_VERSION}; call checkpointer.setup() once to migrate it"
        )
    return None


_TRY_LOCK = "SELECT pg_try_advisory_lock(%s)"
_UNLOCK = "SELECT pg_advisory_unlock(%s)"


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


def _events_json(records: Sequence[EventRecord]) -> str:
    # One JSON text rather than arrays: psycopg adapts a list element by element in Python,
    # and the payloads are JSON already (spliced in, not encoded again).
    rows = ",".join(
        f"[{json.dumps(r.kind.value)},{r.ts!r},{json.dumps(r.checkpoint_ns)},"
        f"{json.dumps(r.checkpoint_id)},{r.payload}]"
        for r in records
    )
    return f"[{rows}]"


# One statement per thread: its events and decisions, after a ledger write or on their own.
_WRITES: Final = {
    statement: sql.write_pg(statement) for statement in (None, _LEDGER["insert"], _LEDGER["update"])
}


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
) -> tuple[str, dict[str, Any], list[EventRecord]]:
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


def _written(key: str | None, row: Any, events: Sequence[EventRecord]) -> list[Event]:
    count, seqs = row
    if count != 1:
        assert key is not None  # only a ledger write can write nothing
        raise LedgerConflict(key)
    return [record.to_event(seq) for record, seq in zip(events, seqs, strict=True)]


def _append_all(cur: Any, records: Sequence[PendingRecord]) -> list[Event]:
    stored: list[Event] = []
    for thread_id, group in _by_thread(records).items():
        statement, params, events = _write(None, {}, thread_id, group)
        stored += _written(None, cur.execute(statement, params).fetchone(), events)
    return stored


async def _aappend_all(cur: Any, records: Sequence[PendingRecord]) -> list[Event]:
    stored: list[Event] = []
    for thread_id, group in _by_thread(records).items():
        statement, params, events = _write(None, {}, thread_id, group)
        await cur.execute(statement, params)
        stored += _written(None, await cur.fetchone(), events)
    return stored


def _one_statement(
    statement: str, params: dict[str, Any], records: Sequence[PendingRecord]
) -> tuple[str, dict[str, Any], list[EventRecord]] | None:
    """The ledger write and ``records`` as one statement, when they are of one thread."""
    groups = _by_thread(records)
    if len(groups) > 1:
        return None  # rare (a business key of another thread): one transaction instead
    thread_id, group = next(iter(groups.items()), ("", []))
    return _write(statement, params, thread_id, group)


def _ride_statements(
    held: Sequence[HeldCommit],
) -> list[tuple[str, tuple[str, dict[str, Any], list[EventRecord]]]] | None:
    """Each held commit with its events as one statement, or ``None`` if one cannot be."""
    statements = []
    for commit in held:
        statement, params = ledger_write_sql(_D, commit.entry, commit.expect)
        if (one := _one_statement(statement, params, commit.events)) is None:
            return None
        statements.append((commit.entry.key, one))
    return statements


def _message_params(rows: MessageRows) -> dict[str, Any]:
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


def _missing_tables(exc: errors.UndefinedTable) -> StorageError:
    return StorageError(
        "the taskpilots tables do not exist in this database; call checkpointer.setup() "
        f"once before use ({exc.diag.message_primary})"
    )


class PostgresStore(SqlQueries):
    """Synchronous recovery store on a psycopg ``ConnectionPool`` or ``Connection``."""

    _dialect = _D

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

    @contextmanager
    def _transaction(self, *, write: bool = True, begin: bool = True) -> Iterator[Any]:
        # Reads, and writes made of one statement (``begin=False``), run as single
        # autocommit statements: no BEGIN/COMMIT round trips.
        sent = False  # whether a write may have been committing when a failure came
        try:
            with self._connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
                if not self.schema_checked:
                    self._check_schema(cur)
                if not write:
                    yield cur
                    return
                if conn not in _durable:
                    cur.execute(_DURABLE)
                    _durable.add(conn)
                if not begin:
                    sent = True
                    yield cur
                    return
                with conn.transaction():
                    yield cur
                    sent = True  # the COMMIT follows
        except errors.UndefinedTable as exc:
            raise _missing_tables(exc) from exc
        except psycopg.Error as exc:
            if storage_error(exc, "") is None:
                raise
            raise _Failed(exc, sent=sent) from exc

    def _run(
        self,
        operation: str,
        params: Any,
        fetch: Fetch,
        *,
        statement: str | None = None,
        write: bool = False,
        binary: bool | None = None,
    ) -> Any:
        statement = statement or STATEMENTS[_D][operation]

        def once() -> Any:
            with self._transaction(write=write) as cur:
                return fetched(cur.execute(statement, params, binary=binary), fetch)

        return _retrying(operation, once)

    def _check_schema(self, cur: Any) -> None:
        problem = _schema_error(cur.execute(sql.SELECT_VERSION).fetchone()[0])
        if problem is not None:
            raise problem
        self.schema_checked = True

    @_guarded
    def setup(self, inner_setup: Callable[[], None] | None = None) -> None:
        """Run ``inner_setup`` (the saver's own) and the store's migrations, one process at once.

        A session-level advisory lock is *polled* rather than waited for: the saver's setup
        builds indexes ``CONCURRENTLY``, which waits for every open transaction, and a session
        blocked inside ``pg_advisory_lock`` holds one: the two would wait on each other.
        """
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

    @_guarded
    def append_events(self, records: Sequence[PendingRecord]) -> list[Event]:
        # One thread's records are one statement: no transaction block needed around it.
        with self._transaction(begin=len(_by_thread(records)) > 1) as cur:
            return _append_all(cur, records)

    @_guarded
    def delete_thread(self, thread_id: str) -> None:
        with self._transaction() as cur:
            for statement in sql.DELETE_THREAD[_D]:
                cur.execute(statement, (thread_id,))

    @_guarded
    def messages_write(self, rows: MessageRows) -> None:
        """Insert a checkpoint's new messages, sequences and references: one statement,
        in the saver's transaction inside a ride (see :class:`.messages.Ride`), otherwise
        committed before the saver writes the checkpoint that refers to them."""
        if (ride := pending_ride(self)) is not None:
            if not self.schema_checked:  # the saver's put checks no version
                with self._transaction(write=False):
                    pass
            ride.take(
                rows, write=lambda cur: cur.execute(_MESSAGES["write"], _message_params(rows))
            )
            return
        with self._transaction(begin=False) as cur:
            cur.execute(_MESSAGES["write"], _message_params(rows))

    @_guarded
    def prune_checkpoints(self, thread_id: str, keep: Sequence[str]) -> int:
        first, *rest = sql.PRUNE_CHECKPOINTS[_D]
        with self._transaction() as cur:
            removed = cur.execute(first, (thread_id, list(keep))).rowcount
            for statement in rest:
                cur.execute(statement, (thread_id,))
        return int(removed)

    @_guarded
    def ledger_write(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[PendingRecord] = (),
    ) -> list[Event]:
        statement, params = ledger_write_sql(_D, entry, expect)
        if (one := _one_statement(statement, params, events)) is not None:
            with self._transaction(begin=False) as cur:
                return _written(entry.key, cur.execute(one[0], one[1]).fetchone(), one[2])
        with self._transaction() as cur:
            if cur.execute(statement, params).rowcount != 1:
                raise LedgerConflict(entry.key)
            return _append_all(cur, events)

    @_guarded
    def ledger_ride(self, held: Sequence[HeldCommit]) -> Callable[[Any], None] | None:
        """The insert of held commits on the saver's cursor (its put_writes transaction),
        or ``None`` when a commit's events span threads (then it is written on its own).

        A commit that finds its intent moved raises ``LedgerConflict``: the saver's
        transaction rolls back the task's writes with it.
        """
        statements = _ride_statements(held)
        if statements is None:
            return None
        if not self.schema_checked:  # the saver's put_writes checks no version
            with self._transaction(write=False):
                pass

        def write(cur: Any) -> None:
            # The saver's cursor yields dicts; the ledger statement's row is read as a tuple.
            with cur.connection.cursor(row_factory=tuple_row) as own:
                for key, (statement, params, events) in statements:
                    own.execute(statement, params)
                    _written(key, own.fetchone(), events)

        return write

    @_guarded
    def put_artifact(self, artifact: PreparedArtifact) -> None:
        with self._transaction() as cur:
            if cur.execute(_ARTIFACTS["exists"], artifact_key(artifact)).fetchone() is None:
                cur.execute(_ARTIFACTS["put"], artifact.params())

    @_guarded
    def compact_events(self, thread_id: str, policy: CompactionPolicy) -> int:
        # Read and rewrite need not be one snapshot: appends only add newer events, and a
        # concurrent compaction computes the same reduction of the same old payloads.
        with self._transaction() as cur:
            rows = cur.execute(sql.SELECT_EVENTS[_D], (thread_id, 0)).fetchall()
            plan = policy.plan(rows_to_events(rows))
            if plan:
                cur.executemany(sql.COMPACT_EVENT[_D], compaction_params(plan))
        return len(plan)


class AsyncPostgresStore(AsyncSqlQueries):
    """Asynchronous recovery store on a psycopg ``AsyncConnectionPool`` or ``AsyncConnection``.

    Over a pool, calls run concurrently on separate connections; no per-instance lock
    funnels them (the bottleneck of ``AsyncPostgresSaver``, LangGraph #7259).
    """

    _dialect = _D

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

    @asynccontextmanager
    async def _transaction(self, *, write: bool = True, begin: bool = True) -> AsyncIterator[Any]:
        sent = False
        try:
            async with self._connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
                if not self.schema_checked:
                    await self._check_schema(cur)
                if not write:
                    yield cur
                    return
                if conn not in _durable:
                    await cur.execute(_DURABLE)
                    _durable.add(conn)
                if not begin:
                    sent = True
                    yield cur
                    return
                async with conn.transaction():
                    yield cur
                    sent = True
        except errors.UndefinedTable as exc:
            raise _missing_tables(exc) from exc
        except psycopg.Error as exc:
            if storage_error(exc, "") is None:
                raise
            raise _Failed(exc, sent=sent) from exc

    async def _run(
        self,
        operation: str,
        params: Any,
        fetch: Fetch,
        *,
        statement: str | None = None,
        write: bool = False,
        binary: bool | None = None,
    ) -> Any:
        statement = statement or STATEMENTS[_D][operation]

        async def once() -> Any:
            async with self._transaction(write=write) as cur:
                await cur.execute(statement, params, binary=binary)
                return await afetched(cur, fetch)

        return await _aretrying(operation, once)

    async def _check_schema(self, cur: Any) -> None:
        (current,) = await (await cur.execute(sql.SELECT_VERSION)).fetchone()
        if (problem := _schema_error(current)) is not None:
            raise problem
        self.schema_checked = True

    @_aguarded
    async def setup(self, inner_setup: Callable[[], Awaitable[None]] | None = None) -> None:
        """Async twin of :meth:`PostgresStore.setup`."""
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

    @_aguarded
    async def append_events(self, records: Sequence[PendingRecord]) -> list[Event]:
        async with self._transaction(begin=len(_by_thread(records)) > 1) as cur:
            return await _aappend_all(cur, records)

    @_aguarded
    async def delete_thread(self, thread_id: str) -> None:
        async with self._transaction() as cur:
            for statement in sql.DELETE_THREAD[_D]:
                await cur.execute(statement, (thread_id,))

    @_aguarded
    async def messages_write(self, rows: MessageRows) -> None:
        """Async twin of :meth:`PostgresStore.messages_write`."""
        if (ride := pending_ride(self)) is not None:
            if not self.schema_checked:
                async with self._transaction(write=False):
                    pass

            async def write(cur: Any) -> None:
                await cur.execute(_MESSAGES["write"], _message_params(rows))

            ride.take(rows, awrite=write)
            return
        async with self._transaction(begin=False) as cur:
            await cur.execute(_MESSAGES["write"], _message_params(rows))

    @_aguarded
    async def prune_checkpoints(self, thread_id: str, keep: Sequence[str]) -> int:
        first, *rest = sql.PRUNE_CHECKPOINTS[_D]
        async with self._transaction() as cur:
            await cur.execute(first, (thread_id, list(keep)))
            removed = cur.rowcount
            for statement in rest:
                await cur.execute(statement, (thread_id,))
        return int(removed)

    @_aguarded
    async def ledger_write(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[PendingRecord] = (),
    ) -> list[Event]:
        statement, params = ledger_write_sql(_D, entry, expect)
        if (one := _one_statement(statement, params, events)) is not None:
            async with self._transaction(begin=False) as cur:
                await cur.execute(one[0], one[1])
                return _written(entry.key, await cur.fetchone(), one[2])
        async with self._transaction() as cur:
            await cur.execute(statement, params)
            if cur.rowcount != 1:
                raise LedgerConflict(entry.key)
            return await _aappend_all(cur, events)

    @_aguarded
    async def put_artifact(self, artifact: PreparedArtifact) -> None:
        async with self._transaction() as cur:
            await cur.execute(_ARTIFACTS["exists"], artifact_key(artifact))
            if await cur.fetchone() is None:
                await cur.execute(_ARTIFACTS["put"], artifact.params())

    @_aguarded
    async def compact_events(self, thread_id: str, policy: CompactionPolicy) -> int:
        async with self._transaction() as cur:
            await cur.execute(sql.SELECT_EVENTS[_D], (thread_id, 0))
            plan = policy.plan(rows_to_events(await cur.fetchall()))
            if plan:
                await cur.executemany(sql.COMPACT_EVENT[_D], compaction_params(plan))
        return len(plan)
