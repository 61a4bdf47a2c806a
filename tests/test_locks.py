"""Thread leases and business locks on real Redis, PostgreSQL and SQLite files.

Most tests run against every backend (``lease_url``): process memory, a SQLite file, the
session's Redis (emptied per test) and a PostgreSQL database set up by the checkpointer's own
``setup()`` (which proves the lease tables come with the recovery store's migrations). Names
are unique per test, so the PostgreSQL database is shared by the module.

Mutual exclusion is proven across real processes (forked from a forkserver, as in
``test_event_log``), and Redis outages with a Redis server of the test's own that is stopped
and started again (the session's server must stay up for the other tests).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import queue
import sqlite3
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from _services import RedisServer, free_port, start_redis

from taskpilots_graph import RecoveryCheckpointer
from taskpilots_graph.checkpointers._migrations import SCHEMA_VERSION
from taskpilots_graph.errors import (
    ConfigurationError,
    LeaseLost,
    LockBackendUnavailable,
    StorageError,
    ThreadBusy,
)
from taskpilots_graph.leases import HoldStatus, Lease, local_deadline
from taskpilots_graph.locks import (
    LeaseBackend,
    MemoryLeaseBackend,
    PostgresLeaseBackend,
    RedisLeaseBackend,
    SqliteLeaseBackend,
    abusiness_lock,
    ahold,
    business_lock,
    business_lock_name,
    hold,
    lease_backend_from_url,
    thread_lease_name,
)

TTL = 0.3  # short enough to expire leases quickly, long enough for a loaded CI machine
# Renewal tests need slack for scheduler stalls: other tests SIGKILL and restart worker
# processes on the same cores, and a stall longer than ttl - ttl/3 would lose the lease.
HEARTBEAT_TTL = 1.0

BACKENDS = [
    "memory",
    "sqlite",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("postgres", marks=pytest.mark.postgres),
]
SHARED_BACKENDS = BACKENDS[1:]  # those several processes can share


@pytest.fixture(params=BACKENDS)
def lease_url(request: pytest.FixtureRequest) -> str:
    """Connection string of an empty lease store of each kind."""
    kind = request.param
    if kind == "memory":
        return ":memory:"
    if kind == "sqlite":
        return f"sqlite:///{request.getfixturevalue('sqlite_path')}"
    if kind == "redis":
        return str(request.getfixturevalue("redis_url"))
    return str(request.getfixturevalue("postgres_db"))


@pytest.fixture
def backend(lease_url: str) -> Iterator[LeaseBackend]:
    """A sync lease backend on ``lease_url``; closed after the test."""
    with lease_backend_from_url(lease_url) as opened:
        yield opened


@pytest.fixture
def name() -> str:
    """A lease name no other test uses."""
    return thread_lease_name(f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis server of this test's own, which it may stop and start again."""
    server = start_redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


class _CountingBackend:
    """A backend that counts acquire attempts and delegates everything."""

    def __init__(self, inner: LeaseBackend) -> None:
        self.inner = inner
        self.acquires = 0

    def acquire(self, name: str, owner: str, ttl: float) -> Lease | None:
        self.acquires += 1
        return self.inner.acquire(name, owner, ttl)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


