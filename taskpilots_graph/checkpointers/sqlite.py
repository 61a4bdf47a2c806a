"""Recovery store in the same SQLite file as LangGraph's ``SqliteSaver`` / ``AsyncSqliteSaver``.

The store borrows the saver's connection and lock instead of opening its own: SQLite allows one
writer per file, and a second connection in the same process would only wait on the first.
Tables are created lazily on first use, as ``SqliteSaver`` does, and migrated inside
``BEGIN IMMEDIATE`` so that two processes opening one file at once apply each migration once.

The savers opened by ``from_conn_string`` (:class:`RidingSqliteSaver`,
:class:`RidingAsyncSqliteSaver`) write a checkpoint's message rows in the checkpoint's own
transaction (:class:`~taskpilots_graph.checkpointers.messages.Ride`): one commit, one fsync.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, closing, contextmanager
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    get_checkpoint_metadata,
)
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from taskpilots_graph.checkpointers import _schema as sql
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
    SQLITE_BUSY_TIMEOUT_S,
    DecisionRecord,
    HeldCommit,
    PendingRecord,
    enable_wal,
    rows_to_events,
    sqlite_error,
    sqlite_path,
)
from taskpilots_graph.checkpointers.messages import MessageRows, pending_ride
from taskpilots_graph.compaction import CompactionPolicy
from taskpilots_graph.errors import ConfigurationError, LedgerConflict, StorageUnavailable
from taskpilots_graph.events import Event, EventRecord
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus

__all__ = [
    "AsyncSqliteStore",
    "RidingAsyncSqliteSaver",
    "RidingSqliteSaver",
    "SqliteStore",
    "mapped_errors",
    "open_sqlite",
]

_D: Final = "sqlite"


@contextmanager
def mapped_errors(operation: str) -> Iterator[None]:
    """Re-raise a sqlite3 storage error as its typed twin (``StorageBusy``, ...).

    Codes that are no storage condition (constraints, programming errors) pass unchanged.
    """
    try:
        yield
    except sqlite3.Error as exc:
        typed = sqlite_error(exc, operation)
        if typed is None:
            raise
        raise typed from exc


def open_sqlite(address: str) -> tuple[str, bool]:
    """Check a SQLite path and prepare its file; the ``(database, uri)`` to connect with.

    Creates the parent folder, switches the file to WAL (see :func:`enable_wal`) and
    answers a file this process may not write with a read-only URI: reads work, writes
    raise :class:`~taskpilots_graph.errors.StorageReadOnly`.

    Raises:
        ConfigurationError: A directory as path, a parent path that is a file, or a file
            that is not a SQLite database.
        StorageUnavailable: The file cannot be opened or created (permissions, I/O).
    """
    if address == ":memory:" or address.startswith("file:"):
        return address, False
    path = Path(address)
    if path.is_dir():
        raise ConfigurationError(f"SQLite path {address!r} is a directory; name a file in it")
    try:
        sqlite_path(address)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ConfigurationError(
            f"SQLite path {address!r} cannot be created: a parent of it is a file"
        ) from exc
    except OSError as exc:
        raise StorageUnavailable(
            f"cannot create the folder of {address!r}: {exc.strerror or exc}",
            backend=_D,
            operation="open",
        ) from exc
    read_only = path.exists() and not os.access(path, os.W_OK)
    if not read_only:
        try:
            with closing(sqlite3.connect(address, timeout=SQLITE_BUSY_TIMEOUT_S)) as probe:
                enable_wal(probe.execute)
        except sqlite3.Error as exc:
            code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
            if code == sqlite3.SQLITE_NOTADB:
                raise ConfigurationError(
                    f"{address!r} is not a SQLite database; point at a taskpilots database "
                    "or at a path where a new one may be created"
                ) from exc
            if code != sqlite3.SQLITE_READONLY:  # a read-only mount: open for reading
                with mapped_errors("open"):
                    raise
            read_only = True
    if read_only:
        return f"file:{quote(str(path.resolve()))}?mode=ro", True
    return address, False


def _statements(script: str) -> list[str]:
    # Migrations hold plain DDL (no triggers, no string literals with ';'), so a split is
    # exact; executescript() is avoided because it commits the surrounding transaction.
    return [s.strip() for s in script.split(";") if s.strip()]


_HAS_MIGRATIONS: Final = (
    f"SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '{sql.MIGRATIONS_TABLE}'"
)


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


_LEDGER = sql.LEDGER[_D]
_ARTIFACTS = sql.ARTIFACTS[_D]
_MESSAGES = sql.MESSAGES[_D]


_JOURNAL_MODE: Final = "PRAGMA journal_mode"
_SYNCHRONOUS: Final = "PRAGMA synchronous"


def _no_fsync(conn: sqlite3.Connection) -> int | None:
    """Let the next commit skip its fsync where that is safe; the level to restore after.

    Message rows are committed just before the checkpoint that refers to them, and that
    checkpoint's commit syncs. In WAL mode the log is one append-only file, so its sync
    makes every earlier commit durable too: a crash can lose the rows only together with
    the checkpoint, never leave one pointing at missing rows. Outside WAL mode (or inside
    an open transaction, where the level cannot change) nothing changes (``None``).
    """
    if conn.in_transaction or conn.execute(_JOURNAL_MODE).fetchone()[0] != "wal":
        return None
    level = int(conn.execute(_SYNCHRONOUS).fetchone()[0])
    conn.execute(f"{_SYNCHRONOUS} = NORMAL")
    return level


def _message_writes(rows: MessageRows) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """The inserts of :meth:`SqliteStore.messages_write`, in order, with their rows."""
    t = rows.thread_id
    return [
        (
            _MESSAGES["message"],
            [(t, m.key, m.message_id, m.type, m.payload) for m in rows.messages],
        ),
        (
            _MESSAGES["sequence"],
            [
                (t, s.seq, s.checkpoint_ns, s.channel, s.parent_seq, s.parent_len)
                for s in rows.sequences
            ],
        ),
        (_MESSAGES["ref"], [(t, seq, position, key) for seq, position, key in rows.refs]),
    ]


def _append_all(cur: sqlite3.Cursor, records: Sequence[PendingRecord]) -> list[Event]:
    stored = []
    for record in records:
        if isinstance(record, DecisionRecord):
            cur.execute(_LEDGER["decision_put"], record.params())
        else:
            seq = cur.execute(sql.APPEND_EVENT[_D], _append_params(record)).fetchone()[0]
            stored.append(record.to_event(seq))
    return stored


async def _aappend_all(conn: Any, records: Sequence[PendingRecord]) -> list[Event]:
    stored = []
    for record in records:
        if isinstance(record, DecisionRecord):
            await conn.execute(_LEDGER["decision_put"], record.params())
            continue
        async with conn.execute(sql.APPEND_EVENT[_D], _append_params(record)) as cur:
            (seq,) = await cur.fetchone()
        stored.append(record.to_event(seq))
    return stored


class SqliteStore(SqlQueries):
    """Synchronous recovery store sharing a ``SqliteSaver``'s connection and lock."""

    _dialect = _D

    def __init__(self, conn: sqlite3.Connection, lock: threading.Lock) -> None:
        self.conn = conn
        self.lock = lock
        self.is_setup = False

    @contextmanager
    def _cursor(self, operation: str, *, fsync: bool = True) -> Iterator[sqlite3.Cursor]:
        with self.lock, mapped_errors(operation):
            if not self.is_setup:
                self._migrate()
            level = None if fsync else _no_fsync(self.conn)
            cur = self.conn.cursor()
            try:
                yield cur
                self.conn.commit()
            except BaseException:
                self.conn.rollback()
                raise
            finally:
                cur.close()
                if level is not None:
                    self.conn.execute(f"{_SYNCHRONOUS} = {level}")

    def _migrate(self) -> None:
        conn = self.conn
        if conn.execute(_HAS_MIGRATIONS).fetchone() is not None and _up_to_date(
            conn.execute(sql.SELECT_VERSION).fetchone()[0]
        ):
            self.is_setup = True  # no write: a read-only file opens for inspection
            return
        conn.execute(sql.CREATE_MIGRATIONS_TABLE[_D])
        conn.commit()
        conn.execute("BEGIN IMMEDIATE")
        try:
            for version, script in pending_migrations(
                _D, conn.execute(sql.SELECT_VERSION).fetchone()[0]
            ):
                for statement in _statements(script):
                    conn.execute(statement)
                conn.execute(sql.INSERT_VERSION[_D], (version,))
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        self.is_setup = True

    def _run(self, operation: str, params: Any, fetch: Fetch, **options: Any) -> Any:
        statement = options.get("statement") or STATEMENTS[_D][operation]
        with self._cursor(operation) as cur:
            return fetched(cur.execute(statement, params), fetch)

    def setup(self, inner_setup: Callable[[], None] | None = None) -> None:
        """Run ``inner_setup`` under the shared lock, then migrate the store's tables."""
        if inner_setup is not None:
            with self.lock:
                inner_setup()
        with self._cursor("setup"):
            pass

    def append_events(self, records: Sequence[PendingRecord]) -> list[Event]:
        with self._cursor("append_events") as cur:
            return _append_all(cur, records)

    def delete_thread(self, thread_id: str) -> None:
        with self._cursor("delete_thread") as cur:
            for statement in sql.DELETE_THREAD[_D]:
                cur.execute(statement, (thread_id,))

    def messages_write(self, rows: MessageRows) -> None:
        """Insert a checkpoint's new messages, sequences and references in one transaction.

        Inside a ride (:func:`~taskpilots_graph.checkpointers.messages.riding`) the rows are
        handed to the saver's ``put`` and committed with the checkpoint. Otherwise in a
        transaction of their own, committed before the saver writes the checkpoint: a crash
        in between leaves unreferenced rows, never a checkpoint that refers to missing ones.
        """
        if (ride := pending_ride(self)) is not None:
            ride.take(rows, write=lambda cur: self._insert_messages(cur, rows))
            return
        with self._cursor("messages_write", fsync=False) as cur:
            for statement, params in _message_writes(rows):
                if params:
                    cur.executemany(statement, params)

    def _insert_messages(self, cur: sqlite3.Cursor, rows: MessageRows) -> None:
        # Runs under the saver's lock, which is this store's lock too.
        if not self.is_setup:
            self._migrate()
        for statement, params in _message_writes(rows):
            if params:
                cur.executemany(statement, params)

    def prune_checkpoints(self, thread_id: str, keep: Sequence[str]) -> int:
        first, *rest = sql.PRUNE_CHECKPOINTS[_D]
        with self._cursor("prune_checkpoints") as cur:
            removed = cur.execute(first, (thread_id, json.dumps(list(keep)))).rowcount
            for statement in rest:
                cur.execute(statement, (thread_id,))
        return int(removed)

    def ledger_write(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[PendingRecord] = (),
    ) -> list[Event]:
        statement, params = ledger_write_sql(_D, entry, expect)
        with self._cursor("ledger_write") as cur:
            if cur.execute(statement, params).rowcount != 1:
                raise LedgerConflict(entry.key)
            return _append_all(cur, events)

    def ledger_ride(self, held: Sequence[HeldCommit]) -> Callable[[sqlite3.Cursor], None]:
        """The insert of held commits on the saver's cursor (its put_writes transaction).

        A commit that finds its intent moved raises ``LedgerConflict``: the saver rolls
        back the task's writes with it.
        """

        def write(cur: sqlite3.Cursor) -> None:
            # Runs under the saver's lock, which is this store's lock too.
            if not self.is_setup:
                self._migrate()
            for commit in held:
                statement, params = ledger_write_sql(_D, commit.entry, commit.expect)
                if cur.execute(statement, params).rowcount != 1:
                    raise LedgerConflict(commit.entry.key, performed=True)
                _append_all(cur, commit.events)

        return write

    def put_artifact(self, artifact: PreparedArtifact) -> None:
        with self._cursor("put_artifact") as cur:
            if cur.execute(_ARTIFACTS["exists"], artifact_key(artifact)).fetchone() is None:
                cur.execute(_ARTIFACTS["put"], artifact.params())

    def compact_events(self, thread_id: str, policy: CompactionPolicy) -> int:
        # Read and rewrite need not be one snapshot: appends only add newer events, and a
        # concurrent compaction computes the same reduction of the same old payloads.
        with self._cursor("compact_events") as cur:
            rows = cur.execute(sql.SELECT_EVENTS[_D], (thread_id, 0)).fetchall()
            plan = policy.plan(rows_to_events(rows))
            cur.executemany(sql.COMPACT_EVENT[_D], compaction_params(plan))
        return len(plan)


