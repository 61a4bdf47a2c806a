"""Leases and fencing tokens: the I/O-free core every lock backend and holder shares.

A *lease* is a lock that expires by itself: a worker killed with SIGKILL never releases
anything, and a lock without an expiry would keep its thread or business object locked
forever (redis-py's ``Lock`` defaults to exactly that). A holder that needs longer than the
TTL renews it (the heartbeat of :mod:`taskpilots_graph.locks.heartbeat`).

Expiry alone cannot make a lease safe: a holder paused past its TTL (GC, swap, a stopped VM)
wakes up believing it still holds the name while a new holder works. So every acquisition
gets a *fencing token* that is strictly greater than every token handed out for that name
before; a resource that remembers the highest token it has seen can refuse the late writer.

Everything here is pure (validation, names, the decisions of read-then-write stores, a
holder's :class:`HoldStatus`, the current run's thread lease); the backends and holders of
:mod:`taskpilots_graph.locks` drive it. It sits below both the checkpointers and the locks,
so neither imports the other for these names.
"""

from __future__ import annotations

import contextvars
import hashlib
import math
import os
import random
import secrets
import socket
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Final, Protocol, Self

from taskpilots_graph.errors import ConfigurationError, ThreadBusy

__all__ = [
    "BUSINESS_LOCK_PREFIX",
    "DEFAULT_LEASE_TTL",
    "MAX_NAME_LENGTH",
    "MAX_TTL_S",
    "MIN_TTL_S",
    "THREAD_HOLD",
    "THREAD_LEASE_PREFIX",
    "HoldStatus",
    "Lease",
    "LeaseBackend",
    "LeaseBackendBase",
    "business_lock_name",
    "busy_error",
    "check_lease_args",
    "current_lease",
    "extend",
    "grant",
    "held_thread_lease",
    "holder_died",
    "local_deadline",
    "new_owner",
    "poll_delay",
    "same_holder",
    "thread_lease_name",
]

THREAD_LEASE_PREFIX: Final = "thread:"
BUSINESS_LOCK_PREFIX: Final = "lock:"
MAX_NAME_LENGTH: Final = 1024
MIN_TTL_S: Final = 0.01
MAX_TTL_S: Final = 7 * 24 * 3600.0
DEFAULT_LEASE_TTL: Final = 30.0
"""TTL of the thread lease of a graph that names none (e.g. ``create_agent`` graphs)."""

# Clock-drift allowance of a holder's own validity estimate (the Redlock rule): 1 % of the
# TTL plus 2 ms. Clocks of two machines run at slightly different rates; a holder that trusts
# its lease for the whole TTL could outlive the server's copy by that difference.
_DRIFT_FACTOR: Final = 0.01
_DRIFT_FLOOR_S: Final = 0.002


@dataclass(frozen=True, slots=True)
class Lease:
    """One acquisition of a name, as the backend granted it.

    Attributes:
        name: What is leased (``thread:<id>`` or ``lock:<object>:<operation>``).
        owner: The owner token given to ``acquire``; only it can renew or release the lease.
        fencing: Strictly greater than the token of every earlier acquisition of ``name``;
            pass it to resources that can refuse writes from a superseded holder.
        expires_at: Seconds since the epoch on the *backend's* clock (PostgreSQL ``now()``,
            Redis ``TIME``) when the lease lapses unless renewed. For display and for
            supervisors; a holder judges its own validity with a local monotonic deadline.
        ttl: How long a renewal extends the lease. For a lease returned by ``holder()``
            (someone else's) it is the time left instead.
    """

    name: str
    owner: str
    fencing: int
    expires_at: float
    ttl: float


