"""Recovery checkpointers: LangGraph's own savers plus the recovery store, in one database.

``RecoveryCheckpointer`` (sync, this module) and ``AsyncRecoveryCheckpointer`` (:mod:`.aio`)
wrap ``InMemorySaver``, ``SqliteSaver`` / ``AsyncSqliteSaver`` or ``PostgresSaver`` /
``AsyncPostgresSaver`` by composition. The graph state is stored by the LangGraph saver,
except that message lists are stored once per thread and checkpoints refer to them
(:mod:`.messages`: storage grows with the conversation, not with its square); the event log
lives in tables of its own in the same database, and so do artifacts unless an
:class:`ArtifactStore` of their own is passed (``artifacts=FileArtifactStore(path)``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any, Self

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver

from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.checkpointers._artifact_access import checked_artifact_store
from taskpilots_graph.checkpointers._conn_string import DEFAULT_POOL_SIZE, parse_conn_string
from taskpilots_graph.checkpointers._sqlite_connect import RidingSqliteSaver, connect_sqlite
from taskpilots_graph.checkpointers.artifacts import (
    ArtifactRef,
    ArtifactStore,
    FileArtifactStore,
    FsspecArtifactStore,
)
from taskpilots_graph.checkpointers.base import RecoveryStore
from taskpilots_graph.checkpointers.memory import MemoryStore
from taskpilots_graph.checkpointers.serde import compressed_serde
from taskpilots_graph.checkpointers.sqlite import SqliteStore
from taskpilots_graph.errors import ConfigurationError

__all__ = [
    "ArtifactRef",
    "ArtifactStore",
    "AsyncRecoveryCheckpointer",
    "FileArtifactStore",
    "FsspecArtifactStore",
    "RecoveryAPI",
    "RecoveryCheckpointer",
]


def _store_for(inner: BaseCheckpointSaver[Any]) -> RecoveryStore:
    if isinstance(inner, InMemorySaver):
        return MemoryStore()
    if isinstance(inner, SqliteSaver):
        return SqliteStore(inner.conn, inner.lock)
    if any(c.__module__.startswith("langgraph.checkpoint.postgres") for c in type(inner).__mro__):
        from langgraph.checkpoint.postgres import PostgresSaver

        from taskpilots_graph.checkpointers.postgres import PostgresStore

        if isinstance(inner, PostgresSaver):
            return PostgresStore(inner.conn, inner.lock)
    raise ConfigurationError(
        f"no recovery store is known for {type(inner).__name__}; wrap InMemorySaver, "
        "SqliteSaver or PostgresSaver, use AsyncRecoveryCheckpointer for async savers, "
        "or pass store=... explicitly"
    )


class RecoveryCheckpointer(RecoveryAPI):
    """Synchronous LangGraph checkpointer with a durable event log beside the checkpoints.

    A graph compiled with it behaves exactly like one compiled with the wrapped saver: every
    ``BaseCheckpointSaver`` method is forwarded. It adds :meth:`append_event` and
    :meth:`events`, :meth:`ledger` and the other recovery methods of
    :class:`~taskpilots_graph.checkpointers._api.RecoveryAPI`, and :meth:`delete_thread`
    also removes the thread's recovery data.

    Example:
        >>> import taskpilots_graph as tp
        >>> with tp.RecoveryCheckpointer.from_conn_string(":memory:") as cp:
        ...     cp.setup()
        ...     event = cp.append_event("t-1", "agent_started", {"goal": "close tickets"})
        ...     [e.kind.value for e in cp.events("t-1")]
        ['agent_started']

    Args:
        inner: The LangGraph saver that stores graph state.
        store: The recovery store; derived from ``inner`` when omitted.
        artifacts: Where artifacts go; the recovery store's database when omitted.
    """

    store: RecoveryStore

    def __init__(
        self,
        inner: BaseCheckpointSaver[Any],
        *,
        store: RecoveryStore | None = None,
        artifacts: ArtifactStore | None = None,
    ) -> None:
        super().__init__(inner)
        self.store = store if store is not None else _store_for(inner)
        self.artifact_store = checked_artifact_store(artifacts)

    @classmethod
    @contextmanager
    def from_conn_string(
        cls,
        conn_string: str,
        *,
        pool_size: int = DEFAULT_POOL_SIZE,
        artifacts: ArtifactStore | None = None,
        connect_timeout: float | None = None,
    ) -> Iterator[Self]:
        """Open a checkpointer on ``":memory:"``, a SQLite file or a PostgreSQL URL.

        Args:
            conn_string: ``":memory:"``, ``"sqlite:///path/runs.db"`` (or a plain path), or
                ``"postgresql://user@host:port/db"``.
            pool_size: Maximum connections of the PostgreSQL pool shared by the saver and
                the recovery store.
            artifacts: Where artifacts go (e.g. ``FileArtifactStore(path)``); the same
                database when omitted.
            connect_timeout: Longest wait, in seconds, to open a PostgreSQL connection
                (5 s when omitted; a ``connect_timeout`` in the URL wins). An unreachable
                server, unknown database or role raises ``StorageUnavailable`` at once.

        Yields:
            A ready checkpointer; call :meth:`setup` once per database (SQLite and memory
            also set themselves up lazily). A SQLite file this process may not write opens
            read-only: reads work, writes raise ``StorageReadOnly``.

        Raises:
            ConfigurationError: For a malformed connection string (a scheme typo never
                becomes a file), a directory or a non-SQLite file as SQLite path, or a
                parent path that is a file.
            StorageUnavailable: PostgreSQL cannot be reached or refuses the session.
        """
        target = parse_conn_string(conn_string)
        if target.backend == "memory":
            yield cls(InMemorySaver(), artifacts=artifacts)
        elif target.backend == "sqlite":
            with closing(connect_sqlite(target.address)) as conn:
                yield cls(RidingSqliteSaver(conn, serde=compressed_serde()), artifacts=artifacts)
        else:
            from taskpilots_graph.checkpointers._pg_connect import open_pool
            from taskpilots_graph.checkpointers._pg_savers import PooledPostgresSaver

            with open_pool(target.address, pool_size, connect_timeout=connect_timeout) as pool:
                saver = PooledPostgresSaver(pool, serde=compressed_serde())
                yield cls(saver, artifacts=artifacts)

    def setup(self) -> None:
        """Create the saver's and the recovery store's tables (idempotent, concurrency-safe)."""
        inner_setup: Callable[[], None] | None = getattr(self.inner, "setup", None)
        if isinstance(self.inner, SqliteSaver):
            with self.inner.cursor():  # runs SqliteSaver.setup() under its lock
                inner_setup = None
        self.store.setup(inner_setup)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.store, method)(*args, **kwargs)

    async def _acall(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # The sync stores block on I/O: keep them off the event loop.
        return await asyncio.to_thread(getattr(self.store, method), *args, **kwargs)


from taskpilots_graph.checkpointers.aio import AsyncRecoveryCheckpointer  # noqa: E402
