"""The holder of a lease and its heartbeat: :class:`Hold` (sync) and :class:`AsyncHold`.

The heartbeat renews every ``ttl / 3`` in a daemon thread (sync) or a task (async). The
sync holder's thread is started only when its first renewal falls due: one shared timer
thread per process waits for that moment, so the many holds that end sooner (a model step,
a short run) cost no thread at all. A
holder's validity is judged locally, from when each successful renewal was *sent* plus the
TTL minus a drift margin, so ``check()`` answers without a round trip, and it turns false on
time even if the heartbeat is stuck on a dead connection. A renewal refused by the backend
(lease taken) ends the hold at once; a renewal that could not reach it is retried until that
local deadline, since a short blip must not cost the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
from typing import Final

from taskpilots_graph._twins import Steps, arun_steps, io, run_steps
from taskpilots_graph.errors import LeaseLost, LockBackendUnavailable
from taskpilots_graph.leases import HoldStatus, Lease, LeaseBackend

__all__ = ["AsyncHold", "Hold"]

_log: Final = logging.getLogger("taskpilots_graph.locks")


class _Holding:
    """State and checks shared by the sync and async holders, and the steps of their I/O."""

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

    def _renewal(self) -> Steps[float | None]:
        """One renewal, folded into the status; seconds to the next, ``None``: stop."""
        sent_at = time.monotonic()
        result: Lease | BaseException
        try:
            result = yield io(self.backend, "renew", self._status.lease)
        except Exception as exc:
            result = exc
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

    def _release(self) -> Steps[None]:
        try:
            yield io(self.backend, "release", self._status.lease)
        except LockBackendUnavailable as exc:
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
    """A lease held by :func:`~.hold.hold`, renewed by a background thread until the block exits."""

    def __init__(self, backend: LeaseBackend, status: HoldStatus, interval: float) -> None:
        super().__init__(backend, status, interval)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # made when the first renewal is due
        # Orders the start of the heartbeat thread against the end of the hold.
        self._start_lock = threading.Lock()

    def _start(self) -> None:
        # No thread yet: it is started once the first renewal is due.
        _first_beats.add(self, time.monotonic() + self.interval)

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
        while delay is not None and not self._stop.wait(delay):
            delay = run_steps(self._renewal())

    def _finish(self) -> None:
        with self._start_lock:
            self.released = True
            beating = self._thread
        self._stop.set()
        if beating is not None:
            beating.join()  # a renewal in flight ends before the release below
        else:
            _first_beats.ended()
        run_steps(self._release())


class AsyncHold(_Holding):
    """A lease held by :func:`~.hold.ahold`, renewed by a task until the block exits."""

    def __init__(self, backend: LeaseBackend, status: HoldStatus, interval: float) -> None:
        super().__init__(backend, status, interval)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _start(self) -> None:
        self._task = asyncio.create_task(self._beat(), name=f"taskpilots-lease:{self.name}")

    async def _beat(self) -> None:
        delay: float | None = self.interval
        while delay is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
            if self._stop.is_set():
                return
            delay = await arun_steps(self._renewal())

    async def _finish(self) -> None:
        self.released = True
        self._stop.set()
        if self._task is not None:
            await self._task  # not cancelled: a renewal in flight completes cleanly
        await arun_steps(self._release())
