"""Holding a lease for a block of work: acquire, heartbeat, check, release.

::

    with hold(backend, thread_lease_name("t-1"), ttl=30) as held:
        ...
        held.check()               # before every side effect: raises LeaseLost if not ours
        crm.create(..., fencing=held.fencing)

The heartbeat renews every ``ttl / 3`` in a daemon thread (sync) or a task (async). The
sync holder's thread is started only when its first renewal falls due: one shared timer
thread per process waits for that moment, so the many holds that end sooner (a model step,
a short run) cost no thread at all. A
holder's validity is judged locally, from when each successful renewal was *sent* plus the
TTL minus a drift margin, so ``check()`` answers without a round trip, and it turns false on
time even if the heartbeat is stuck on a dead connection. A renewal refused by the backend
(lease taken) ends the hold at once; a renewal that could not reach it is retried until that
local deadline, since a short blip must not cost the lease.

``check()`` narrows the window in which a superseded holder acts, it cannot close it (a
pause can fall between the check and the effect). The fencing token closes it wherever the
resource can compare tokens, e.g. the ledger row written in the same transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Final

from taskpilots_graph.errors import ConfigurationError, LeaseLost, LockBackendUnavailable
from taskpilots_graph.leases import (
    THREAD_HOLD,
    HoldStatus,
    Lease,
    LeaseBackend,
    business_lock_name,
    busy_error,
    holder_died,
    new_owner,
    poll_delay,
)

__all__ = [
    "AsyncHold",
    "Hold",
    "abusiness_lock",
    "ahold",
    "business_lock",
    "current_thread_hold",
    "hold",
    "reset_thread_hold",
    "set_thread_hold",
]

_log: Final = logging.getLogger("taskpilots_graph.locks")


class _Holding:
    """State and checks shared by the sync and async holders (no I/O)."""

    def __init__(self, backend: LeaseBackend, status: HoldStatus, interval: float) -> None:
        self.backend = backend
        self.interval = interval
        # Replaced whole by the heartbeat, read by the caller: see HoldStatus.
        self._status = status
        self.released = False
        """Set once the hold's block has exited: the lease was let go (or left to expire)."""

    @property
    def lease(self) -> Lease:
        """The lease as last granted or renewed."""
        return self._status.lease

    @property
    def name(self) -> str:
        return self._status.lease.name

    @property
    def owner(self) -> str:
        return self._status.lease.owner

    @property
    def fencing(self) -> int:
        """The fencing token of this acquisition; renewals keep it."""
        return self._status.lease.fencing

    @property
    def lost(self) -> bool:
        """Whether the lease can no longer be trusted (renewal refused, or TTL passed)."""
        return self._status.lost_at(time.monotonic()) is not None

    def remaining(self) -> float:
        """Seconds this holder may still trust its lease without another renewal."""
        if self.lost:
            return 0.0
        return max(0.0, self._status.valid_until - time.monotonic())

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless the lease is still ours; call before each effect."""
        status = self._status
        if (reason := status.lost_at(time.monotonic())) is not None:
            raise LeaseLost(status.lease.name, reason, fencing=status.lease.fencing)

    def _after_renewal(self, sent_at: float, result: Lease | BaseException) -> float | None:
        """Fold one renewal outcome into the status; seconds to the next, ``None``: stop."""
        status = self._status
        if isinstance(result, Lease):
            self._status = status.renewed(result, sent_at, time.monotonic())
        elif isinstance(result, LeaseLost):
            self._status = status.taken(result.reason)
        else:
            # Unreachable backend, or anything unexpected: the lease is still valid until
            # its local deadline; retry sooner until then.
            expected = isinstance(result, LockBackendUnavailable)
            _log.warning(
                "renewing lease %r failed: %s", status.lease.name, result, exc_info=not expected
            )
            self._status = status.unreachable()
        if self._status.lost_at(time.monotonic()) is not None:
            return None
        return self._status.next_beat(self.interval)

    def _release_failed(self, exc: LockBackendUnavailable) -> None:
        # Never raised: the block's own outcome matters more, and the TTL frees the name.
        _log.warning("could not release lease %r (it expires by itself): %s", self.name, exc)


class _FirstBeats:
    """One daemon thread per process that starts each hold's heartbeat thread when due.

    A hold is scheduled at its acquisition for ``interval`` later, the moment its first
    renewal is due; its own thread is started then, and renews at once. A hold that ends
    before is dropped from the schedule and never gets a thread. Renewals never run on this
    thread, so a renewal stuck on one backend cannot delay another hold's.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Hold]] = []
        self._order = itertools.count()
        self._pid: int | None = None
        self._ended = 0

    def forked(self) -> None:
        """In a forked child: the timer thread and the parent's holds stayed behind, and the
        lock may have been copied while held."""
        self._cond = threading.Condition(threading.Lock())
        self._heap, self._ended, self._pid = [], 0, None

    def add(self, held: Hold, due: float) -> None:
        with self._cond:
            if self._pid != os.getpid():  # first use, or a forked child: no thread runs here
                self._heap, self._ended, self._pid = [], 0, os.getpid()
                threading.Thread(
                    target=self._run, name="taskpilots-lease-timer", daemon=True
                ).start()
            heapq.heappush(self._heap, (due, next(self._order), held))
            if self._heap[0][2] is held:
                self._cond.notify()

    def ended(self) -> None:
        """A scheduled hold ended before its first beat: drop such entries now and then."""
        with self._cond:
            self._ended += 1
            if self._ended > 64 and 2 * self._ended > len(self._heap):
                self._heap = [item for item in self._heap if not item[2].released]
                heapq.heapify(self._heap)
                self._ended = 0

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            with self._cond:
                if self._pid != pid:
                    return
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                _, _, held = heapq.heappop(self._heap)
            try:
                held._start_beating()
            except Exception:  # e.g. no thread left: that lease lapses, LeaseLost says so
                _log.exception("could not start the heartbeat of lease %r", held.name)


