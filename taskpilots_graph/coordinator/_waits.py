"""Business locks whose waits are visible, so a coordinator can see sub-agents waiting on
each other.

A tool that needs a second business object while it holds one (or holds a lock across
steps) takes it with :func:`await_lock`. Besides the lock itself, two facts go to the lease
backend where every coordinator can read them:

* the *holder*: the lock's owner token starts with the holding thread
  (``<thread_id>|host:pid:random``);
* the *wait*: while the lock is busy, a lease ``wait:<thread_id>`` whose owner is the lock
  name waited for, refreshed on every poll and gone with the process.

From them a coordinator draws the wait-for graph of its sub-agents (thread ``T`` waits for
a lock held by thread ``U``); a cycle is a mutual wait that no timeout would end well. The
coordinator reports it as STUCK and marks the waiting threads (``stuck:<thread_id>``); a
marked :func:`await_lock` stops with :class:`MutualWait` (failure kind ``stuck``: the
sub-agent escalates to a person instead of retrying blindly).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Final

from taskpilots_graph.errors import ConfigurationError, MutualWait
from taskpilots_graph.leases import (
    LeaseBackend,
    business_lock_name,
    busy_error,
    new_owner,
    poll_delay,
)
from taskpilots_graph.locks.heartbeat import Hold
from taskpilots_graph.locks.hold import hold
from taskpilots_graph.tools import current_invocation

__all__ = [
    "STUCK_PREFIX",
    "WAIT_PREFIX",
    "await_lock",
    "holder_thread",
    "wait_edges",
]

WAIT_PREFIX: Final = "wait:"
STUCK_PREFIX: Final = "stuck:"
_SEP: Final = "|"


def holder_thread(owner: str) -> str | None:
    """The thread that holds a lock taken by :func:`await_lock` (from its owner token)."""
    thread, sep, _ = owner.partition(_SEP)
    return thread if sep else None


@contextmanager
def await_lock(
    backend: LeaseBackend,
    object_id: str,
    operation: str,
    *,
    ttl: float,
    timeout: float | None = None,
    thread_id: str | None = None,
) -> Iterator[Hold]:
    """Hold the business lock ``lock:<object_id>:<operation>``, waiting for it visibly.

    Use it inside a tool (the thread id then comes from ``current_invocation()``) or
    pass ``thread_id``.

    Args:
        backend: The lease backend the coordinator watches.
        object_id: The business object, e.g. ``"customer-7"``.
        operation: The operation, e.g. ``"update"``.
        ttl: Lease TTL of the lock (renewed in the background while held).
        timeout: The longest to wait; ``None`` waits until the lock is free or the
            coordinator reports a mutual wait.
        thread_id: The waiting thread (default: the current tool call's).

    Raises:
        MutualWait: The coordinator found the wait in a cycle.
        ThreadBusy: ``timeout`` passed with the lock still held elsewhere.
        LockBackendUnavailable: The backend is unreachable (nothing runs unlocked).
    """
    thread = thread_id or current_invocation().thread_id
    if _SEP in thread:
        raise ConfigurationError(f"thread ids used with await_lock cannot contain {_SEP!r}")
    name = business_lock_name(object_id, operation)
    owner = f"{thread}{_SEP}{new_owner()}"
    deadline = None if timeout is None else time.monotonic() + timeout
    waiting = f"{WAIT_PREFIX}{thread}"
    announced = None
    attempt = 0
    try:
        while backend.acquire(name, owner, ttl) is None:
            if backend.holder(STUCK_PREFIX + thread) is not None:
                raise MutualWait(thread, name)
            # Refreshed every poll: a killed waiter's announcement expires with its TTL.
            announced = backend.acquire(waiting, name, ttl) or announced
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise busy_error(name, backend.holder(name))
            time.sleep(poll_delay(attempt, remaining))
            attempt += 1
    finally:
        if announced is not None:
            backend.release(announced)
    # Already ours: hold() re-acquires with the same owner (same fencing) and heartbeats.
    with hold(backend, name, ttl=ttl, owner=owner) as held:
        yield held


def wait_edges(backend: LeaseBackend, threads: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Who waits for whom among ``threads`` (thread id -> sub-agent name).

    Returns:
        ``{waiting sub-agent: (holding sub-agent, lock name)}`` for every announced wait
        whose lock is held by another of the threads.
    """
    edges: dict[str, tuple[str, str]] = {}
    for thread, name in threads.items():
        wait = backend.holder(WAIT_PREFIX + thread)
        if wait is None:
            continue
        lock = backend.holder(wait.owner)
        holder = holder_thread(lock.owner) if lock is not None else None
        if holder is not None and holder in threads and holder != thread:
            edges[name] = (threads[holder], wait.owner)
    return edges