class LeaseBackend(Protocol):
    """Where leases live: Redis, PostgreSQL, a SQLite file or process memory.

    Every method exists in a sync and an async form. None of them blocks waiting for a busy
    name (``acquire`` answers at once); waiting is the holder's job. A backend that cannot
    be reached raises :class:`~taskpilots_graph.errors.LockBackendUnavailable`, never
    "not held": callers fail closed. Backends are context managers that close on exit.
    """

    @property
    def kind(self) -> str:
        """Short backend name for messages: ``"redis"``, ``"postgres"``, ..."""

    def setup(self) -> None:
        """Create what the backend needs (tables); idempotent, a no-op where nothing is."""

    def acquire(self, name: str, owner: str, ttl: float) -> Lease | None:
        """Take ``name`` for ``ttl`` seconds if it is free or expired, else ``None``.

        Acquiring again with the owner that already holds the lease refreshes its TTL and
        keeps its fencing token, so a retried request whose reply was lost does not lock
        its own caller out.
        """

    def renew(self, lease: Lease) -> Lease:
        """Extend ``lease`` by its ``ttl``; raises ``LeaseLost`` if it expired or was taken."""

    def release(self, lease: Lease) -> bool:
        """Delete the lease if (and only if) it is still ours; whether it was."""

    def holder(self, name: str) -> Lease | None:
        """The live lease on ``name``, whoever holds it, or ``None``."""

    def close(self) -> None:
        """Release the backend's sync connections."""

    async def asetup(self) -> None:
        """Async form of :meth:`setup`."""

    async def aacquire(self, name: str, owner: str, ttl: float) -> Lease | None:
        """Async form of :meth:`acquire`."""

    async def arenew(self, lease: Lease) -> Lease:
        """Async form of :meth:`renew`."""

    async def arelease(self, lease: Lease) -> bool:
        """Async form of :meth:`release`."""

    async def aholder(self, name: str) -> Lease | None:
        """Async form of :meth:`holder`."""

    async def aclose(self) -> None:
        """Release the backend's async (and sync) connections."""

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class LeaseBackendBase:
    """Context-manager plumbing and no-op setup shared by the bundled backends."""

    kind: str = "abstract"
    url: str | None = None

    def _require_url(self, side: str) -> str:
        """``url``, needed to open the side (sync or async) no ``side`` was given for."""
        if self.url is None:
            raise ConfigurationError(
                f"this {type(self).__name__} was given only a sync or only an async {side}; "
                f"pass url= (or the other {side}) to use the other side"
            )
        return self.url

    def setup(self) -> None:
        """Nothing to create by default."""

    async def asetup(self) -> None:
        """Nothing to create by default."""

    def close(self) -> None:
        """Nothing to close by default."""

    async def aclose(self) -> None:
        """Closes the sync side by default."""
        self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


# --- names and arguments --------------------------------------------------------------------


