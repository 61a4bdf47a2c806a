"""LangGraph's PostgreSQL savers as a pool serves them: typed failures, lost calls retried.

Over a pool (:func:`~taskpilots_graph.checkpointers._pg_connect.open_pool`) each call has a
connection of its own, so neither saver serialises its callers on a per-instance lock, and a
put writes the checkpoint's message rows in its own transaction
(:class:`~taskpilots_graph.checkpointers._ride_rows.Ride`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
    nullcontext,
)
from functools import partial
from typing import Any

import psycopg
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from taskpilots_graph._twins import IO, Steps, arun_steps, run_steps
from taskpilots_graph.checkpointers._pg_connect import connection_lost, storage_error
from taskpilots_graph.checkpointers._ride_rows import Ride, pending_ride
from taskpilots_graph.errors import StorageError, StorageUnavailable

__all__ = ["PooledAsyncPostgresSaver", "PooledPostgresSaver"]


@contextmanager
def _typed_errors() -> Iterator[None]:
    """Re-raise a psycopg failure of a checkpoint call as its typed storage error."""
    try:
        yield
    except psycopg.Error as exc:
        if (typed := storage_error(exc, "checkpoint")) is None:
            raise
        raise typed from exc


def _retryable(exc: StorageError) -> bool:
    """A checkpoint call that lost its connection mid-way (not one that waited it out)."""
    cause = exc.__cause__
    return (
        isinstance(exc, StorageUnavailable)
        and connection_lost(cause)  # type: ignore[arg-type]
        and not isinstance(cause, PoolTimeout)
    )


def _retried(call: Callable[[], Any]) -> Steps[Any]:
    """``call()`` (awaited when async), made again once if it lost its connection mid-way
    (:func:`_retryable`)."""
    try:
        return (yield IO(call, call))
    except StorageError as exc:
        if not _retryable(exc):
            raise
    return (yield IO(call, call))


class _NoLock:
    """Stands in for ``PostgresSaver``'s per-instance lock where there is nothing to guard.

    LangGraph's sync saver takes one ``threading.Lock`` around every call, so that a single
    shared ``Connection`` is never used by two threads at once. Over a pool each call checks
    out a connection of its own, and the lock would only serialise a worker's threads
    (``--concurrency > 1``) on one saver.
    """

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc_info: object) -> None:
        return None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        return None


class PooledPostgresSaver(PostgresSaver):
    """``PostgresSaver`` whose failures are typed, and whose lost calls are retried once.

    Its reads and its writes (upserts keyed by the checkpoint id: idempotent) are retried
    once when the connection was lost mid-call, e.g. by a server restart; the pool's check
    on checkout hands the retry a live connection. Over a pool, calls from several threads
    run at once, each on its own connection (see :class:`_NoLock`).
    """

    def __init__(self, conn: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(conn, *args, **kwargs)
        if isinstance(conn, ConnectionPool):
            self.lock = _NoLock()  # type: ignore[assignment]  # same protocol as Lock

    @property
    def rides_messages(self) -> bool:
        """Whether ``put`` writes the checkpoint's message rows in its own transaction
        (:class:`~taskpilots_graph.checkpointers._ride_rows.Ride`): over a pool, where each
        put has a connection of its own."""
        return isinstance(self.conn, ConnectionPool) and self.pipe is None

    @property
    def rides_commits(self) -> bool:
        """Whether ``put_writes`` takes held ledger commits into its transaction (through
        :meth:`_cursor`, as ``put`` takes message rows)."""
        return self.rides_messages

    @contextmanager
    def _cursor(self, *, pipeline: bool = False) -> Iterator[Any]:
        ride = pending_ride() if pipeline and self.rides_messages else None
        with _typed_errors():
            if ride is None or ride.write is None:
                with super()._cursor(pipeline=pipeline) as cur:
                    yield cur
            else:
                with self._riding_cursor(ride) as cur:
                    yield cur

    @contextmanager
    def _riding_cursor(self, ride: Ride) -> Iterator[Any]:
        # Upstream's pipelined put is one implicit transaction (its statements up to the
        # pipeline's sync); the explicit one takes the message rows in with them, and keeps
        # the put atomic where pipelines are not supported.
        assert isinstance(self.conn, ConnectionPool)
        assert ride.write is not None
        with self.conn.connection() as conn:
            pipe: AbstractContextManager[Any] = (
                conn.pipeline() if self.supports_pipeline else nullcontext()
            )
            with pipe, conn.transaction(), conn.cursor(binary=True, row_factory=dict_row) as cur:
                ride.write(cur)
                yield cur
        ride.written = True

    def get_tuple(self, config: Any) -> Any:
        return run_steps(_retried(partial(super().get_tuple, config)))

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        return run_steps(_retried(partial(super().put, config, checkpoint, metadata, new_versions)))

    def put_writes(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> None:
        run_steps(_retried(partial(super().put_writes, config, writes, task_id, task_path)))


class PooledAsyncPostgresSaver(AsyncPostgresSaver):
    """``AsyncPostgresSaver`` without its per-instance lock when it draws from a pool.

    Upstream enters one ``asyncio.Lock`` around every call, which serialises all the
    concurrent runs of a process on one saver (LangGraph issue #7259) although the pool
    hands each call a connection of its own. The lock only guards a single shared connection
    or pipeline; for those, upstream's path is kept. Failures are typed and lost calls retried
    once, as in :class:`PooledPostgresSaver`.
    """

    @property
    def rides_messages(self) -> bool:
        """As :attr:`PooledPostgresSaver.rides_messages`."""
        return isinstance(self.conn, AsyncConnectionPool) and self.pipe is None

    @asynccontextmanager
    async def _cursor(self, *, pipeline: bool = False) -> AsyncIterator[Any]:
        with _typed_errors():
            if not isinstance(self.conn, AsyncConnectionPool) or self.pipe:
                async with super()._cursor(pipeline=pipeline) as cur:
                    yield cur
                return
            ride = pending_ride() if pipeline else None
            if ride is not None and ride.awrite is not None:
                async with self._riding_cursor(self.conn, ride) as cur:
                    yield cur
                return
            async with self.conn.connection() as conn:
                unit: AbstractAsyncContextManager[Any] = nullcontext()
                if pipeline:
                    # Without pipeline support, the statements of one call still form one unit.
                    unit = conn.pipeline() if self.supports_pipeline else conn.transaction()
                async with unit, conn.cursor(binary=True, row_factory=dict_row) as cur:
                    yield cur

    @asynccontextmanager
    async def _riding_cursor(
        self, pool: AsyncConnectionPool[Any], ride: Ride
    ) -> AsyncIterator[Any]:
        # As PooledPostgresSaver._riding_cursor: the put and its message rows commit once.
        assert ride.awrite is not None
        async with pool.connection() as conn:
            pipe: AbstractAsyncContextManager[Any] = (
                conn.pipeline() if self.supports_pipeline else nullcontext()
            )
            async with (
                pipe,
                conn.transaction(),
                conn.cursor(binary=True, row_factory=dict_row) as cur,
            ):
                await ride.awrite(cur)
                yield cur
        ride.written = True

    async def aget_tuple(self, config: Any) -> Any:
        return await arun_steps(_retried(partial(super().aget_tuple, config)))

    async def aput(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        return await arun_steps(
            _retried(partial(super().aput, config, checkpoint, metadata, new_versions))
        )

    async def aput_writes(
        self, config: Any, writes: Any, task_id: str, task_path: str = ""
    ) -> None:
        await arun_steps(_retried(partial(super().aput_writes, config, writes, task_id, task_path)))