class AsyncSqliteStore(AsyncSqlQueries):
    """Asynchronous recovery store sharing an ``AsyncSqliteSaver``'s connection and lock."""

    _dialect = _D

    def __init__(self, conn: Any, lock: asyncio.Lock) -> None:
        self.conn = conn  # aiosqlite.Connection (untyped library)
        self.lock = lock
        self.is_setup = False

    async def _migrate(self) -> None:
        conn = self.conn
        async with conn.execute(_HAS_MIGRATIONS) as cur:
            known = await cur.fetchone() is not None
        if known:
            async with conn.execute(sql.SELECT_VERSION) as cur:
                (version,) = await cur.fetchone()
            if _up_to_date(version):
                self.is_setup = True  # no write: a read-only file opens for inspection
                return
        await conn.execute(sql.CREATE_MIGRATIONS_TABLE[_D])
        await conn.commit()
        await conn.execute("BEGIN IMMEDIATE")
        try:
            async with conn.execute(sql.SELECT_VERSION) as cur:
                (current,) = await cur.fetchone()
            for version, script in pending_migrations(_D, current):
                for statement in _statements(script):
                    await conn.execute(statement)
                await conn.execute(sql.INSERT_VERSION[_D], (version,))
            await conn.commit()
        except BaseException:
            await conn.rollback()
            raise
        self.is_setup = True

    async def _ready(self) -> None:
        if not self.is_setup:
            await self._migrate()

    async def setup(self, inner_setup: Callable[[], Awaitable[None]] | None = None) -> None:
        """Await ``inner_setup`` (it takes the shared lock itself), then migrate."""
        if inner_setup is not None:
            await inner_setup()
        async with self.lock:
            with mapped_errors("setup"):
                await self._ready()

    async def append_events(self, records: Sequence[PendingRecord]) -> list[Event]:
        async with self._transaction("append_events") as conn:
            return await _aappend_all(conn, records)

    async def _run(self, operation: str, params: Any, fetch: Fetch, **options: Any) -> Any:
        statement = options.get("statement") or STATEMENTS[_D][operation]
        async with (
            self._transaction(operation) as conn,
            conn.execute(statement, params) as cur,
        ):
            return await afetched(cur, fetch)

    @asynccontextmanager
    async def _transaction(self, operation: str, *, fsync: bool = True) -> AsyncIterator[Any]:
        async with self.lock:
            with mapped_errors(operation):
                await self._ready()
            level = None
            if not fsync and not self.conn.in_transaction:
                with mapped_errors(operation):
                    async with self.conn.execute(_JOURNAL_MODE) as cur:
                        wal = (await cur.fetchone())[0] == "wal"
                    if wal:
                        async with self.conn.execute(_SYNCHRONOUS) as cur:
                            level = int((await cur.fetchone())[0])
                        await self.conn.execute(f"{_SYNCHRONOUS} = NORMAL")
            try:
                yield self.conn
                with mapped_errors(operation):
                    await self.conn.commit()
            except BaseException as exc:
                await self.conn.rollback()
                typed = sqlite_error(exc, operation) if isinstance(exc, sqlite3.Error) else None
                if typed is None:
                    raise
                raise typed from exc
            finally:
                if level is not None:
                    await self.conn.execute(f"{_SYNCHRONOUS} = {level}")

    async def delete_thread(self, thread_id: str) -> None:
        async with self._transaction("delete_thread") as conn:
            for statement in sql.DELETE_THREAD[_D]:
                await conn.execute(statement, (thread_id,))

    async def messages_write(self, rows: MessageRows) -> None:
        """Async twin of :meth:`SqliteStore.messages_write`."""
        if (ride := pending_ride(self)) is not None:
            ride.take(rows, awrite=lambda conn: self._insert_messages(conn, rows))
            return
        async with self._transaction("messages_write", fsync=False) as conn:
            for statement, params in _message_writes(rows):
                if params:
                    await conn.executemany(statement, params)

    async def _insert_messages(self, conn: Any, rows: MessageRows) -> None:
        # Runs under the saver's lock, which is this store's lock too.
        await self._ready()
        for statement, params in _message_writes(rows):
            if params:
                await conn.executemany(statement, params)

    async def prune_checkpoints(self, thread_id: str, keep: Sequence[str]) -> int:
        first, *rest = sql.PRUNE_CHECKPOINTS[_D]
        async with self._transaction("prune_checkpoints") as conn:
            cur = await conn.execute(first, (thread_id, json.dumps(list(keep))))
            removed = cur.rowcount
            for statement in rest:
                await conn.execute(statement, (thread_id,))
        return int(removed)

    async def ledger_write(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[PendingRecord] = (),
    ) -> list[Event]:
        statement, params = ledger_write_sql(_D, entry, expect)
        async with self._transaction("ledger_write") as conn:
            async with conn.execute(statement, params) as cur:
                if cur.rowcount != 1:
                    raise LedgerConflict(entry.key)
            return await _aappend_all(conn, events)

    async def put_artifact(self, artifact: PreparedArtifact) -> None:
        async with self._transaction("put_artifact") as conn:
            async with conn.execute(_ARTIFACTS["exists"], artifact_key(artifact)) as cur:
                found = await cur.fetchone()
            if found is None:
                await conn.execute(_ARTIFACTS["put"], artifact.params())

    async def compact_events(self, thread_id: str, policy: CompactionPolicy) -> int:
        async with self._transaction("compact_events") as conn:
            async with conn.execute(sql.SELECT_EVENTS[_D], (thread_id, 0)) as cur:
                rows = await cur.fetchall()
            plan = policy.plan(rows_to_events(rows))
            await conn.executemany(sql.COMPACT_EVENT[_D], compaction_params(plan))
        return len(plan)


