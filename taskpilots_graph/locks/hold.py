"""Holding a lease for a block of work: acquire, heartbeat, check, release.

::

    with hold(backend, thread_lease_name("t-1"), ttl=30) as held:
        ...
        held.check()               # before every side effect: raises LeaseLost if not ours
        crm.create(..., fencing=held.fencing)

The holders and their heartbeat (every ``ttl / 3``, judged locally) are in :mod:`.heartbeat`.

``check()`` narrows the window in which a superseded holder acts, it cannot close it (a
pause can fall between the check and the effect). The fencing token closes it wherever the
resource can compare tokens, e.g. the ledger row written in the same transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Final

from taskpilots_graph._twins import Steps, arun_steps, both, io, run_steps
from taskpilots_graph.errors import ConfigurationError
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
from taskpilots_graph.locks.heartbeat import AsyncHold, Hold

__all__ = [
    "abusiness_lock",
    "ahold",
    "business_lock",
    "current_thread_hold",
    "hold",
    "reset_thread_hold",
    "set_thread_hold",
]

_log: Final = logging.getLogger("taskpilots_graph.locks")


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


def _acquiring(
    backend: LeaseBackend, name: str, owner: str, ttl: float, wait: bool, timeout: float | None
) -> Steps[HoldStatus]:
    waiting, deadline = _wait_deadline(wait, timeout)
    attempt = 0
    while True:
        sent_at = time.monotonic()
        if (lease := (yield io(backend, "acquire", name, owner, ttl))) is not None:
            return HoldStatus.granted(lease, sent_at)
        current = yield io(backend, "holder", name)
        dead = current is not None and holder_died(current.owner)
        if dead and (yield io(backend, "release", current)):
            _took_over(name, current)
            continue
        remaining = None if deadline is None else deadline - time.monotonic()
        if not waiting or (remaining is not None and remaining <= 0):
            raise busy_error(name, current)
        yield both(time.sleep, asyncio.sleep, poll_delay(attempt, remaining))
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
        The :class:`~.heartbeat.Hold`: ``.fencing``, ``.lost``, ``.check()``, ``.remaining()``.

    Raises:
        ThreadBusy: The name is held by someone else (after waiting, if asked to).
        LockBackendUnavailable: The backend cannot be reached; nothing was acquired.
    """
    interval = _interval(ttl, heartbeat)
    status = run_steps(_acquiring(backend, name, owner or new_owner(), ttl, wait, timeout))
    held = Hold(backend, status, interval)
    held._start()  # beats once the first renewal is due
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
    status = await arun_steps(_acquiring(backend, name, owner or new_owner(), ttl, wait, timeout))
    held = AsyncHold(backend, status, interval)
    held._start()
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
