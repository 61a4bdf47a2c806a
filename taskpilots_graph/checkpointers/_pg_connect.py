"""Connection pools for PostgreSQL, opened with the settings LangGraph's savers require.

Also where psycopg's failures become the library's typed storage errors (by exception class
and SQLSTATE, never by message text), and where the pools heal themselves: a connection is
checked on checkout, so a server restart between two calls costs no failed call at all.
"""

from __future__ import annotations

import math
import select
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
    nullcontext,
    suppress,
)
from functools import partial
from typing import Any, Final, TypeVar

import psycopg
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from taskpilots_graph.checkpointers.messages import Ride, pending_ride
from taskpilots_graph.errors import (
    ConfigurationError,
    StorageBusy,
    StorageError,
    StorageReadOnly,
    StorageUnavailable,
)

__all__ = [
    "CONNECTION_KWARGS",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "PooledAsyncPostgresSaver",
    "PooledPostgresSaver",
    "connection_lost",
    "open_async_pool",
    "open_pool",
    "storage_error",
]

R = TypeVar("R")

# The settings of LangGraph's own PostgresSaver.from_conn_string: setup() needs autocommit,
# the saver reads rows as dicts, and prepare_threshold=0 prepares every statement on first
# use (behind PgBouncer in transaction mode, pass a pool opened with prepare_threshold=None).
CONNECTION_KWARGS: Final[dict[str, Any]] = {
    "autocommit": True,
    "prepare_threshold": 0,
    "row_factory": dict_row,
}

DEFAULT_CONNECT_TIMEOUT_S: Final = 5.0
"""Longest wait to open a PostgreSQL connection (a URL's own ``connect_timeout`` wins)."""

_BACKEND: Final = "postgres"

# SQLSTATEs meaning "the server is gone or refuses sessions": connection exceptions (class
# 08), admin/crash shutdown and "the database system is starting up" (57P01-57P03), and
# "too many connections" (53300).
_UNAVAILABLE_PREFIXES: Final = ("08", "57P01", "57P02", "57P03", "53300")
_READ_ONLY: Final = "25006"  # read_only_sql_transaction: a standby, or a read-only role
_BUSY: Final = ("55P03", "40P01")  # lock_not_available (lock_timeout), deadlock_detected


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the server or the connection went away (not a bad statement).

    An ``OperationalError`` without a SQLSTATE is raised by libpq itself: the socket closed,
    the connection attempt failed, or the pool ran out of time waiting for a connection.
    """
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith(_UNAVAILABLE_PREFIXES)


def storage_error(
    exc: BaseException, operation: str, *, ambiguous: bool = False
) -> StorageError | None:
    """The typed error for a psycopg failure of ``operation``; ``None`` when it is not one.

    Args:
        exc: What psycopg (or psycopg_pool) raised.
        operation: What the library was doing, named in the error.
        ambiguous: The connection was lost while a write may have been committing: the
            message says the outcome is unknown (the next read tells).
    """
    if isinstance(exc, PoolTimeout):
        return StorageUnavailable(
            f"no connection to the database in time ({exc})", backend=_BACKEND, operation=operation
        )
    if not isinstance(exc, psycopg.Error):
        return None
    state = exc.sqlstate or ""
    if connection_lost(exc):
        why = str(exc).strip() or type(exc).__name__
        if ambiguous:
            why += (
                "; the write may or may not have been committed, it was not retried "
                "(the next read of the ledger shows its outcome)"
            )
        return StorageUnavailable(why, backend=_BACKEND, operation=operation)
    if state == _READ_ONLY:
        return StorageReadOnly(str(exc).strip(), backend=_BACKEND, operation=operation)
    if state in _BUSY:
        return StorageBusy(str(exc).strip(), backend=_BACKEND, operation=operation)
    return None


def _readable(fd: int) -> bool:
    """Whether the server wrote to an idle connection (a shutdown notice, or end of file)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])