def _wait_until(predicate: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# --- the backend protocol -------------------------------------------------------------------


def test_acquire_is_exclusive_and_idempotent_for_its_owner(
    backend: LeaseBackend, name: str
) -> None:
    """A held name is refused to others, reported by holder(), and re-granted to its owner."""
    first = backend.acquire(name, "A", 5.0)
    assert first is not None
    assert (first.name, first.owner, first.ttl) == (name, "A", 5.0)
    assert backend.acquire(name, "B", 5.0) is None
    current = backend.holder(name)
    assert current is not None
    assert (current.owner, current.fencing) == ("A", first.fencing)
    assert 0 < current.ttl <= 5.0
    again = backend.acquire(name, "A", 5.0)  # a retried request whose reply was lost
    assert again is not None
    assert again.fencing == first.fencing


def test_fencing_tokens_strictly_increase(backend: LeaseBackend, name: str) -> None:
    """Every acquisition, after a release or an expiry takeover, gets a higher token."""
    tokens = []
    for owner in ("A", "B", "C"):
        lease = backend.acquire(name, owner, 5.0)
        assert lease is not None
        tokens.append(lease.fencing)
        assert backend.release(lease)
    expiring = backend.acquire(name, "D", TTL)
    assert expiring is not None
    time.sleep(TTL + 0.05)
    takeover = backend.acquire(name, "E", 5.0)
    assert takeover is not None
    tokens += [expiring.fencing, takeover.fencing]
    assert tokens == sorted(set(tokens)), tokens


def test_release_never_deletes_another_owners_lease(backend: LeaseBackend, name: str) -> None:
    """Release is compare-and-delete: a stale or forged lease cannot free the current one."""
    stale = backend.acquire(name, "A", TTL)
    assert stale is not None
    time.sleep(TTL + 0.05)
    current = backend.acquire(name, "B", 5.0)
    assert current is not None
    assert backend.release(stale) is False
    forged = Lease(name, "C", current.fencing, current.expires_at, current.ttl)
    assert backend.release(forged) is False
    holder = backend.holder(name)
    assert holder is not None
    assert holder.owner == "B"
    assert backend.release(current) is True
    assert backend.holder(name) is None


def test_unrenewed_lease_expires_and_another_owner_takes_it(
    backend: LeaseBackend, name: str
) -> None:
    """Without renewal a lease lapses after its TTL; then it is free and cannot be renewed."""
    lease = backend.acquire(name, "A", TTL)
    assert lease is not None
    assert backend.acquire(name, "B", TTL) is None
    time.sleep(TTL + 0.05)
    assert backend.holder(name) is None
    assert backend.acquire(name, "B", 5.0) is not None
    with pytest.raises(LeaseLost) as lost:
        backend.renew(lease)
    assert (lost.value.name, lost.value.fencing) == (name, lease.fencing)


def test_renew_extends_a_live_lease(backend: LeaseBackend, name: str) -> None:
    """Renewing before expiry keeps the lease (and its token) past its first TTL."""
    lease = backend.acquire(name, "A", TTL)
    assert lease is not None
    for _ in range(4):
        time.sleep(TTL / 3)
        lease = backend.renew(lease)
    assert backend.acquire(name, "B", TTL) is None
    holder = backend.holder(name)
    assert holder is not None
    assert (holder.owner, holder.fencing) == ("A", lease.fencing)


# --- hold(): heartbeat, check, busy, wait -------------------------------------------------------


def test_heartbeat_keeps_lease_alive_past_several_ttls(backend: LeaseBackend, name: str) -> None:
    """hold() renews every ttl/3, so the lease outlives 2+ TTLs and is released on exit."""
    with hold(backend, name, ttl=HEARTBEAT_TTL) as held:
        fencing = held.fencing
        time.sleep(2.5 * HEARTBEAT_TTL)
        held.check()
        assert not held.lost
        assert held.remaining() > 0
        assert backend.acquire(name, "other", TTL) is None
        assert held.fencing == fencing
    assert backend.holder(name) is None


def test_check_raises_lease_lost_after_the_heartbeat_fails(
    backend: LeaseBackend, name: str
) -> None:
    """Once a renewal is refused (lease taken), check() raises and exit leaves the taker alone."""
    with hold(backend, name, ttl=TTL) as held:
        assert backend.release(held.lease)  # as if it had expired ...
        taker = backend.acquire(name, "taker", 5.0)  # ... and been taken over
        assert taker is not None
        assert _wait_until(lambda: held.lost, timeout=2 * TTL)
        with pytest.raises(LeaseLost) as lost:
            held.check()
        assert lost.value.fencing == held.fencing < taker.fencing
    holder = backend.holder(name)
    assert holder is not None
    assert holder.owner == "taker"


def test_hold_raises_thread_busy_naming_the_holder(backend: LeaseBackend, name: str) -> None:
    """A second holder fails at once with ThreadBusy carrying the name and the holder."""
    counting = _CountingBackend(backend)
    with hold(backend, name, ttl=5.0, owner="worker-1") as held:
        with pytest.raises(ThreadBusy) as busy, hold(counting, name, ttl=5.0):
            pytest.fail("entered a held lease")
        assert counting.acquires == 1  # no waiting, no retry
        assert (busy.value.name, busy.value.holder) == (name, "worker-1")
        assert busy.value.expires_at is not None
        held.check()


def test_hold_waits_for_a_release_up_to_its_timeout(backend: LeaseBackend, name: str) -> None:
    """wait/timeout: a waiter gets the name once it is released, or ThreadBusy at the timeout."""
    first = backend.acquire(name, "A", 5.0)
    assert first is not None
    start = time.monotonic()
    with pytest.raises(ThreadBusy), hold(backend, name, ttl=5.0, timeout=0.2):
        pass
    assert time.monotonic() - start >= 0.2
    threading.Timer(0.2, backend.release, (first,)).start()
    with hold(backend, name, ttl=5.0, wait=True, timeout=5.0) as held:
        assert held.fencing > first.fencing


def test_business_lock_names_the_object_and_operation(backend: LeaseBackend) -> None:
    """business_lock is a lease on lock:<object>:<operation>, busy per operation, fenced."""
    order = f"order-{uuid.uuid4().hex[:8]}"
    assert business_lock_name(order, "refund") == f"lock:{order}:refund"
    with business_lock(backend, order, "refund", ttl=5.0) as first:
        assert first.name == f"lock:{order}:refund"
        with pytest.raises(ThreadBusy) as busy, business_lock(backend, order, "refund", ttl=5.0):
            pass
        assert busy.value.holder == first.owner
        with business_lock(backend, order, "cancel", ttl=5.0):
            pass  # another operation on the same object is another lock
    with business_lock(backend, order, "refund", ttl=5.0) as second:
        assert second.fencing > first.fencing
    with pytest.raises(ConfigurationError):
        business_lock_name(order, "re:fund")


# --- async ---------------------------------------------------------------------------------


async def test_async_hold_heartbeat_busy_and_release(lease_url: str, name: str) -> None:
    """ahold() renews from a task past 2 TTLs, refuses a second holder, releases on exit."""
    async with lease_backend_from_url(lease_url) as backend:
        async with ahold(backend, name, ttl=HEARTBEAT_TTL, owner="async-1") as held:
            await asyncio.sleep(2.5 * HEARTBEAT_TTL)
            held.check()
            with pytest.raises(ThreadBusy) as busy:
                async with ahold(backend, name, ttl=TTL):
                    pytest.fail("entered a held lease")
            assert busy.value.holder == "async-1"
        assert await backend.aholder(name) is None


async def test_async_check_raises_lease_lost_after_the_heartbeat_fails(
    lease_url: str, name: str
) -> None:
    """The async heartbeat also turns a refused renewal into LeaseLost from check()."""
    async with lease_backend_from_url(lease_url) as backend:
        async with ahold(backend, name, ttl=TTL) as held:
            assert await backend.arelease(held.lease)
            assert await backend.aacquire(name, "taker", 5.0) is not None
            for _ in range(100):
                if held.lost:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(LeaseLost):
                held.check()
        holder = await backend.aholder(name)
        assert holder is not None
        assert holder.owner == "taker"


async def test_async_tasks_never_overlap_under_a_business_lock(lease_url: str) -> None:
    """Eight tasks waiting on one business lock run one at a time, in fencing order."""
    inside, overlaps, order = 0, 0, []

    async def worker(backend: LeaseBackend) -> None:
        nonlocal inside, overlaps
        async with abusiness_lock(backend, "order-7", "create", ttl=5.0, timeout=10.0) as held:
            inside += 1
            overlaps += inside > 1
            order.append(held.fencing)
            await asyncio.sleep(0.01)
            held.check()
            inside -= 1

    async with lease_backend_from_url(lease_url) as backend:
        await asyncio.gather(*(worker(backend) for _ in range(8)))
    assert overlaps == 0
    assert order == sorted(set(order))


# --- real processes -------------------------------------------------------------------------


def _race(url: str, name: str, rounds: int, barrier: Barrier, results: Any) -> None:
    """Child process: race the other child for ``name`` once per round; report each outcome."""
    try:
        outcomes: list[tuple[str, str | None, int | None]] = []
        with lease_backend_from_url(url) as backend:
            for _ in range(rounds):
                barrier.wait()  # both attempt at the same instant
                try:
                    with hold(backend, name, ttl=10.0) as held:
                        outcomes.append(("won", held.owner, held.fencing))
                        barrier.wait()  # keep it until the other one has tried
                except ThreadBusy as busy:
                    outcomes.append(("busy", busy.holder, None))
                    barrier.wait()
        results.put(("ok", outcomes))
    except BaseException:
        barrier.abort()
        results.put(("error", traceback.format_exc()))


@pytest.mark.slow
@pytest.mark.parametrize("lease_url", SHARED_BACKENDS, indirect=True)
def test_mutual_exclusion_across_processes(lease_url: str, name: str) -> None:
    """2 processes x 50 rounds racing at a barrier: exactly one wins, the other gets ThreadBusy."""
    with lease_backend_from_url(lease_url) as backend:
        backend.setup()  # migrate before the race, not during it
    rounds = 50
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["taskpilots_graph", "redis", "psycopg_pool"])
    barrier = context.Barrier(2, timeout=60)
    results = context.Queue()
    children = [
        context.Process(target=_race, args=(lease_url, name, rounds, barrier, results))
        for _ in range(2)
    ]
    for child in children:
        child.start()
    try:
        reports = [results.get(timeout=120) for _ in children]
    except queue.Empty:
        pytest.fail("a racing process did not report")
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    errors = [body for status, body in reports if status == "error"]
    assert not errors, errors[0]
    first, second = (body for _, body in reports)
    fencing = []
    for a, b in zip(first, second, strict=True):
        (winner,) = [o for o in (a, b) if o[0] == "won"]
        (loser,) = [o for o in (a, b) if o[0] == "busy"]
        assert loser[1] == winner[1]  # ThreadBusy named the actual holder
        fencing.append(winner[2])
    assert fencing == sorted(set(fencing))


