"""Connection pools for PostgreSQL, opened with the settings LangGraph's savers require."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final

from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

__all__ = ["CONNECTION_KWARGS", "open_async_pool", "open_pool"]

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
