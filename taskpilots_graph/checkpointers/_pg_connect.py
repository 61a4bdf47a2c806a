"""Connection pools for PostgreSQL, opened with the settings LangGraph's savers require."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final

from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

__all__ = ["CONNECTION_KWARGS", "open_async_pool", "open_pool"]

# PostgresSaver.setup() needs autocommit; prepared statements break behind PgBouncer and
# are disabled as LangGraph's own from_conn_string does; the saver reads rows as dicts.
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