def _check_text(what: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"a lease {what} must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME_LENGTH:
        raise ConfigurationError(f"a lease {what} is limited to {MAX_NAME_LENGTH} characters")
    if "\x00" in value:
        # PostgreSQL TEXT cannot hold NUL; refusing it everywhere keeps backends alike.
        raise ConfigurationError(f"a lease {what} cannot contain NUL characters: {value!r}")


def check_lease_args(name: str, owner: str, ttl: float) -> None:
    """Validate ``acquire`` arguments the same way for every backend.

    Raises:
        ConfigurationError: For an empty or oversized name or owner, or a TTL outside
            [``MIN_TTL_S``, ``MAX_TTL_S``].
    """
    _check_text("name", name)
    _check_text("owner", owner)
    if not isinstance(ttl, int | float) or not math.isfinite(ttl) or ttl < MIN_TTL_S:
        raise ConfigurationError(f"lease ttl must be at least {MIN_TTL_S} s, got {ttl!r}")
    if ttl > MAX_TTL_S:
        raise ConfigurationError(
            f"lease ttl {ttl} s exceeds {MAX_TTL_S:.0f} s; renew a shorter lease instead"
        )


def thread_lease_name(thread_id: str) -> str:
    """The lease name of a LangGraph thread: ``thread:<thread_id>``."""
    _check_text("thread id", thread_id)
    return THREAD_LEASE_PREFIX + thread_id


def business_lock_name(object_id: str, operation: str) -> str:
    """The lease name of an operation on a business object: ``lock:<object_id>:<operation>``.

    The operation may not contain ``:``, so the name splits back unambiguously even when the
    object id does (``lock:a:b:c`` is object ``a:b``, operation ``c``).

    Raises:
        ConfigurationError: For an empty object id or operation, or ``:`` in the operation.
    """
    _check_text("business object id", object_id)
    _check_text("operation", operation)
    if ":" in operation:
        raise ConfigurationError(f"a lock operation cannot contain ':', got {operation!r}")
    return f"{BUSINESS_LOCK_PREFIX}{object_id}:{operation}"


def _process_space() -> str:
    """Eight hex digits naming this boot of this machine's process-id space, or ``""``.

    Two hosts (or two containers) may share a host name while their process ids mean
    different processes; the boot id and the pid namespace tell them apart. Where they
    cannot be read (not Linux), no process is ever judged dead by its id.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return hashlib.sha256(f"{boot}/{namespace}".encode()).hexdigest()[:8]


_HOST: Final = socket.gethostname()
_SPACE: Final = _process_space()


def new_owner() -> str:
    """A fresh owner token: ``host:pid:random``.

    Unique per acquisition, so a process never confuses its own old lease with a new one,
    and readable, so a ``ThreadBusy`` message says which machine and process hold the name.
    The random part starts with the process-id space (see :func:`holder_died`).
    """
    prefix = f"{_SPACE}." if _SPACE else ""
    return f"{_HOST}:{os.getpid()}:{prefix}{secrets.token_hex(8)}"


def holder_died(owner: str) -> bool:
    """Whether ``owner`` names a process of this machine (same boot, same pid namespace)
    that no longer exists.

    A holder killed with SIGKILL releases nothing: its lease would block the thread for the
    rest of its TTL, though the process is known to be gone. Only a token of the very
    process-id space we run in is judged, so an error can only be toward waiting: a live
    process, or one that reused the id, keeps the lease.
    """
    parts = owner.rsplit(":", 2)
    if not _SPACE or len(parts) != 3 or parts[0] != _HOST or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if not parts[2].startswith(f"{_SPACE}.") or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:
        return False  # it exists, owned by another user
    return False


def busy_error(name: str, current: Lease | None) -> ThreadBusy:
    """The error for a busy name, naming the holder if we could still see it."""
    if current is None:
        return ThreadBusy(name, None)
    return ThreadBusy(name, current.owner, expires_at=current.expires_at)


# --- decisions for read-then-write stores (memory, SQLite) -------------------------------------


def current_lease(lease: Lease | None, now: float) -> Lease | None:
    """``lease`` if it has not expired at ``now`` (the stored row may be a dead one)."""
    if lease is None or lease.expires_at <= now:
        return None
    return replace(lease, ttl=lease.expires_at - now)


def grant(
    stored: Lease | None, name: str, owner: str, ttl: float, now: float, last_fencing: int
) -> Lease | None:
    """What ``acquire`` stores: a new lease, the holder's own refreshed one, or ``None``.

    ``stored`` is the row for ``name`` (possibly expired) and ``last_fencing`` the highest
    token ever handed out; a new lease gets ``last_fencing + 1``.
    """
    live = current_lease(stored, now)
    if live is not None:
        if live.owner != owner:
            return None
        return replace(live, expires_at=now + ttl, ttl=ttl)
    return Lease(name, owner, last_fencing + 1, now + ttl, ttl)


def same_holder(stored: Lease | None, lease: Lease) -> bool:
    """Whether ``stored`` is the very acquisition ``lease`` came from (not just its name)."""
    return stored is not None and (stored.owner, stored.fencing) == (lease.owner, lease.fencing)


def extend(stored: Lease | None, lease: Lease, now: float) -> Lease | None:
    """What ``renew`` stores, or ``None`` if the lease expired or changed hands."""
    if not same_holder(current_lease(stored, now), lease):
        return None
    return replace(lease, expires_at=now + lease.ttl)


# --- a holder's view of its own lease -----------------------------------------------------------


def local_deadline(sent_at: float, ttl: float) -> float:
    """Until when (monotonic) a holder may trust a lease granted on a request sent at ``sent_at``.

    The backend starts the TTL when it *receives* the request, after ``sent_at``, so this
    never overshoots the backend's expiry except by clock drift, which the margin covers.
    """
    return sent_at + ttl - (ttl * _DRIFT_FACTOR + _DRIFT_FLOOR_S)


@dataclass(frozen=True, slots=True)
class HoldStatus:
    """What a holder knows about its lease; replaced as a whole, never mutated.

    The heartbeat swaps in a new status after each renewal while the caller reads it from
    another thread or task, so one immutable value avoids torn reads without a lock. A lost
    status never heals: once the local deadline has passed, a late "renewed" reply does not
    revive it (a caller may already have stopped on ``LeaseLost``).
    """

    lease: Lease
    valid_until: float
    lost_reason: str | None = None
    failures: int = 0

    @classmethod
    def granted(cls, lease: Lease, sent_at: float) -> HoldStatus:
        """The status right after ``acquire`` returned ``lease``."""
        return cls(lease, local_deadline(sent_at, lease.ttl))

    def lost_at(self, now: float) -> str | None:
        """Why the lease cannot be trusted at monotonic time ``now``, or ``None`` if it can."""
        if self.lost_reason is not None:
            return self.lost_reason
        if now >= self.valid_until:
            why = "the backend was unreachable" if self.failures else "it was not renewed"
            return f"its ttl of {self.lease.ttl:g} s passed: {why}"
        return None

    def renewed(self, lease: Lease, sent_at: float, received_at: float) -> HoldStatus:
        """The status after a renewal sent at ``sent_at`` succeeded at ``received_at``."""
        if (reason := self.lost_at(received_at)) is not None:
            return replace(self, lost_reason=reason)
        return replace(
            self, lease=lease, valid_until=local_deadline(sent_at, lease.ttl), failures=0
        )

    def taken(self, reason: str) -> HoldStatus:
        """The status after the backend said the lease is gone (expired or taken)."""
        return replace(self, lost_reason=self.lost_reason or reason)

    def unreachable(self) -> HoldStatus:
        """The status after a renewal could not reach the backend (maybe a short blip)."""
        return replace(self, failures=self.failures + 1)

    def next_beat(self, interval: float) -> float:
        """Seconds until the next renewal: sooner while the backend is failing.

        A blip shorter than the TTL must not cost the lease, so failed renewals are retried
        three times as often; the lease is lost only when its local deadline passes.
        """
        return interval / 3 if self.failures else interval


def poll_delay(attempt: int, remaining: float | None) -> float:
    """Pause before retrying a busy name: 20 ms doubling to 0.5 s, jittered, never past the wait.

    Jitter keeps several waiters from polling in lock-step; the cap keeps the pick-up delay
    after a release short.
    """
    delay = min(0.5, 0.02 * 2.0 ** min(attempt, 10)) * random.uniform(0.5, 1.0)
    return delay if remaining is None else max(0.0, min(delay, remaining))


# --- the thread lease of the current run ------------------------------------------------------

THREAD_HOLD: Final[contextvars.ContextVar[Any]] = contextvars.ContextVar(
    "taskpilots_thread_hold", default=None
)
"""The ``Hold`` / ``AsyncHold`` of the thread lease the current run holds, or ``None``.

Set by the runners through :func:`taskpilots_graph.locks.set_thread_hold`, which with
:func:`~taskpilots_graph.locks.current_thread_hold` gives it its type; typed loosely here
because the holder classes live above this module."""


def held_thread_lease(thread_id: str) -> object | None:
    """The current run's hold of ``thread:<thread_id>``, if this context holds that lease.

    Its identity names the run's tenure of the thread (the recovery store keys per-tenure
    memos on it).
    """
    held = THREAD_HOLD.get()
    return held if held is not None and held.name == thread_lease_name(thread_id) else None
