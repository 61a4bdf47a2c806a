"""Leases in a SQLite file: embedded mode, several processes on one machine.

The same table as on PostgreSQL (``taskpilots_leases``) plus a one-row fencing counter,
usually in the checkpointer's own file. Every call runs in a ``BEGIN IMMEDIATE``
transaction: SQLite admits one writer per file, so the read of the row and the write that
follows can never interleave with another process's. The decision in between is the shared
pure core (:func:`~taskpilots_graph.leases.grant` and friends).

Connections are kept between calls (a few idle ones per backend, taken by one call at a
time): opening one and reading the schema cost more than the transaction itself. Nothing
outlives a call but the connection: each transaction commits (``synchronous`` as the file's
default, so a granted lease is on disk) or rolls back before the connection goes back, and a
connection that failed is closed, not reused. A process forked with idle connections never
uses (nor closes) the parent's: SQLite connections must not cross ``fork()``.

Times are the library clock's (all processes share one machine, hence one clock). The async
methods run the sync ones in a worker thread: SQLite calls block.

All holders share one machine, so a lease whose holder process is gone (killed with SIGKILL:
nothing released it) is known to be dead before its TTL runs out
(:func:`~taskpilots_graph.leases.holder_died`). Such a lease counts as expired here, in
``holder()`` too, so a thread whose worker was killed can be resumed at once instead of after
the TTL. A live process (or a process id reused by one) keeps its lease: the check can only
err toward waiting.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Final

from taskpilots_graph import _clock
from taskpilots_graph.checkpointers.sqlite import SqliteStore
from taskpilots_graph.errors import ConfigurationError, LeaseLost
from taskpilots_graph.errors import LockBackendUnavailable as Unavailable
from taskpilots_graph.leases import (
    Lease,
    LeaseBackendBase,
    check_lease_args,
    current_lease,
    extend,
    grant,
    holder_died,
    same_holder,
)

__all__ = ["SqliteLeaseBackend"]

_SELECT: Final = "SELECT owner, fencing, expires_at FROM taskpilots_leases WHERE name = ?"
_UPSERT: Final = """
    INSERT INTO taskpilots_leases (name, owner, fencing, expires_at) VALUES (?, ?, ?, ?)
    ON CONFLICT (name) DO UPDATE SET
        owner = excluded.owner, fencing = excluded.fencing, expires_at = excluded.expires_at
"""
_LAST_FENCING: Final = "SELECT last FROM taskpilots_lease_fencing WHERE id = 1"
_SET_FENCING: Final = """
    INSERT INTO taskpilots_lease_fencing (id, last) VALUES (1, ?)
    ON CONFLICT (id) DO UPDATE SET last = excluded.last