# --- outages --------------------------------------------------------------------------------


@pytest.mark.redis
def test_redis_outage_mid_hold(own_redis: RedisServer, name: str) -> None:
    """Redis stopped mid-hold: check() raises LeaseLost, acquiring raises LockBackendUnavailable."""
    with RedisLeaseBackend(own_redis.url, timeout=0.5) as backend:
        with hold(backend, name, ttl=TTL) as held:
            before = held.fencing
            own_redis.stop()
            assert _wait_until(lambda: held.lost, timeout=3 * TTL)
            with pytest.raises(LeaseLost, match="unreachable"):
                held.check()
            with pytest.raises(LockBackendUnavailable) as down:
                backend.acquire(thread_lease_name("other"), "B", TTL)
            assert down.value.backend == "redis"
            with pytest.raises(LockBackendUnavailable), business_lock(backend, "o-1", "pay", ttl=1):
                pytest.fail("ran unlocked")
        # The exit's release failed quietly; the lease would lapse by itself.
        own_redis.start()  # empty: the restart lost every key, counters included
        with hold(backend, name, ttl=TTL) as again:
            assert again.fencing > before  # tokens are seeded from the server clock


@pytest.mark.redis
async def test_async_redis_outage_mid_hold(own_redis: RedisServer, name: str) -> None:
    """The async holder and backend behave the same when Redis goes away and comes back."""
    async with RedisLeaseBackend(own_redis.url, timeout=0.5) as backend:
        async with ahold(backend, name, ttl=TTL) as held:
            own_redis.stop()
            for _ in range(100):
                if held.lost:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(LeaseLost):
                held.check()
            with pytest.raises(LockBackendUnavailable):
                async with abusiness_lock(backend, "o-1", "pay", ttl=1):
                    pytest.fail("ran unlocked")
        own_redis.start()
        assert await backend.aacquire(name, "B", TTL) is not None