_first_beats: Final = _FirstBeats()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_first_beats.forked)


class Hold(_Holding):
    """A lease held by :func:`hold`, renewed by a background thread until the block exits."""

    def __init__(self, backend: LeaseBackend, status: HoldStatus, interval: float) -> None:
        super().__init__(backend, status, interval)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # made when the first renewal is due
        # Orders the start of the heartbeat thread against the end of the hold.
        self._start_lock = threading.Lock()

    def _start_beating(self) -> None:
        with self._start_lock:
            if self.released or self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._beat, name=f"taskpilots-lease:{self.name}", daemon=True
            )
            self._thread.start()

    def _beat(self) -> None:
        delay: float | None = 0.0  # started when the first renewal is due
        while not self._stop.wait(delay):
            sent_at = time.monotonic()
            result: Lease | BaseException
            try:
                result = self.backend.renew(self._status.lease)
            except Exception as exc:
                result = exc
            if (delay := self._after_renewal(sent_at, result)) is None:
                return

    def _finish(self) -> None:
        with self._start_lock:
            self.released = True
            beating = self._thread
        self._stop.set()
        if beating is not None:
            beating.join()  # a renewal in flight ends before the release below
        else:
            _first_beats.ended()
        try:
            self.backend.release(self._status.lease)
        except LockBackendUnavailable as exc:
            self._release_failed(exc)


