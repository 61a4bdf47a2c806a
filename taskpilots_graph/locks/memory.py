"""Leases in process memory: for tests, notebooks and single-process runs.

Mutual exclusion covers the threads and tasks of one process only. Expiry follows the
library clock (:func:`taskpilots_graph._clock.now`), so a test can install a fake clock and
expire a lease without sleeping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from taskpilots_graph import _clock
from taskpilots_graph.errors import LeaseLost
from taskpilots_graph.leases import (
    Lease,
    LeaseBackendBase,
    check_lease_args,
    current_lease,
    extend,
    grant,
    same_holder,
)

__all__ = ["MemoryLeaseBackend"]


class MemoryLeaseBackend(LeaseBackendBase):
    """A dict of leases behind a lock; the async methods never block, so they call through.

    Args:
        clock: Seconds since the epoch; defaults to the library clock at each call.
    """

    kind = "memory"

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._last_fencing = 0
        self._lock = threading.Lock()

    def _now(self) -> float:
        return self._clock() if self._clock is not None else _clock.now()

    def acquire(self, name: str, owner: str, ttl: float) -> Lease | None:
        check_lease_args(name, owner, ttl)
        with self._lock:
            lease = grant(self._leases.get(name), name, owner, ttl, self._now(), self._last_fencing)
            if lease is not None:
                self._leases[name] = lease
                self._last_fencing = max(self._last_fencing, lease.fencing)
            return lease

    def renew(self, lease: Lease) -> Lease:
        with self._lock:
            renewed = extend(self._leases.get(lease.name), lease, self._now())
            if renewed is None:
                raise LeaseLost(lease.name, "it expired or was taken over", fencing=lease.fencing)
            self._leases[lease.name] = renewed
            return renewed

    def release(self, lease: Lease) -> bool:
        with self._lock:
            if not same_holder(self._leases.get(lease.name), lease):
                return False
            del self._leases[lease.name]
            return True

    def holder(self, name: str) -> Lease | None:
        with self._lock:
            return current_lease(self._leases.get(name), self._now())

    async def aacquire(self, name: str, owner: str, ttl: float) -> Lease | None:
        return self.acquire(name, owner, ttl)

    async def arenew(self, lease: Lease) -> Lease:
        return self.renew(lease)

    async def arelease(self, lease: Lease) -> bool:
        return self.release(lease)

    async def aholder(self, name: str) -> Lease | None:
        return self.holder(name)
