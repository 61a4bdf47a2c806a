"""Carrying out the protocol's :class:`~taskpilots_graph.engine._requests.AwaitOwner`.

An ``intended`` ledger entry is either an orphan (its writer crashed: reconcile it) or the
footprint of a call running right now in another runner (a business key shared by two
threads or agents). The two look the same in the ledger; the writer's thread lease tells
them apart, since every runner holds ``thread:<thread_id>`` while its graph runs (the
runner is the entry's thread, or the thread that executes it again under a shared business
key: :func:`~taskpilots_graph.ledger.runner_of`). While another runner holds it, the entry
is re-read until it leaves ``intended`` or the lease is gone, bounded by ``timeout``.

One body serves both drivers of the protocol, sync and async (:mod:`taskpilots_graph._twins`).
"""

from __future__ import annotations

import asyncio
import time

from taskpilots_graph._twins import Steps, both, io
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.engine._requests import Awaited, AwaitOwner, in_flight
from taskpilots_graph.guard import held_here
from taskpilots_graph.leases import Lease, LeaseBackend, holder_died, poll_delay, thread_lease_name
from taskpilots_graph.ledger import runner_of

__all__ = ["await_owner"]


def _live(lease: Lease | None) -> Lease | None:
    """``lease`` unless its holder is a process of this machine that is gone (SIGKILL)."""
    return None if lease is None or holder_died(lease.owner) else lease


def await_owner(
    request: AwaitOwner, *, backend: LeaseBackend, cp: RecoveryAPI, timeout: float
) -> Steps[Awaited]:
    """Wait while another runner holds the lease of the entry's thread (re-reading the
    entry from ``cp``)."""
    entry = request.entry
    runner = runner_of(entry)
    name = thread_lease_name(runner)
    # Our own thread's intent (its writer crashed, we hold the lease now), or an orphan.
    if (
        held_here(runner) is not None
        or (owner := _live((yield io(backend, "holder", name)))) is None
    ):
        return Awaited(entry)
    start = time.monotonic()
    deadline = start + timeout
    attempt = 0
    while True:
        delay = poll_delay(attempt, max(0.0, deadline - time.monotonic()))
        yield both(time.sleep, asyncio.sleep, delay)
        attempt += 1
        found = yield io(cp, "ledger_entry", entry.key)
        waited = time.monotonic() - start
        if not in_flight(found) or _live((yield io(backend, "holder", name))) is None:
            return Awaited(found, owner.owner, waited)
        if time.monotonic() >= deadline:
            return Awaited(found, owner.owner, waited, timed_out=True)
