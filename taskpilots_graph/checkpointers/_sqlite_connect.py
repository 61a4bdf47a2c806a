"""The SQLite file as ``from_conn_string`` opens it, and the savers it opens on it.

:func:`open_sqlite` checks the path and switches the file to WAL (:func:`enable_wal`);
:func:`sqlite_error` and :func:`mapped_errors` type sqlite3's failures. The savers
(:class:`RidingSqliteSaver`, :class:`RidingAsyncSqliteSaver`) write a checkpoint's message
rows in the checkpoint's own transaction (:class:`~taskpilots_graph.checkpointers._ride_rows.Ride`):
one commit, one fsync.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import aiosqlite
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    get_checkpoint_metadata,
)
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from taskpilots_graph.checkpointers._ride_rows import pending_ride
from taskpilots_graph.errors import (
    ConfigurationError,
    StorageBusy,
    StorageError,
    StorageReadOnly,
    StorageUnavailable,
)

__all__ = [
    "SQLITE_BUSY_TIMEOUT_S",
    "RidingAsyncSqliteSaver",
    "RidingSqliteSaver",
    "aconnect_sqlite",
    "committing",
    "connect_sqlite",
    "enable_wal",
    "mapped_errors",
    "open_sqlite",
    "sqlite_error",
    "sqlite_path",
]

SQLITE_BUSY_TIMEOUT_S = 30.0
"""How long a SQLite writer waits for another process's write before failing."""


def enable_wal(execute: Callable[[str], Any]) -> None:
    """Switch a SQLite file to WAL once, retrying while another process holds it.

    LangGraph's SqliteSaver switches the journal mode inside its lazy ``setup()``; on a fresh
    file opened by two processes at once that switch fails with SQLITE_BUSY at once (the busy
    timeout does not cover it). Done here first, with retries, the saver's own switch is a
    no-op.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    while True:
        try:
            execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = getattr(exc, "sqlite_errorcode", None) in (
                sqlite3.SQLITE_BUSY,
                sqlite3.SQLITE_LOCKED,
            )
            if not busy or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def sqlite_error(exc: sqlite3.Error, operation: str) -> StorageError | None:
    """The typed error for a sqlite3 error, read from its result code (never its text).

    ``None`` for codes that are not storage conditions (a constraint, a programming error):
    those keep their own type.
    """
    code = getattr(exc, "sqlite_errorcode", None)
    if not isinstance(code, int):
        return None
    primary = code & 0xFF  # extended codes (SQLITE_BUSY_SNAPSHOT, ...) keep the primary
    reason = f"{exc} ({getattr(exc, 'sqlite_errorname', code)})"
    where = {"backend": "sqlite", "operation": operation}
    if primary in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return StorageBusy(
            f"{reason}: another connection held the file past the busy timeout; nothing "
            "of this operation was written, retry later",
            **where,
        )
    if primary == sqlite3.SQLITE_READONLY:
        return StorageReadOnly(f"{reason}: the file is open read-only (inspection only)", **where)
    if primary in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return StorageUnavailable(
            f"{reason}: the file is not a SQLite database, or it is damaged", **where
        )
    if primary in (
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_PERM,
        sqlite3.SQLITE_AUTH,
    ):
        return StorageUnavailable(reason, **where)
    return None


def sqlite_path(address: str) -> str:
    """Create the parent folder of a SQLite file, so ``.taskpilots/runs.db`` just works."""
    if address != ":memory:" and not address.startswith("file:"):
        Path(address).parent.mkdir(parents=True, exist_ok=True)
    return address


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
            backend="sqlite",
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


def connect_sqlite(address: str) -> sqlite3.Connection:
    """The connection the saver and the store share, on a file prepared by :func:`open_sqlite`
    (a file this process may not write opens read-only)."""
    database, uri = open_sqlite(address)
    with mapped_errors("open"):
        return sqlite3.connect(
            database, uri=uri, check_same_thread=False, timeout=SQLITE_BUSY_TIMEOUT_S
        )


async def aconnect_sqlite(address: str) -> aiosqlite.Connection:
    """Async twin of :func:`connect_sqlite` (the file is prepared on a short-lived sync
    connection)."""
    database, uri = open_sqlite(address)
    with mapped_errors("open"):
        return await aiosqlite.connect(database, uri=uri, timeout=SQLITE_BUSY_TIMEOUT_S)


@contextmanager
def committing(conn: sqlite3.Connection) -> Iterator[sqlite3.Cursor]:
    """A cursor on ``conn`` whose block commits, or rolls back on any failure; closed after."""
    cur = conn.cursor()
    try:
        yield cur
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    finally:
        cur.close()


_PUT_CHECKPOINT: Final = (
    "INSERT OR REPLACE INTO checkpoints (thread_id, checkpoint_ns, checkpoint_id, "
    "parent_checkpoint_id, type, checkpoint, metadata) VALUES (?, ?, ?, ?, ?, ?, ?)"
)


class RidingSqliteSaver(SqliteSaver):
    """``SqliteSaver`` whose ``put`` commits the checkpoint's message rows with it, and
    whose ``put_writes`` commits a task's held ledger commits (``RecoveryAPI.hold_commit``).

    The rows come from the store through an open
    :class:`~taskpilots_graph.checkpointers._ride_rows.Ride`; without one it is exactly
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
            with committing(self.conn) as cur:
                ride.write(cur)  # before the checkpoint: the store may migrate (commits)
                yield cur
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