@pytest.mark.redis
def test_redis_fencing_keeps_rising_after_redis_loses_its_data(redis_url: str, name: str) -> None:
    """A FLUSHALL (data loss) does not restart fencing tokens at 1."""
    with RedisLeaseBackend(redis_url) as backend:
        first = backend.acquire(name, "A", 5.0)
        assert first is not None
        with redis.Redis.from_url(redis_url) as client:
            client.flushall()
        second = backend.acquire(name, "B", 5.0)
        assert second is not None
        assert second.fencing > first.fencing


@pytest.mark.postgres
def test_postgres_unreachable_is_lock_backend_unavailable() -> None:
    """No server at the address: acquire raises LockBackendUnavailable within the timeout."""
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/none"
    with PostgresLeaseBackend(url, timeout=0.3) as backend:
        with pytest.raises(LockBackendUnavailable) as down:
            backend.acquire("thread:t", "A", 1.0)
        assert down.value.backend == "postgres"
        with pytest.raises(LockBackendUnavailable), business_lock(backend, "o-1", "pay", ttl=1):
            pytest.fail("ran unlocked")


@pytest.mark.postgres
async def test_async_postgres_unreachable_is_lock_backend_unavailable() -> None:
    """The async side of an unreachable PostgreSQL fails closed the same way."""
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/none"
    async with PostgresLeaseBackend(url, timeout=0.3) as backend:
        with pytest.raises(LockBackendUnavailable):
            await backend.aacquire("thread:t", "A", 1.0)