_PUT_CHECKPOINT: Final = (
    "INSERT OR REPLACE INTO checkpoints (thread_id, checkpoint_ns, checkpoint_id, "
    "parent_checkpoint_id, type, checkpoint, metadata) VALUES (?, ?, ?, ?, ?, ?, ?)"
)


class RidingSqliteSaver(SqliteSaver):
    """``SqliteSaver`` whose ``put`` commits the checkpoint's message rows with it, and
    whose ``put_writes`` commits a task's held ledger commits (``RecoveryAPI.hold_commit``).

    The rows come from the store through an open
    :class:`~taskpilots_graph.checkpointers.messages.Ride`; without one it is exactly
    ``SqliteSaver``. A failed put rolls the rows back with the checkpoint (upstream commits
    in any case, which would leave unreferenced rows: harmless, but needless).
    """

    rides_messages: Final = True
    rides_commits: Final = True
    """``put_writes`` goes through :meth:`cursor` too: held ledger commits ride it."""

    @contextmanager
    def cursor(self, transaction: bool = True) -> Iterator[sqlite3.Cursor]:
        ride = pending_ride() if transaction else None
        if ride is None or ride.write is None:
            with super().cursor(transaction) as cur:
                yield cur
            return
        with self.lock:
            self.setup()
            cur = self.conn.cursor()
            try:
                ride.write(cur)  # before the checkpoint: the store may migrate (commits)
                yield cur
                self.conn.commit()
            except BaseException:
                self.conn.rollback()
                raise
            finally:
                cur.close()
        ride.written = True


