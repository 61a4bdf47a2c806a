"""Connection pools for PostgreSQL, opened with the settings LangGraph's savers require."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final

from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

__all__ = ["CONNECTION_KWARGS", "PooledAsyncPostgresSaver", "open_async_pool", "open_pool"]

# The settings of LangGraph's own PostgresSaver.from_conn_string: setup() needs autocommit,
# the saver reads rows as dicts, and prepare_threshold=0 prepares every statement on first
# use (behind PgBouncer in transaction mode, pass a pool opened with prepare_threshold=None).
CONNECTION_KWARGS: Final[dict[str, Any]] = {
    "autocommit": True,
    "prepare_threshold": 0,
    "row_factory": dict_row,
}


@contextmanager
def open_pool(url: str, max_size: int) -> Iterator[ConnectionPool[Any]]:
    """A sync pool shared by the saver and the recovery store; closed on exit."""
    with ConnectionPool(
        url, min_size=1, max_size=max_size, kwargs=dict(CONNECTION_KWARGS), open=False
    ) as pool:
        pool.wait()
        yield pool


@asynccontextmanager
async def open_async_pool(url: str, max_size: int) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """An async pool shared by the saver and the recovery store; closed on exit."""
    async with AsyncConnectionPool(
        url, min_size=1, max_size=max_size, kwargs=dict(CONNECTION_KWARGS), open=False
    ) as pool:
        await pool.wait()
        yield pool


class PooledAsyncPostgresSaver(AsyncPostgresSaver):
    """``AsyncPostgresSaver`` without its per-instance lock when it draws from a pool.

    Upstream enters one ``asyncio.Lock`` around every call, which serialises all the
    concurrent runs of a process on one saver (LangGraph issue #7259) although the pool
    hands each call a connection of its own. The lock only guards a single shared connection
    or pipeline; for those, upstream's path is kept.
    """

    @asynccontextmanager
    async def _cursor(self, *, pipeline: bool = False) -> AsyncIterator[Any]:
        if not isinstance(self.conn, AsyncConnectionPool) or self.pipe:
            async with super()._cursor(pipeline=pipeline) as cur:
                yield cur
            return
        async with self.conn.connection() as conn:
            if pipeline and self.supports_pipeline:
                async with conn.pipeline(), conn.cursor(binary=True, row_factory=dict_row) as cur:
                    yield cur
            elif pipeline:
                # Without pipeline support, the statements of one call still form one unit.
                async with (
                    conn.transaction(),
                    conn.cursor(binary=True, row_factory=dict_row) as cur,
                ):
                    yield cur
            else:
                async with conn.cursor(binary=True, row_factory=dict_row) as cur:
                    yield cur
