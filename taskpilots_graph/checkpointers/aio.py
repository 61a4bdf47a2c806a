"""``AsyncRecoveryCheckpointer``: the async twin of :class:`RecoveryCheckpointer`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, Self, TypeVar

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.checkpointers._artifact_access import checked_artifact_store
from taskpilots_graph.checkpointers._conn_string import DEFAULT_POOL_SIZE, parse_conn_string
from taskpilots_graph.checkpointers._sqlite_connect import RidingAsyncSqliteSaver, aconnect_sqlite
from taskpilots_graph.checkpointers.artifacts import ArtifactStore
from taskpilots_graph.checkpointers.base import AsyncRecoveryStore
from taskpilots_graph.checkpointers.memory import AsyncMemoryStore
from taskpilots_graph.checkpointers.serde import compressed_serde
from taskpilots_graph.checkpointers.sqlite import AsyncSqliteStore
from taskpilots_graph.errors import ConfigurationError

__all__ = ["AsyncRecoveryCheckpointer"]

T = TypeVar("T")


def _async_store_for(inner: BaseCheckpointSaver[Any]) -> AsyncRecoveryStore:
    if isinstance(inner, InMemorySaver):
        return AsyncMemoryStore()
    if isinstance(inner, AsyncSqliteSaver):
        return AsyncSqliteStore(inner.conn, inner.lock)
    try:  # the postgres extra may not be installed
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    except ImportError:
        AsyncPostgresSaver = None  # type: ignore[assignment,misc]
    if AsyncPostgresSaver is not None and isinstance(inner, AsyncPostgresSaver):
        from taskpilots_graph.checkpointers.postgres import AsyncPostgresStore

        return AsyncPostgresStore(inner.conn, inner.lock)
    raise ConfigurationError(
        f"no async recovery store is known for {type(inner).__name__}; wrap InMemorySaver, "
        "AsyncSqliteSaver or AsyncPostgresSaver, use RecoveryCheckpointer for sync savers, "
        "or pass store=... explicitly"
    )


class AsyncRecoveryCheckpointer(RecoveryAPI):
    """Asynchronous LangGraph checkpointer with a durable event log beside the checkpoints.

    Create it inside a running event loop. Its sync methods (used by ``graph.invoke``) are
    forwarded to the inner saver, which runs them on that loop, and must therefore be called
    from another thread, exactly as with LangGraph's ``AsyncSqliteSaver``.

    Example:
        >>> import asyncio, taskpilots_graph as tp
        >>> async def main() -> list[str]:
        ...     async with tp.AsyncRecoveryCheckpointer.from_conn_string(":memory:") as cp:
        ...         await cp.setup()
        ...         await cp.aappend_event("t-1", "agent_started", {"goal": "triage"})
        ...         return [e.kind.value for e in await cp.aevents("t-1")]
        >>> asyncio.run(main())
        ['agent_started']

    Args:
        inner: The LangGraph async saver that stores graph state.
        store: The async recovery store; derived from ``inner`` when omitted.
        artifacts: Where artifacts go; the recovery store's database when omitted.
    """

    store: AsyncRecoveryStore
    loop: asyncio.AbstractEventLoop

    def __init__(
        self,
        inner: BaseCheckpointSaver[Any],
        *,
        store: AsyncRecoveryStore | None = None,
        artifacts: ArtifactStore | None = None,
    ) -> None:
        super().__init__(inner)
        self.store = store if store is not None else _async_store_for(inner)
        self.artifact_store = checked_artifact_store(artifacts)
        self.loop = asyncio.get_running_loop()

    @classmethod
    @asynccontextmanager
    async def from_conn_string(
        cls,
        conn_string: str,
        *,
        pool_size: int = DEFAULT_POOL_SIZE,
        artifacts: ArtifactStore | None = None,
        connect_timeout: float | None = None,
    ) -> AsyncIterator[Self]:
        """Async form of :meth:`RecoveryCheckpointer.from_conn_string
        <taskpilots_graph.checkpointers.RecoveryCheckpointer.from_conn_string>`: the same
        arguments, errors and read-only SQLite handling; await :meth:`setup` once per database.
        """
        target = parse_conn_string(conn_string)
        if target.backend == "memory":
            yield cls(InMemorySaver(), artifacts=artifacts)
        elif target.backend == "sqlite":
            conn = await aconnect_sqlite(target.address)
            try:
                sqlite_saver = RidingAsyncSqliteSaver(conn, serde=compressed_serde())
                yield cls(sqlite_saver, artifacts=artifacts)
            finally:
                await conn.close()
        else:
            from taskpilots_graph.checkpointers._pg_connect import open_async_pool
            from taskpilots_graph.checkpointers._pg_savers import PooledAsyncPostgresSaver

            async with open_async_pool(
                target.address, pool_size, connect_timeout=connect_timeout
            ) as pool:
                saver = PooledAsyncPostgresSaver(pool, serde=compressed_serde())
                yield cls(saver, artifacts=artifacts)

    async def setup(self) -> None:
        """Create the saver's and the recovery store's tables (idempotent, concurrency-safe)."""
        inner_setup: Callable[[], Awaitable[None]] | None = getattr(self.inner, "setup", None)
        await self.store.setup(inner_setup)

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the checkpointer's loop from a worker thread."""
        try:
            if asyncio.get_running_loop() is self.loop:
                coro.close()
                raise asyncio.InvalidStateError(
                    "synchronous calls to AsyncRecoveryCheckpointer are only allowed from a "
                    "different thread; from the event loop use the a-prefixed method"
                )
        except RuntimeError:
            pass  # no loop in this thread: the normal case for sync callers
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._sync(getattr(self.store, method)(*args, **kwargs))

    async def _acall(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.store, method)(*args, **kwargs)