def _suspect(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether a pooled connection may be dead: closed, or the server spoke while it idled.

    An idle session receives nothing unless the server is going away (a restart sends
    ``57P01`` and closes the socket; a crash closes it): a zero-wait poll of the socket finds
    both without a round trip. Only a suspect connection pays for a real check.
    """
    if conn.closed:
        return True
    try:
        return _readable(conn.fileno())
    except (OSError, ValueError, psycopg.Error):
        return True


class _Check:
    """The pools' ``check=``: a connection the server dropped is replaced, not handed out.

    When one is found dead, every idle connection of the pool is checked at once: after a
    restart they all are, and psycopg_pool would otherwise find them one checkout at a time,
    waiting longer after each (1 s, 2 s, 4 s...).
    """

    def __init__(self) -> None:
        self.pool: ConnectionPool[Any] | None = None

    def __call__(self, conn: psycopg.Connection[Any]) -> None:
        if not _suspect(conn):
            return
        try:
            ConnectionPool.check_connection(conn)
        except psycopg.Error:
            if self.pool is not None:
                self.pool.check()
            raise


class _ACheck:
    """Async twin of :class:`_Check`."""

    def __init__(self) -> None:
        self.pool: AsyncConnectionPool[Any] | None = None

    async def __call__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if not _suspect(conn):
            return
        try:
            await AsyncConnectionPool.check_connection(conn)
        except psycopg.Error:
            if self.pool is not None:
                await self.pool.check()
            raise


def _connect_settings(url: str, connect_timeout: float | None) -> tuple[dict[str, Any], float]:
    """The pool's connection kwargs and the longest wait to open it.

    A ``connect_timeout`` in the URL itself is respected; otherwise ``connect_timeout`` is
    passed to libpq (which counts whole seconds, at least 2).
    """
    if connect_timeout is None:
        connect_timeout = DEFAULT_CONNECT_TIMEOUT_S
    if isinstance(connect_timeout, bool) or not (
        isinstance(connect_timeout, int | float) and 0 < connect_timeout < math.inf
    ):
        raise ConfigurationError(
            f"connect_timeout must be a positive number of seconds, not {connect_timeout!r}"
        )
    try:
        params = conninfo_to_dict(url)
    except psycopg.Error as exc:
        raise ConfigurationError(f"malformed PostgreSQL URL: {exc}") from None
    kwargs = dict(CONNECTION_KWARGS)
    own = params.get("connect_timeout")
    if own is None:
        kwargs["connect_timeout"] = max(2, math.ceil(connect_timeout))
        return kwargs, float(kwargs["connect_timeout"])
    try:
        seconds = float(own)
    except ValueError:
        raise ConfigurationError(
            f"the URL's connect_timeout must be a number of seconds, not {own!r}"
        ) from None
    # 0 (or less) is libpq's "wait forever": the pool still stops waiting after ours.
    return kwargs, max(2.0, seconds) if seconds > 0 else max(2.0, connect_timeout)


def _connect_failed(exc: psycopg.Error) -> StorageError:
    return StorageUnavailable(
        str(exc).strip() or type(exc).__name__, backend=_BACKEND, operation="connect"
    )


def _probe(url: str, kwargs: dict[str, Any]) -> None:
    """One direct connection: an unreachable server, unknown database or role, or a bad
    option fails at once with libpq's own reason (a pool would retry until it timed out)."""
    try:
        psycopg.connect(url, connect_timeout=kwargs.get("connect_timeout"), autocommit=True).close()
    except psycopg.Error as exc:
        raise _connect_failed(exc) from exc


async def _aprobe(url: str, kwargs: dict[str, Any]) -> None:
    try:
        conn = await psycopg.AsyncConnection.connect(
            url, connect_timeout=kwargs.get("connect_timeout"), autocommit=True
        )
    except psycopg.Error as exc:
        raise _connect_failed(exc) from exc
    await conn.close()


def _reconnect_again(pool: ConnectionPool[Any]) -> None:
    """``reconnect_failed=``: start a new round of attempts (see :func:`_pool_options`)."""
    if not pool.closed:
        with suppress(psycopg.Error):  # closed meanwhile
            pool.check()  # with no connection left, this grows the pool: a new attempt


async def _areconnect_again(pool: AsyncConnectionPool[Any]) -> None:
    if not pool.closed:
        with suppress(psycopg.Error):
            await pool.check()


def _pool_options(timeout: float | None, wait: float) -> dict[str, Any]:
    # psycopg_pool doubles the wait between reconnection attempts (1 s, 2 s, 4 s...) for
    # reconnect_timeout, so after a long outage its next attempt could be minutes away.
    # A short reconnect_timeout whose failure starts a new round keeps the gap between
    # attempts under a few seconds for as long as the server is down.
    options: dict[str, Any] = {"reconnect_timeout": wait}
    if timeout is not None:
        options["timeout"] = timeout
    return options


@contextmanager
def open_pool(
    url: str,
    max_size: int,
    *,
    connect_timeout: float | None = None,
    timeout: float | None = None,
) -> Iterator[ConnectionPool[Any]]:
    """A sync pool shared by the saver and the recovery store; closed on exit.

    Args:
        url: The PostgreSQL URL.
        max_size: Most connections.
        connect_timeout: Longest wait to open a connection (unless the URL sets its own);
            :data:`DEFAULT_CONNECT_TIMEOUT_S` when ``None``.
        timeout: Longest wait for a free connection per call (psycopg_pool's default when
            ``None``); a server down that long makes the call raise ``StorageUnavailable``.

    Raises:
        ConfigurationError: The URL cannot be parsed, or ``connect_timeout`` is invalid.
        StorageUnavailable: The server cannot be reached or refuses the session.
    """
    kwargs, wait = _connect_settings(url, connect_timeout)
    _probe(url, kwargs)
    check = _Check()
    with ConnectionPool(
        url,
        min_size=1,
        max_size=max_size,
        kwargs=kwargs,
        check=check,
        reconnect_failed=_reconnect_again,
        open=False,
        **_pool_options(timeout, wait),
    ) as pool:
        check.pool = pool
        try:
            pool.wait(timeout=wait)
        except PoolTimeout as exc:
            raise _connect_failed(exc) from exc
        yield pool


@asynccontextmanager
async def open_async_pool(
    url: str,
    max_size: int,
    *,
    connect_timeout: float | None = None,
    timeout: float | None = None,
) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """An async pool shared by the saver and the recovery store (see :func:`open_pool`)."""
    kwargs, wait = _connect_settings(url, connect_timeout)
    await _aprobe(url, kwargs)
    check = _ACheck()
    async with AsyncConnectionPool(
        url,
        min_size=1,
        max_size=max_size,
        kwargs=kwargs,
        check=check,
        reconnect_failed=_areconnect_again,
        open=False,
        **_pool_options(timeout, wait),
    ) as pool:
        check.pool = pool
        try:
            await pool.wait(timeout=wait)
        except PoolTimeout as exc:
            raise _connect_failed(exc) from exc
        yield pool


def _typed(exc: psycopg.Error) -> StorageError | None:
    return storage_error(exc, "checkpoint")


def _retryable(exc: StorageError) -> bool:
    """A checkpoint call that lost its connection mid-way (not one that waited it out)."""
    cause = exc.__cause__
    return (
        isinstance(exc, StorageUnavailable)
        and connection_lost(cause)  # type: ignore[arg-type]
        and not isinstance(cause, PoolTimeout)
    )


def _retried(call: Callable[[], R]) -> R:
    """``call()``, made again once if it lost its connection mid-way (:func:`_retryable`)."""
    try:
        return call()
    except StorageError as exc:
        if not _retryable(exc):
            raise
    return call()


async def _aretried(call: Callable[[], Awaitable[R]]) -> R:
    """Async twin of :func:`_retried`."""
    try:
        return await call()
    except StorageError as exc:
        if not _retryable(exc):
            raise
    return await call()


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
        (:class:`~taskpilots_graph.checkpointers.messages.Ride`): over a pool, where each
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
        try:
            if ride is None or ride.write is None:
                with super()._cursor(pipeline=pipeline) as cur:
                    yield cur
            else:
                with self._riding_cursor(ride) as cur:
                    yield cur
        except psycopg.Error as exc:
            if (typed := _typed(exc)) is None:
                raise
            raise typed from exc

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
        return _retried(partial(super().get_tuple, config))

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        return _retried(partial(super().put, config, checkpoint, metadata, new_versions))

    def put_writes(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> None:
        _retried(partial(super().put_writes, config, writes, task_id, task_path))


class PooledAsyncPostgresSaver(AsyncPostgresSaver):
    """``AsyncPostgresSaver`` without its per-instance lock when it draws from a pool.

    Upstream enters one ``asyncio.Lock`` around every call, which serialises all the
    concurrent runs of a process on one saver (LangGraph issue #7259) although the pool
    hands each call a connection of its own. The lock only guards a single shared connection
    or pipeline; for those, upstream's path is kept. Failures are typed and lost calls retried
    once, as in :class:`PooledPostgresSaver`.
    """

    @asynccontextmanager
    async def _cursor(self, *, pipeline: bool = False) -> AsyncIterator[Any]:
        try:
            async with self._raw_cursor(pipeline=pipeline) as cur:
                yield cur
        except psycopg.Error as exc:
            if (typed := _typed(exc)) is None:
                raise
            raise typed from exc

    @property
    def rides_messages(self) -> bool:
        """As :attr:`PooledPostgresSaver.rides_messages`."""
        return isinstance(self.conn, AsyncConnectionPool) and self.pipe is None

    @asynccontextmanager
    async def _raw_cursor(self, *, pipeline: bool = False) -> AsyncIterator[Any]:
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
        return await _aretried(partial(super().aget_tuple, config))

    async def aput(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        return await _aretried(partial(super().aput, config, checkpoint, metadata, new_versions))

    async def aput_writes(
        self, config: Any, writes: Any, task_id: str, task_path: str = ""
    ) -> None:
        await _aretried(partial(super().aput_writes, config, writes, task_id, task_path))
