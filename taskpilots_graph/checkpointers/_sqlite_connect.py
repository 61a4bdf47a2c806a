"""The SQLite file as ``from_conn_string`` opens it, and the savers it opens on it.

:func:`open_sqlite` checks the path and switches the file to WAL; :func:`mapped_errors` types
sqlite3's failures. The savers (:class:`RidingSqliteSaver`, :class:`RidingAsyncSqliteSaver`)
write a checkpoint's message rows in the checkpoint's own transaction
(:class:`~taskpilots_graph.checkpointers.messages.Ride`): one commit, one fsync.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Final
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

from taskpilots_graph.checkpointers.base import (
    SQLITE_BUSY_TIMEOUT_S,
    enable_wal,
    sqlite_error,
    sqlite_path,
)
from taskpilots_graph.checkpointers.messages import pending_ride
from taskpilots_graph.errors import ConfigurationError, StorageUnavailable

__all__ = [
    "RidingAsyncSqliteSaver",
    "RidingSqliteSaver",
    "committing",
    "mapped_errors",
    "open_sqlite",
]


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