class AsyncHold(_Holding):
    """A lease held by :func:`ahold`, renewed by a task until the block exits."""

    def __init__(self, backend: LeaseBackend, status: HoldStatus, interval: float) -> None:
        super().__init__(backend, status, interval)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        delay: float | None = self.interval
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
            if self._stop.is_set():
                return
            sent_at = time.monotonic()
            result: Lease | BaseException
            try:
                result = await self.backend.arenew(self._status.lease)
            except Exception as exc:
                result = exc
            if (delay := self._after_renewal(sent_at, result)) is None:
                return

    async def _finish(self) -> None:
        self.released = True
        self._stop.set()
        if self._task is not None:
            await self._task  # not cancelled: a renewal in flight completes cleanly
        try:
            await self.backend.arelease(self._status.lease)
        except LockBackendUnavailable as exc:
            self._release_failed(exc)


def _interval(ttl: float, heartbeat: float | None) -> float:
    interval = ttl / 3 if heartbeat is None else heartbeat
    if not 0 < interval < ttl:
        raise ConfigurationError(f"heartbeat must be in (0, ttl={ttl}), got {heartbeat}")
    return interval


def _wait_deadline(wait: bool, timeout: float | None) -> tuple[bool, float | None]:
    """(whether to wait, monotonic deadline or None for no limit); a timeout implies waiting."""
    if timeout is None:
        return wait, None
    if timeout < 0:
        raise ConfigurationError(f"timeout must be >= 0, got {timeout}")
    return True, time.monotonic() + timeout


def _took_over(name: str, dead: Lease) -> None:
    # Released by compare-and-delete on (owner, fencing): only that very lease goes, and
    # our acquisition still gets a greater fencing token than the dead holder's.
    _log.warning("lease %r: its holder %r is gone (same machine), taking it over", name, dead.owner)


def _acquire(
    backend: LeaseBackend, name: str, owner: str, ttl: float, wait: bool, timeout: float | None
) -> HoldStatus:
    waiting, deadline = _wait_deadline(wait, timeout)
    attempt = 0
    while True:
        sent_at = time.monotonic()
        if (lease := backend.acquire(name, owner, ttl)) is not None:
            return HoldStatus.granted(lease, sent_at)
        current = backend.holder(name)
        if current is not None and holder_died(current.owner) and backend.release(current):
            _took_over(name, current)
            continue
        remaining = None if deadline is None else deadline - time.monotonic()
        if not waiting or (remaining is not None and remaining <= 0):
            raise busy_error(name, current)
        time.sleep(poll_delay(attempt, remaining))
        attempt += 1


async def _aacquire(
    backend: LeaseBackend, name: str, owner: str, ttl: float, wait: bool, timeout: float | None
) -> HoldStatus:
    waiting, deadline = _wait_deadline(wait, timeout)
    attempt = 0
    while True:
        sent_at = time.monotonic()
        if (lease := await backend.aacquire(name, owner, ttl)) is not None:
            return HoldStatus.granted(lease, sent_at)
        current = await backend.aholder(name)
        if current is not None and holder_died(current.owner) and await backend.arelease(current):
            _took_over(name, current)
            continue
        remaining = None if deadline is None else deadline - time.monotonic()
        if not waiting or (remaining is not None and remaining <= 0):
            raise busy_error(name, current)
        await asyncio.sleep(poll_delay(attempt, remaining))
        attempt += 1


@contextmanager
def hold(
    backend: LeaseBackend,
    name: str,
    *,
    ttl: float,
    wait: bool = False,
    timeout: float | None = None,
    owner: str | None = None,
    heartbeat: float | None = None,
) -> Iterator[Hold]:
    """Hold the lease on ``name`` for the ``with`` block, renewing it in the background.

    Args:
        backend: Where the lease lives.
        name: The lease name, e.g. :func:`~taskpilots_graph.locks.thread_lease_name`.
        ttl: Seconds the lease outlives a crashed holder. Pick it above the p99 of the
            longest pause between two heartbeats; the heartbeat renews every ``ttl / 3``.
        wait: Wait for a busy name to become free instead of failing at once.
        timeout: The longest to wait (implies ``wait``); ``None`` with ``wait`` waits forever.
        owner: Owner token; a fresh :func:`~taskpilots_graph.locks.new_owner` by default.
            It must be unique per hold: two holds given the same owner share one lease
            (acquire is idempotent per owner), and the first to exit releases it.
        heartbeat: Seconds between renewals, instead of ``ttl / 3``.

    Yields:
        The :class:`Hold`: ``.fencing``, ``.lost``, ``.check()``, ``.remaining()``.

    Raises:
        ThreadBusy: The name is held by someone else (after waiting, if asked to).
        LockBackendUnavailable: The backend cannot be reached; nothing was acquired.
    """
    interval = _interval(ttl, heartbeat)
    status = _acquire(backend, name, owner or new_owner(), ttl, wait, timeout)
    held = Hold(backend, status, interval)
    _first_beats.add(held, time.monotonic() + interval)  # beats once the first renewal is due
    try:
        yield held
    finally:
        held._finish()