class RidingAsyncSqliteSaver(AsyncSqliteSaver):
    """``AsyncSqliteSaver`` whose ``aput`` commits the checkpoint's message rows with it.

    Upstream's ``aput`` has no hook between its lock and its commit, so with rows to write
    its statement is issued here (the same insert and metadata as upstream's).
    """

    rides_messages: Final = True

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        ride = pending_ride()
        if ride is None or ride.awrite is None:
            return await super().aput(config, checkpoint, metadata, new_versions)
        await self.setup()
        conf = config["configurable"]
        type_, serialized = self.serde.dumps_typed(checkpoint)
        serialized_metadata = json.dumps(
            get_checkpoint_metadata(config, metadata), ensure_ascii=False
        ).encode("utf-8", "ignore")
        params = (
            str(conf["thread_id"]),
            conf["checkpoint_ns"],
            checkpoint["id"],
            conf.get("checkpoint_id"),
            type_,
            serialized,
            serialized_metadata,
        )
        async with self.lock:
            try:
                await ride.awrite(self.conn)
                await self.conn.execute(_PUT_CHECKPOINT, params)
                await self.conn.commit()
            except BaseException:
                await self.conn.rollback()
                raise
        ride.written = True
        return {
            "configurable": {
                "thread_id": conf["thread_id"],
                "checkpoint_ns": conf["checkpoint_ns"],
                "checkpoint_id": checkpoint["id"],
            }
        }
