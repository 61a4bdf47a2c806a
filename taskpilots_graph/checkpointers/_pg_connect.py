"""Connection pools for PostgreSQL, opened with the settings LangGraph's savers require.

Also where psycopg's failures become the library's typed storage errors (by exception class
and SQLSTATE, never by message text), and where the pools heal themselves: a connection is
checked on checkout, so a server restart between two calls costs no failed call at all. The
savers that draw from these pools are in :mod:`._pg_savers`.
"""

from __future__ import annotations

import math
import select
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from taskpilots_graph._twins import Steps, arun_steps, asynced, both, run_steps, synced
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
    "connection_lost",
    "open_async_pool",
    "open_pool",
    "storage_error",
]

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
    """The pools' ``check=`` (:meth:`acheck` the async pool's): a connection the server
    dropped is replaced, not handed out.

    When one is found dead, every idle connection of the pool is checked at once: after a
    restart they all are, and psycopg_pool would otherwise find them one checkout at a time,
    waiting longer after each (1 s, 2 s, 4 s...).
    """

    def __init__(self) -> None:
        self.pool: ConnectionPool[Any] | AsyncConnectionPool[Any] | None = None

    def _check(self, conn: Any) -> Steps[None]:
        if not _suspect(conn):
            return
        try:
            yield both(ConnectionPool.check_connection, AsyncConnectionPool.check_connection, conn)
        except psycopg.Error:
            if self.pool is not None:  # the pool of the same form
                yield both(self.pool.check, self.pool.check)
            raise

    __call__, acheck = synced(_check), asynced(_check)


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


@contextmanager
def _connecting(failure: type[psycopg.Error] = psycopg.Error) -> Iterator[None]:
    """Re-raise a ``failure`` to connect as ``StorageUnavailable``, with libpq's reason."""
    try:
        yield
    except failure as exc:
        why = str(exc).strip() or type(exc).__name__
        raise StorageUnavailable(why, backend=_BACKEND, operation="connect") from exc


def _probe(url: str, kwargs: dict[str, Any]) -> Steps[None]:
    """One direct connection: an unreachable server, unknown database or role, or a bad
    option fails at once with libpq's own reason (a pool would retry until it timed out)."""
    options = {"connect_timeout": kwargs.get("connect_timeout"), "autocommit": True}
    with _connecting():
        conn = yield both(psycopg.connect, psycopg.AsyncConnection.connect, url, **options)
    yield both(conn.close, conn.close)


def _reconnect_again(pool: ConnectionPool[Any]) -> None:
    """``reconnect_failed=``: start a new round of attempts (see :func:`_pool_options`)."""
    if not pool.closed:
        with suppress(psycopg.Error):  # closed meanwhile
            pool.check()  # with no connection left, this grows the pool: a new attempt


async def _areconnect_again(pool: AsyncConnectionPool[Any]) -> None:
    if not pool.closed:
        with suppress(psycopg.Error):
            await pool.check()


def _pool_options(
    max_size: int, kwargs: dict[str, Any], timeout: float | None, wait: float
) -> dict[str, Any]:
    """What both pools are given, ``check`` and ``reconnect_failed`` apart (opened later)."""
    # psycopg_pool doubles the wait between reconnection attempts (1 s, 2 s, 4 s...) for
    # reconnect_timeout, so after a long outage its next attempt could be minutes away.
    # A short reconnect_timeout whose failure starts a new round keeps the gap between
    # attempts under a few seconds for as long as the server is down.
    options: dict[str, Any] = {
        "min_size": 1,
        "max_size": max_size,
        "kwargs": kwargs,
        "open": False,
        "reconnect_timeout": wait,
    }
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
    run_steps(_probe(url, kwargs))
    check = _Check()
    options = _pool_options(max_size, kwargs, timeout, wait)
    with ConnectionPool(url, check=check, reconnect_failed=_reconnect_again, **options) as pool:
        check.pool = pool
        with _connecting(PoolTimeout):
            pool.wait(timeout=wait)
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
    await arun_steps(_probe(url, kwargs))
    check = _Check()
    options = _pool_options(max_size, kwargs, timeout, wait)
    async with AsyncConnectionPool(
        url, check=check.acheck, reconnect_failed=_areconnect_again, **options
    ) as pool:
        check.pool = pool
        with _connecting(PoolTimeout):
            await pool.wait(timeout=wait)
        yield pool