@asynccontextmanager
async def ahold(
    backend: LeaseBackend,
    name: str,
    *,
    ttl: float,
    wait: bool = False,
    timeout: float | None = None,
    owner: str | None = None,
    heartbeat: float | None = None,
) -> AsyncIterator[AsyncHold]:
    """Async form of :func:`hold`: the heartbeat is a task on the running loop."""
    interval = _interval(ttl, heartbeat)
    status = await _aacquire(backend, name, owner or new_owner(), ttl, wait, timeout)
    held = AsyncHold(backend, status, interval)
    held._task = asyncio.create_task(held._beat(), name=f"taskpilots-lease:{name}")
    try:
        yield held
    finally:
        await held._finish()


def business_lock(
    backend: LeaseBackend,
    object_id: str,
    operation: str,
    *,
    ttl: float,
    wait: bool = False,
    timeout: float | None = None,
    owner: str | None = None,
    heartbeat: float | None = None,
) -> contextlib.AbstractContextManager[Hold]:
    """Hold the lock on ``operation`` of a business object, e.g. ``("order-42", "refund")``.

    The same lease as :func:`hold`, on the name ``lock:<object_id>:<operation>``, so two
    agents can never both "create the order". Pass ``.fencing`` on to the service or the
    ledger where it can be compared. An unreachable backend raises
    ``LockBackendUnavailable``: the effect must then wait or escalate, never run unlocked.
    """
    name = business_lock_name(object_id, operation)
    return hold(
        backend, name, ttl=ttl, wait=wait, timeout=timeout, owner=owner, heartbeat=heartbeat
    )


def abusiness_lock(
    backend: LeaseBackend,
    object_id: str,
    operation: str,
    *,
    ttl: float,
    wait: bool = False,
    timeout: float | None = None,
    owner: str | None = None,
    heartbeat: float | None = None,
) -> contextlib.AbstractAsyncContextManager[AsyncHold]:
    """Async form of :func:`business_lock`."""
    name = business_lock_name(object_id, operation)
    return ahold(
        backend, name, ttl=ttl, wait=wait, timeout=timeout, owner=owner, heartbeat=heartbeat
    )


# --- the thread lease of the current run ------------------------------------------------------


def current_thread_hold() -> Hold | AsyncHold | None:
    """The thread lease the runner (``tp.run``, ``tp.resume``, ...) holds for this run, if any.

    The executor calls its ``check()`` before every side effect, so a run whose lease was
    lost stops with :class:`~taskpilots_graph.errors.LeaseLost` before its next effect.
    """
    return THREAD_HOLD.get()  # type: ignore[no-any-return]


def set_thread_hold(held: Hold | AsyncHold | None) -> contextvars.Token[Hold | AsyncHold | None]:
    """Make ``held`` the current run's thread lease (runner use); reset with the token."""
    return THREAD_HOLD.set(held)


def reset_thread_hold(token: contextvars.Token[Hold | AsyncHold | None]) -> None:
    """Restore the thread lease that was current before :func:`set_thread_hold`."""
    THREAD_HOLD.reset(token)