@pytest.mark.postgres
def test_postgres_dropped_connection_mid_hold_keeps_the_lease(
    postgres_db: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A renewal on a killed connection is retried, not fatal: the lease survives the blip."""
    caplog.set_level(logging.WARNING, logger="taskpilots_graph.locks")
    with PostgresLeaseBackend(postgres_db) as backend, hold(backend, name, ttl=0.6) as held:
        with psycopg.connect(postgres_db, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        time.sleep(1.5)
        held.check()
        assert backend.acquire(name, "other", 1.0) is None
    assert "renewing lease" in caplog.text  # the failed renewal did happen, and was survived


def test_sqlite_unopenable_file_is_lock_backend_unavailable(tmp_path: Path) -> None:
    """A SQLite path that cannot be opened fails closed, like an unreachable server."""
    with pytest.raises(LockBackendUnavailable) as down:
        SqliteLeaseBackend(str(tmp_path)).acquire("thread:t", "A", 1.0)  # a directory
    assert down.value.backend == "sqlite"


# --- schema, factory, errors, pure core --------------------------------------------------------


@pytest.mark.postgres
def test_postgres_lease_tables_need_setup(postgres_url: str) -> None:
    """Before setup() acquire says to call it (StorageError); setup() creates the tables."""
    with PostgresLeaseBackend(postgres_url) as backend:
        with pytest.raises(StorageError, match=r"setup\(\)"):
            backend.acquire("thread:t", "A", 1.0)
        backend.setup()
        backend.setup()  # idempotent
        assert backend.acquire("thread:t", "A", 1.0) is not None


def test_sqlite_leases_live_in_the_checkpointer_file(sqlite_path: str) -> None:
    """Leases share the checkpointer's SQLite file and its numbered migrations."""
    with RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as cp:
        cp.setup()
        cp.append_event("t-1", "agent_started", {"goal": "g"})
    with lease_backend_from_url(f"sqlite:///{sqlite_path}") as backend:
        assert backend.acquire("thread:t-1", "A", 1.0) is not None
    with sqlite3.connect(sqlite_path) as conn:
        (version,) = conn.execute("SELECT MAX(v) FROM taskpilots_migrations").fetchone()
    assert version == SCHEMA_VERSION


def test_lease_backend_from_url_picks_the_backend(tmp_path: Path) -> None:
    """Each scheme maps to its backend; unusable strings are configuration errors."""
    expected: dict[str, type[Any]] = {
        ":memory:": MemoryLeaseBackend,
        f"sqlite:///{tmp_path}/a.db": SqliteLeaseBackend,
        str(tmp_path / "b.db"): SqliteLeaseBackend,
        "redis://127.0.0.1:1/0": RedisLeaseBackend,
        "postgresql://u@127.0.0.1:1/db": PostgresLeaseBackend,
    }
    for url, kind in expected.items():
        assert type(lease_backend_from_url(url)) is kind, url
    for bad in ("mysql://x", "sqlite:///:memory:", ""):
        with pytest.raises(ConfigurationError):
            lease_backend_from_url(bad)


def test_invalid_lease_arguments_are_configuration_errors() -> None:
    """Bad TTLs, names and heartbeats are refused before anything is stored."""
    backend = MemoryLeaseBackend()
    for ttl in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ConfigurationError):
            backend.acquire("n", "A", ttl)
    for bad in ("", "a\x00b"):
        with pytest.raises(ConfigurationError):
            backend.acquire(bad, "A", 1.0)
        with pytest.raises(ConfigurationError):
            backend.acquire("n", bad, 1.0)
    with pytest.raises(ConfigurationError), hold(backend, "n", ttl=1.0, heartbeat=1.0):
        pass
    assert backend.holder("n") is None


