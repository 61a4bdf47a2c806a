"""Carrying out the protocol's :class:`~taskpilots_graph.engine._protocol.AwaitOwner`.

An ``intended`` ledger entry is either an orphan (its writer crashed: reconcile it) or the
footprint of a call running right now in another runner (a business key shared by two
threads or agents). The two look the same in the ledger; the writer's thread lease tells
them apart, since every runner holds ``thread:<thread_id>`` while its graph runs (the
runner is the entry's thread, or the thread that executes it again under a shared business
key: :func:`~taskpilots_graph.ledger.runner_of`). While
another runner holds it, the entry is re-read until it leaves ``intended`` or the lease is
gone, bounded by ``timeout``.

Shared by both drivers of the protocol (the recovery agent's executor and
``RecoveryMiddleware``), sync and async.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from taskpilots_graph.engine._protocol import Awaited, AwaitOwner, in_flight
from taskpilots_graph.guard import held_here
from taskpilots_graph.leases import (
    Lease,
    LeaseBackend,
    holder_died,
    poll_delay,
    thread_lease_name,
)
from taskpilots_graph.ledger import LedgerEntry, runner_of

__all__ = ["aawait_owner", "await_owner"]


def _live(lease: Lease | None) -> Lease | None:
    """``lease`` unless its holder is a process of this machine that is gone (SIGKILL)."""
    return None if lease is None or holder_died(lease.owner) else lease


def await_owner(
    request: AwaitOwner,
    *,
    backend: LeaseBackend,
    read: Callable[[str], LedgerEntry | None],
    timeout: float,
) -> Awaited:
    """Wait (sync) while another runner holds the lease of the entry's thread."""
    entry = request.entry
    runner = runner_of(entry)
    name = thread_lease_name(runner)
    # Our own thread's intent (its writer crashed, we hold the lease now), or an orphan.
    if held_here(runner) is not None or (owner := _live(backend.holder(name))) is None:
        return Awaited(entry)
    start = time.monotonic()
    deadline = start + timeout
    attempt = 0
    while True:
        time.sleep(poll_delay(attempt, max(0.0, deadline - time.monotonic())))
        attempt += 1
        found = read(entry.key)
        waited = time.monotonic() - start
        if not in_flight(found) or _live(backend.holder(name)) is None:
            return Awaited(found, owner.owner, waited)
        if time.monotonic() >= deadline:
            return Awaited(found, owner.owner, waited, timed_out=True)


async def aawait_owner(
    request: AwaitOwner,
    *,
    backend: LeaseBackend,
    read: Callable[[str], Awaitable[LedgerEntry | None]],
    timeout: float,
) -> Awaited:
    """Async form of :func:`await_owner`."""
    entry = request.entry
    runner = runner_of(entry)
    name = thread_lease_name(runner)
    if held_here(runner) is not None or (owner := _live(await backend.aholder(name))) is None:
        return Awaited(entry)
    start = time.monotonic()
    deadline = start + timeout
    attempt = 0
    while True:
        await asyncio.sleep(poll_delay(attempt, max(0.0, deadline - time.monotonic())))
        attempt += 1
        found = await read(entry.key)
        waited = time.monotonic() - start
        if not in_flight(found) or _live(await backend.aholder(name)) is None:
            return Awaited(found, owner.owner, waited)
        if time.monotonic() >= deadline:
            return Awaited(found, owner.owner, waited, timed_out=True)
