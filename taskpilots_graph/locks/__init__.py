"""Thread leases and business locks: one process per thread, one agent per business operation.

Two uses of the same mechanism (a lease with a TTL, a heartbeat and a fencing token):

* **Thread lease** (``thread:<thread_id>``): only one process runs a LangGraph thread at a
  time. A second runner gets :class:`~taskpilots_graph.errors.ThreadBusy` instead of the
  silent lost write of two concurrent runs (LangGraph #8796).
* **Business lock** (``lock:<object_id>:<operation>``): two agents cannot both perform an
  operation on one business object. If the backend is unreachable the effect fails closed
  (:class:`~taskpilots_graph.errors.LockBackendUnavailable`), it never runs unlocked.

Backends, by connection string (:func:`lease_backend_from_url`): Redis, PostgreSQL (a table
beside the ledger), a SQLite file (embedded mode) and process memory. Each has sync and async
methods (:class:`LeaseBackend`); :func:`hold` / :func:`ahold` and :func:`business_lock` /
:func:`abusiness_lock` wrap acquisition, heartbeat, ``check()`` and release.

With no backend named, the recovery agent, ``RecoveryMiddleware`` and the runners use the
one in the checkpointer's own database (:func:`default_lease_backend`); Redis is the
explicit scale-out choice. A holder whose process is gone on this very machine (SIGKILL)
is taken over at once instead of after its TTL (:func:`~taskpilots_graph.leases.holder_died`).

The Redis and PostgreSQL backends import their client library on first access, so neither is
required unless used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from taskpilots_graph.checkpointers._conn_string import parse_conn_string
from taskpilots_graph.checkpointers._sqlite_connect import sqlite_path
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.leases import (
    BUSINESS_LOCK_PREFIX,
    THREAD_LEASE_PREFIX,
    Lease,
    LeaseBackend,
    LeaseBackendBase,
    business_lock_name,
    new_owner,
    thread_lease_name,
)
from taskpilots_graph.locks.default import adefault_lease_backend, default_lease_backend
from taskpilots_graph.locks.heartbeat import AsyncHold, Hold
from taskpilots_graph.locks.hold import abusiness_lock, ahold, business_lock, hold
from taskpilots_graph.locks.memory import MemoryLeaseBackend
from taskpilots_graph.locks.sqlite import SqliteLeaseBackend

if TYPE_CHECKING:
    from taskpilots_graph.locks.postgres import PostgresLeaseBackend
    from taskpilots_graph.locks.redis import RedisLeaseBackend

__all__ = [
    "BUSINESS_LOCK_PREFIX",
    "THREAD_LEASE_PREFIX",
    "AsyncHold",
    "Hold",
    "Lease",
    "LeaseBackend",
    "LeaseBackendBase",
    "MemoryLeaseBackend",
    "PostgresLeaseBackend",
    "RedisLeaseBackend",
    "SqliteLeaseBackend",
    "abusiness_lock",
    "adefault_lease_backend",
    "ahold",
    "business_lock",
    "business_lock_name",
    "default_lease_backend",
    "hold",
    "lease_backend_from_url",
    "new_owner",
    "thread_lease_name",
]

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_LAZY = {"RedisLeaseBackend": "redis", "PostgresLeaseBackend": "postgres"}


def __getattr__(name: str) -> Any:
    # Lazy: importing the locks package must not require redis or psycopg.
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lease_backend_from_url(url: str, **options: Any) -> LeaseBackend:
    """Open the lease backend a connection string names (lazily: no I/O until first use).

    Args:
        url: ``redis://...`` / ``rediss://...`` / ``unix://...`` (Redis),
            ``postgresql://...`` / ``postgres://...``, ``sqlite:///path/runs.db`` (or a plain
            file path), or ``":memory:"`` (this process only).
        options: Keyword arguments of the backend's constructor (e.g. ``timeout=``).

    Returns:
        The backend; use it as a (sync or async) context manager to close it. PostgreSQL
        needs its tables: call ``setup()`` once per database (the checkpointer's ``setup()``
        creates them too); SQLite creates them on first use.

    Raises:
        ConfigurationError: For an unknown scheme or an in-memory SQLite database.
    """
    if isinstance(url, str) and url.startswith(_REDIS_SCHEMES):
        from taskpilots_graph.locks.redis import RedisLeaseBackend

        return RedisLeaseBackend(url, **options)
    try:
        target = parse_conn_string(url)
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"{exc}; for leases, 'redis://host:6379/0' is accepted as well"
        ) from None
    if target.backend == "memory":
        return MemoryLeaseBackend(**options)
    if target.backend == "sqlite":
        return SqliteLeaseBackend(sqlite_path(target.address), **options)
    from taskpilots_graph.locks.postgres import PostgresLeaseBackend

    return PostgresLeaseBackend(target.address, **options)
