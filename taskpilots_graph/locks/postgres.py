"""Leases as rows of ``taskpilots_leases`` in PostgreSQL, next to the ledger they protect.

Each operation is one autocommit statement, so it costs one round trip and holds no row lock
beyond it. Expiry is judged by the database's clock (``now()``), never a worker's: the
workers' clocks may disagree, the database is one. Fencing tokens come from the sequence
``taskpilots_lease_fencing``: strictly increasing across all names and never reused, even
after a row is deleted on release (a per-row ``fencing + 1`` would restart at 1 there).

A lease row must survive a database crash (else two workers could hold it and the sequence
could repeat a token), so the writing statements switch ``synchronous_commit`` on for their
own transaction with ``set_config(..., true)`` inside the statement: ``SET LOCAL`` would
need an explicit transaction and three more round trips.

The tables come from the recovery store's migrations: ``setup()`` here, or the
checkpointer's ``setup()`` on the same database, creates them.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import psycopg
from psycopg import errors
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from taskpilots_graph._twins import Steps, asynced, io, synced
from taskpilots_graph.checkpointers._pg_connect import CONNECTION_KWARGS
from taskpilots_graph.checkpointers.postgres import AsyncPostgresStore, PostgresStore
from taskpilots_graph.errors import ConfigurationError, LeaseLost, StorageError
from taskpilots_graph.errors import LockBackendUnavailable as Unavailable
from taskpilots_graph.leases import Lease, LeaseBackendBase, check_lease_args

__all__ = ["ACQUIRE_SQL", "HOLDER_SQL", "RELEASE_SQL", "RENEW_SQL", "PostgresLeaseBackend"]

_DURABLE: Final = "(SELECT set_config('synchronous_commit', 'on', true) AS sc) AS durable"

# Takes the row only if it is free or expired (or already ours: a retried acquire whose
# reply was lost keeps its token). Concurrent attempts serialise on the row: the loser
# re-checks the WHERE against the winner's committed row and returns nothing. The
# ``WHERE durable.sc`` both forces set_config to run and ends the SELECT before ON CONFLICT.
ACQUIRE_SQL: Final = f"""
INSERT INTO taskpilots_leases AS l (name, owner, fencing, expires_at)
SELECT %(name)s, %(owner)s, nextval('taskpilots_lease_fencing'),
       now() + make_interval(secs => %(ttl)s)
FROM {_DURABLE} WHERE durable.sc = 'on'
ON CONFLICT (name) DO UPDATE SET
    owner = excluded.owner,
    fencing = CASE WHEN l.owner = excluded.owner AND l.expires_at > now()
                   THEN l.fencing ELSE excluded.fencing END,
    expires_at = excluded.expires_at
WHERE l.expires_at <= now() OR l.owner = excluded.owner
RETURNING l.fencing, extract(epoch FROM l.expires_at)::float8
"""

RENEW_SQL: Final = f"""
UPDATE taskpilots_leases AS l SET expires_at = now() + make_interval(secs => %(ttl)s)
FROM {_DURABLE}
WHERE durable.sc = 'on' AND l.name = %(name)s AND l.owner = %(owner)s
  AND l.fencing = %(fencing)s AND l.expires_at > now()
RETURNING extract(epoch FROM l.expires_at)::float8
"""

# No durability switch: a release lost in a crash only leaves the lease to expire.
RELEASE_SQL: Final = """
DELETE FROM taskpilots_leases
WHERE name = %(name)s AND owner = %(owner)s AND fencing = %(fencing)s
"""

HOLDER_SQL: Final = """
SELECT owner, fencing, extract(epoch FROM expires_at)::float8,
       extract(epoch FROM expires_at - now())::float8
