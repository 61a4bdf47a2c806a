"""The lease backend a checkpointer brings along: leases in its own database.

Thread leases and business locks must not depend on the caller remembering to name a lease
backend: a run through plain ``graph.invoke`` with nothing configured is exactly where two
runners (or two agents on one business object) would otherwise overlap. So every recovery
checkpointer has a default backend living where its ledger lives:

* a SQLite file: :class:`~taskpilots_graph.locks.sqlite.SqliteLeaseBackend` on that same
  file (several processes on one machine see one another's leases);
* PostgreSQL: :class:`~taskpilots_graph.locks.postgres.PostgresLeaseBackend` on the same
  database, through the checkpointer's own pool when it has one;
* process memory (``InMemorySaver``, or a private in-memory SQLite database): one
  :class:`~taskpilots_graph.locks.memory.MemoryLeaseBackend` per store, shared by every view
  of that checkpointer (its state is as private to the process as the checkpoints are).

Redis stays the explicit scale-out option (``create_recovery_agent(leases=...)``).

The backend is found from the recovery store, once, and kept for the store's lifetime (the
checkpointer's density views share the store, hence the backend). It is asked for here, not
on the checkpointer: the backends set up their tables through the stores, so the locks sit
above the checkpointers and the checkpointers import nothing of them.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Final

from taskpilots_graph.checkpointers import AsyncRecoveryCheckpointer, RecoveryAPI
from taskpilots_graph.checkpointers.memory import AsyncMemoryStore, MemoryStore
from taskpilots_graph.checkpointers.sqlite import AsyncSqliteStore, SqliteStore
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.leases import LeaseBackend
from taskpilots_graph.locks.memory import MemoryLeaseBackend
from taskpilots_graph.locks.sqlite import SqliteLeaseBackend

__all__ = ["adefault_lease_backend", "default_lease_backend"]

_DATABASE_LIST: Final = "PRAGMA database_list"

_cache: weakref.WeakKeyDictionary[object, LeaseBackend] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def _cached(store: object) -> LeaseBackend | None:
    """The backend already found for ``store``, if any (no I/O)."""
    with _cache_lock:
        return _cache.get(store)


def _keep(store: object, backend: LeaseBackend) -> LeaseBackend:
    # Two first callers may both build one; the first kept wins, so all share it.
    with _cache_lock:
        return _cache.setdefault(store, backend)


def _sqlite_backend(rows: list[Any]) -> LeaseBackend:
    path = next((str(row[2]) for row in rows if row[1] == "main"), "")
    # An in-memory database has no file ("" in the list): private to its connection, so
    # to this process, like the memory backend.
    return SqliteLeaseBackend(path) if path else MemoryLeaseBackend()


def _conninfo(conn: Any) -> str:
    """A connection string for the database ``conn`` is connected to (password included)."""
    from psycopg.conninfo import make_conninfo

    info = conn.info
    password = info.password
    return make_conninfo(info.dsn, password=password) if password else str(info.dsn)


def _postgres_backend(store: Any) -> LeaseBackend | None:
    try:
        from psycopg import AsyncConnection, Connection
        from psycopg_pool import AsyncConnectionPool, ConnectionPool

        from taskpilots_graph.locks.postgres import PostgresLeaseBackend
    except ImportError:  # pragma: no cover - the postgres extra is not installed
        return None
    conn = getattr(store, "conn", None)
    # A pool whose conninfo is a callable (psycopg_pool >= 3.3) gives no URL for the other
    # side; that side then says so when used.
    if isinstance(conn, ConnectionPool):
        url = conn.conninfo if isinstance(conn.conninfo, str) else None
        return PostgresLeaseBackend(url, pool=conn)
    if isinstance(conn, AsyncConnectionPool):
        url = conn.conninfo if isinstance(conn.conninfo, str) else None
        return PostgresLeaseBackend(url, apool=conn)
    if isinstance(conn, Connection | AsyncConnection):
        # One shared connection serialises the saver's calls; leases get a small pool of
        # their own on the same database instead of waiting their turn on it.
        return PostgresLeaseBackend(_conninfo(conn), max_size=2)
    return None


def default_lease_backend(checkpointer: RecoveryAPI) -> LeaseBackend:
    """The lease backend living in ``checkpointer``'s own database (found once, then reused):
    the one thread leases and business locks use when no backend is named.

    Raises:
        ConfigurationError: For a store of unknown kind (a custom ``store=``).
        asyncio.InvalidStateError: On an async checkpointer's own loop (await the a-form).
    """
    store = getattr(checkpointer, "store", None)
    if isinstance(checkpointer, AsyncRecoveryCheckpointer) and _cached(store) is None:
        # An async store is read on the checkpointer's own loop (from another thread).
        return checkpointer._sync(_astore_backend(store))
    return _store_backend(store)


async def adefault_lease_backend(checkpointer: RecoveryAPI) -> LeaseBackend:
    """Async form of :func:`default_lease_backend`."""
    return await _astore_backend(getattr(checkpointer, "store", None))


def _store_backend(store: object) -> LeaseBackend:
    if (found := _cached(store)) is not None:
        return found
    backend: LeaseBackend | None
    if isinstance(store, MemoryStore | AsyncMemoryStore):
        sync = store.sync if isinstance(store, AsyncMemoryStore) else store
        backend = _cached(sync) or _keep(sync, MemoryLeaseBackend())
    elif isinstance(store, SqliteStore):
        with store.lock:
            rows = store.conn.execute(_DATABASE_LIST).fetchall()
        backend = _sqlite_backend(rows)
    elif isinstance(store, AsyncSqliteStore):
        raise ConfigurationError(
            "the async SQLite store's lease backend is found from the event loop: "
            "use adefault_lease_backend"
        )
    else:
        backend = _postgres_backend(store)
    if backend is None:
        raise ConfigurationError(
            f"no default lease backend is known for the recovery store {type(store).__name__}; "
            "pass one explicitly (create_recovery_agent(leases=lease_backend_from_url(url)))"
        )
    return _keep(store, backend)


async def _astore_backend(store: object) -> LeaseBackend:
    # The async SQLite store is read here, on its loop; the others as in the sync form.
    if (found := _cached(store)) is not None:
        return found
    if isinstance(store, AsyncSqliteStore):
        async with store.lock, store.conn.execute(_DATABASE_LIST) as cur:
            rows = list(await cur.fetchall())
        return _keep(store, _sqlite_backend(rows))
    if isinstance(store, SqliteStore):
        return await asyncio.to_thread(_store_backend, store)
    return _store_backend(store)