"""
_DELETE: Final = "DELETE FROM taskpilots_leases WHERE name = ? AND owner = ? AND fencing = ?"

_JOURNAL_MODE: Final = "PRAGMA journal_mode"
_SYNCHRONOUS: Final = "PRAGMA synchronous"

_MAX_IDLE: Final = 4
"""Idle connections a backend keeps (more callers at once open, then close, their own)."""

_INHERITED: list[sqlite3.Connection] = []
"""Connections a forked child found idle: never used nor closed there (see the docstring)."""


class SqliteLeaseBackend(LeaseBackendBase):
    """Leases in a SQLite file, created (migrated) on first use like ``SqliteSaver``.

    Args:
        path: The database file; usually the checkpointer's.
        busy_timeout: How long to wait for another process's write before
            ``LockBackendUnavailable``.
        clock: Seconds since the epoch; defaults to the library clock at each call.
    """

    kind = "sqlite"

    def __init__(
        self, path: str, *, busy_timeout: float = 10.0, clock: Callable[[], float] | None = None
    ) -> None:
        if path in ("", ":memory:") or path.startswith("file::memory:"):
            raise ConfigurationError(
                "an in-memory SQLite database is private to one connection and cannot share "
                "leases; use a file path, or ':memory:' for the in-process backend"
            )
        self.path = path
        self.busy_timeout = busy_timeout
        self._clock = clock
        self._ready = False
        self._setup_lock = threading.Lock()
        self._idle: list[sqlite3.Connection] = []
        self._idle_pid = os.getpid()
        self._idle_lock = threading.Lock()

    def _now(self) -> float:
        return self._clock() if self._clock is not None else _clock.now()

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: no implicit transactions, the BEGIN below is explicit.
        # check_same_thread=False: a kept connection serves one call at a time, any thread.
        return sqlite3.connect(
            self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False
        )

    def _take(self) -> sqlite3.Connection:
        with self._idle_lock:
            if self._idle_pid != os.getpid():  # forked: the parent's connections stay its own
                _INHERITED.extend(self._idle)
                self._idle, self._idle_pid = [], os.getpid()
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _give_back(self, conn: sqlite3.Connection) -> None:
        with self._idle_lock:
            if self._idle_pid == os.getpid() and len(self._idle) < _MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        """A connection for one call: kept for the next call if the call ended cleanly."""
        conn = self._take()
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        if conn.in_transaction:  # never hand on an open transaction (not expected)
            conn.close()
        else:
            self._give_back(conn)

    def close(self) -> None:
        """Close the idle connections (the backend opens new ones if used again)."""
        with self._idle_lock:
            idle, self._idle = self._idle, []
            if self._idle_pid != os.getpid():
                _INHERITED.extend(idle)
                idle, self._idle_pid = [], os.getpid()
        for conn in idle:
            conn.close()

    def setup(self) -> None:
        """Apply the recovery store's migrations (leases included) to the file; idempotent."""
        with self._setup_lock:
            if self._ready:
                return
            try:
                with closing(sqlite3.connect(self.path, timeout=self.busy_timeout)) as conn:
                    # The store migrates inside BEGIN IMMEDIATE: safe against other processes.
                    SqliteStore(conn, threading.Lock()).setup()
            except sqlite3.OperationalError as exc:
                raise Unavailable("sqlite", f"{self.path}: {exc}") from exc
            self._ready = True

    @contextmanager
    def _write(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction on a connection no other call is using.

        ``durable=False`` (a release) skips the commit's fsync where that is safe: in WAL
        mode with ``synchronous=NORMAL`` the commit is atomic and at once visible to every
        process, and only an OS crash or power loss can undo it, together with the commits
        after it and never an earlier one, so at worst the lease stays until its TTL (as
        PostgreSQL's release, which has no durability switch). Outside WAL mode
        ``NORMAL`` could corrupt the file on power loss: the commit is synced there.
        """
        self.setup()
        try:
            with self._connection() as conn:
                level = None
                if not durable:  # settable outside a transaction only
                    (level,) = conn.execute(_SYNCHRONOUS).fetchone()
                    conn.execute(f"{_SYNCHRONOUS} = NORMAL")
                conn.execute("BEGIN IMMEDIATE")
                try:
                    # Checked inside the write transaction, where the journal mode cannot
                    # change any more: outside WAL mode, start again with the fsync.
                    if level is not None and conn.execute(_JOURNAL_MODE).fetchone()[0] != "wal":
                        conn.execute("ROLLBACK")
                        conn.execute(f"{_SYNCHRONOUS} = {int(level)}")
                        level = None
                        conn.execute("BEGIN IMMEDIATE")
                    yield conn
                except BaseException:
                    # SQLite may have rolled back already (e.g. disk full): don't mask the error.
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
                if level is not None:  # the connection is kept: the next call syncs again
                    conn.execute(f"{_SYNCHRONOUS} = {int(level)}")
        except sqlite3.OperationalError as exc:  # locked too long, unreadable, disk full
            raise Unavailable("sqlite", f"{self.path}: {exc}") from exc

    @staticmethod
    def _stored(conn: sqlite3.Connection, name: str, now: float) -> Lease | None:
        row = conn.execute(_SELECT, (name,)).fetchone()
        if row is None:
            return None
        owner, fencing, expires_at = row
        if holder_died(str(owner)):
            expires_at = min(float(expires_at), now)  # its process is gone: expired
        return Lease(name, owner, int(fencing), float(expires_at), float(expires_at) - now)

    @staticmethod
    def _store(conn: sqlite3.Connection, lease: Lease) -> None:
        conn.execute(_UPSERT, (lease.name, lease.owner, lease.fencing, lease.expires_at))

    def acquire(self, name: str, owner: str, ttl: float) -> Lease | None:
        check_lease_args(name, owner, ttl)
        with self._write() as conn:
            now = self._now()
            (last,) = conn.execute(_LAST_FENCING).fetchone() or (0,)
            lease = grant(self._stored(conn, name, now), name, owner, ttl, now, int(last))
            if lease is not None:
                self._store(conn, lease)
                if lease.fencing > last:
                    conn.execute(_SET_FENCING, (lease.fencing,))
            return lease

    def renew(self, lease: Lease) -> Lease:
        with self._write() as conn:
            now = self._now()
            renewed = extend(self._stored(conn, lease.name, now), lease, now)
            if renewed is not None:
                self._store(conn, renewed)
        if renewed is None:
            raise LeaseLost(lease.name, "it expired or was taken over", fencing=lease.fencing)
        return renewed

    def release(self, lease: Lease) -> bool:
        with self._write(durable=False) as conn:
            if not same_holder(self._stored(conn, lease.name, self._now()), lease):
                return False
            conn.execute(_DELETE, (lease.name, lease.owner, lease.fencing))
            return True

    def holder(self, name: str) -> Lease | None:
        self.setup()
        now = self._now()
        try:
            with self._connection() as conn:
                return current_lease(self._stored(conn, name, now), now)
        except sqlite3.OperationalError as exc:
            raise Unavailable("sqlite", f"{self.path}: {exc}") from exc

    async def asetup(self) -> None:
        await asyncio.to_thread(self.setup)

    async def aacquire(self, name: str, owner: str, ttl: float) -> Lease | None:
        return await asyncio.to_thread(self.acquire, name, owner, ttl)

    async def arenew(self, lease: Lease) -> Lease:
        return await asyncio.to_thread(self.renew, lease)

    async def arelease(self, lease: Lease) -> bool:
        return await asyncio.to_thread(self.release, lease)

    async def aholder(self, name: str) -> Lease | None:
        return await asyncio.to_thread(self.holder, name)