def test_memory_backend_expires_on_the_given_clock() -> None:
    """The memory backend follows an injected clock, so expiry can be tested without sleeping."""
    now = [1000.0]
    backend = MemoryLeaseBackend(clock=lambda: now[0])
    lease = backend.acquire("n", "A", 10.0)
    assert lease is not None
    assert lease.expires_at == 1010.0
    now[0] = 1010.0
    assert backend.holder("n") is None
    assert backend.acquire("n", "B", 10.0) is not None


def test_hold_status_is_lost_for_good_once_its_deadline_passes() -> None:
    """The pure holder state: deadlines with drift margin, no healing, faster retries."""
    lease = Lease("n", "A", 1, 0.0, 3.0)
    status = HoldStatus.granted(lease, sent_at=100.0)
    assert status.valid_until == local_deadline(100.0, 3.0) < 103.0
    assert status.lost_at(101.0) is None
    assert status.next_beat(1.0) == 1.0
    failing = status.unreachable()
    assert failing.next_beat(1.0) == pytest.approx(1 / 3)
    assert "unreachable" in (failing.lost_at(103.0) or "")
    late = failing.renewed(lease, sent_at=102.5, received_at=103.5)  # answered too late
    assert late.lost_at(103.6) is not None
    assert late.lost_at(0.0) is not None  # and it never heals
    assert status.renewed(lease, 101.0, 101.1).valid_until > status.valid_until
    assert status.taken("taken over").lost_at(100.0) == "taken over"


@pytest.mark.parametrize(
    "err",
    [
        ThreadBusy("thread:t-1", "host:1:ab", expires_at=1.7e9),
        ThreadBusy("lock:o:pay", None),
        LeaseLost("thread:t-1", "its ttl passed", fencing=7),
        LockBackendUnavailable("redis", "ConnectionError: refused"),
    ],
)
def test_lock_errors_survive_pickling(err: Exception) -> None:
    """The new errors cross process boundaries with their fields and message intact."""
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is type(err)
    assert str(copy) == str(err)
    assert copy.__dict__ == err.__dict__