FROM taskpilots_leases WHERE name = %(name)s AND expires_at > now()
"""


@contextmanager
def _reachable() -> Iterator[None]:
    """Typed errors for "cannot reach PostgreSQL" (fail closed) and "no tables" (setup)."""
    try:
        yield
    except errors.UndefinedTable as exc:
        raise StorageError(
            "the taskpilots_leases table does not exist; call setup() on the lease backend "
            f"or the checkpointer once ({exc.diag.message_primary})"
        ) from exc
    except psycopg.OperationalError as exc:  # also PoolTimeout, PoolClosed, AdminShutdown
        raise Unavailable("postgres", f"{type(exc).__name__}: {exc}") from exc


def _require_autocommit(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    # Outside autocommit the pool would roll back our uncommitted lease when it takes the
    # connection back: the caller would believe it holds a lease that never existed.
    if not conn.autocommit:
        raise ConfigurationError("the lease backend's PostgreSQL pool must use autocommit=True")


def _acquire_params(name: str, owner: str, ttl: float) -> dict[str, Any]:
    check_lease_args(name, owner, ttl)
    return {"name": name, "owner": owner, "ttl": float(ttl)}


def _lease_params(lease: Lease) -> dict[str, Any]:
    return {"name": lease.name, "owner": lease.owner, "fencing": lease.fencing, "ttl": lease.ttl}


def _granted(name: str, owner: str, ttl: float, row: tuple[Any, ...] | None) -> Lease | None:
    return None if row is None else Lease(name, owner, int(row[0]), float(row[1]), ttl)


def _renewed(lease: Lease, row: tuple[Any, ...] | None) -> Lease:
    if row is None:
        raise LeaseLost(lease.name, "it expired or was taken over", fencing=lease.fencing)
    return Lease(lease.name, lease.owner, lease.fencing, float(row[0]), lease.ttl)


def _held(name: str, row: tuple[Any, ...] | None) -> Lease | None:
    if row is None:
        return None
    owner, fencing, expires_at, left = row
    return Lease(name, str(owner), int(fencing), float(expires_at), float(left))


class PostgresLeaseBackend(LeaseBackendBase):
    """Leases in PostgreSQL over psycopg connection pools (sync and async).

    Args:
        url: ``postgresql://`` URL; pools are opened from it lazily, on first use.
        pool: A sync pool to use instead (e.g. the checkpointer's); it must be autocommit.
            Left open on close.
        apool: An async pool likewise.
        max_size: Connections of each pool opened from ``url``.
        timeout: Longest wait for a connection before ``LockBackendUnavailable``.
    """

    kind = "postgres"

    def __init__(
        self,
        url: str | None = None,
        *,
        pool: ConnectionPool[Any] | None = None,
        apool: AsyncConnectionPool[Any] | None = None,
        max_size: int = 4,
        timeout: float = 5.0,
    ) -> None:
        if url is None and pool is None and apool is None:
            raise ConfigurationError("PostgresLeaseBackend needs a url, a pool or an apool")
        self.url = url
        self.max_size = max_size
        self.timeout = timeout
        self._pool = pool
        self._apool = apool
        self._own_pool = self._own_apool = False
        self._init_lock = threading.Lock()
        self._ainit_lock = asyncio.Lock()

    def _pool_args(self) -> dict[str, Any]:
        """The arguments of a pool opened from ``url``."""
        # libpq's connect_timeout counts whole seconds, at least 2.
        kwargs = {**CONNECTION_KWARGS, "connect_timeout": max(2, math.ceil(self.timeout))}
        return {"min_size": 1, "max_size": self.max_size, "kwargs": kwargs, "timeout": self.timeout}

    # -- sync ----------------------------------------------------------------------------------

    def _sync_pool(self) -> ConnectionPool[Any]:
        with self._init_lock:
            if self._pool is None:
                pool: ConnectionPool[Any] = ConnectionPool(
                    self._require_url("pool"), open=False, **self._pool_args()
                )
                # wait=False: an unreachable server must surface as a per-call timeout
                # (LockBackendUnavailable), and the pool keeps reconnecting in between.
                pool.open(wait=False)
                self._pool, self._own_pool = pool, True
            return self._pool

    def _one(self, statement: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        with (
            _reachable(),
            self._sync_pool().connection() as conn,
            conn.cursor(row_factory=tuple_row) as cur,
        ):
            _require_autocommit(conn)
            cur.execute(statement, params)
            return cur.fetchone() if cur.description is not None else (cur.rowcount,)

    def setup(self) -> None:
        """Run the recovery store's migrations (leases included); idempotent."""
        with _reachable():
            PostgresStore(self._sync_pool(), threading.Lock()).setup()

    def close(self) -> None:
        """Close the sync pool if this backend opened it."""
        if self._own_pool and self._pool is not None:
            self._pool.close()
            self._pool, self._own_pool = None, False

    # -- async ---------------------------------------------------------------------------------

    async def _async_pool(self) -> AsyncConnectionPool[Any]:
        async with self._ainit_lock:
            if self._apool is None:
                apool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                    self._require_url("pool"), open=False, **self._pool_args()
                )
                await apool.open(wait=False)
                self._apool, self._own_apool = apool, True
            return self._apool

    async def _aone(self, statement: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        with _reachable():
            async with (
                (await self._async_pool()).connection() as conn,
                conn.cursor(row_factory=tuple_row) as cur,
            ):
                _require_autocommit(conn)
                await cur.execute(statement, params)
                return await cur.fetchone() if cur.description is not None else (cur.rowcount,)

    async def asetup(self) -> None:
        """Async form of :meth:`setup`."""
        with _reachable():
            await AsyncPostgresStore(await self._async_pool(), asyncio.Lock()).setup()

    async def aclose(self) -> None:
        """Close the pools this backend opened (async and sync)."""
        if self._own_apool and self._apool is not None:
            await self._apool.close()
            self._apool, self._own_apool = None, False
        self.close()

    # -- the operations, sync and async --------------------------------------------------------

    def _acquire(self, name: str, owner: str, ttl: float) -> Steps[Lease | None]:
        row = yield io(self, "_one", ACQUIRE_SQL, _acquire_params(name, owner, ttl))
        return _granted(name, owner, ttl, row)

    def _renew(self, lease: Lease) -> Steps[Lease]:
        return _renewed(lease, (yield io(self, "_one", RENEW_SQL, _lease_params(lease))))

    def _release(self, lease: Lease) -> Steps[bool]:
        row: tuple[Any, ...] | None = yield io(self, "_one", RELEASE_SQL, _lease_params(lease))
        return row == (1,)

    def _holder(self, name: str) -> Steps[Lease | None]:
        return _held(name, (yield io(self, "_one", HOLDER_SQL, {"name": name})))

    acquire, aacquire = synced(_acquire), asynced(_acquire)
    renew, arenew = synced(_renew), asynced(_renew)
    release, arelease = synced(_release), asynced(_release)
    holder, aholder = synced(_holder), asynced(_holder)
