"""The thread lease of a run, taken once per call and re-entrant.

Every entry point that runs a thread (``invoke`` / ``stream`` / ``ainvoke`` / ``astream`` on a
recovery graph, ``tp.run`` / ``resume`` / ``decide`` / ``rewind``, the workers, the supervisor,
the coordinator) holds ``thread:<thread_id>`` for the whole call, so two runners of one
thread never interleave their writes: the second gets
:class:`~taskpilots_graph.errors.ThreadBusy` at once, or waits with ``wait=True``.

The guard is re-entrant: a runner that already holds the thread's lease in the current
context (``tp.run`` calling ``graph.invoke``) is not asked to acquire it again, which would
make it wait for itself. A lease that has been lost raises
:class:`~taskpilots_graph.errors.LeaseLost` instead of being taken anew behind the back of
the runner that lost it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

from taskpilots_graph.leases import LeaseBackend, thread_lease_name
from taskpilots_graph.locks.heartbeat import AsyncHold, Hold
from taskpilots_graph.locks.hold import (
    ahold,
    current_thread_hold,
    hold,
    reset_thread_hold,
    set_thread_hold,
)

__all__ = ["aguard_thread", "guard_thread", "held_here"]

_Token = contextvars.Token[Hold | AsyncHold | None]


def held_here(thread_id: str) -> Hold | AsyncHold | None:
    """The live hold of ``thread:<thread_id>`` this context already has, if any.

    Raises:
        LeaseLost: The context held the lease but lost it; stop before doing more.
    """
    held = current_thread_hold()
    if held is None or held.released or held.name != thread_lease_name(thread_id):
        return None
    held.check()
    return held


def _reset(token: _Token) -> None:
    # A stream consumed from another context than the one it started in cannot reset the
    # value there; that context's value goes with it, and the hold is marked released.
    with contextlib.suppress(ValueError):
        reset_thread_hold(token)


@contextmanager
def guard_thread(
    backend: Callable[[], LeaseBackend], ttl: float, thread_id: str, *, wait: bool
) -> Iterator[Hold | AsyncHold]:
    """Hold ``thread:<thread_id>`` for the block, unless this context already holds it.

    Args:
        backend: Gives the lease backend (called only when the lease must be taken).
        ttl: The lease's TTL; the heartbeat renews it every third.
        thread_id: The thread.
        wait: Wait for another holder instead of raising ``ThreadBusy``.

    Raises:
        ThreadBusy: Another runner holds the thread (and ``wait`` is false).
        LeaseLost: This context held the lease and lost it.
        LockBackendUnavailable: The backend is unreachable; nothing ran.
    """
    held = held_here(thread_id)
    if held is not None:
        yield held
        return
    with hold(backend(), thread_lease_name(thread_id), ttl=ttl, wait=wait) as fresh:
        token = set_thread_hold(fresh)
        try:
            yield fresh
        finally:
            _reset(token)


@asynccontextmanager
async def aguard_thread(
    backend: Callable[[], Awaitable[LeaseBackend]], ttl: float, thread_id: str, *, wait: bool
) -> AsyncIterator[Hold | AsyncHold]:
    """Async form of :func:`guard_thread`."""
    held = held_here(thread_id)
    if held is not None:
        yield held
        return
    async with ahold(await backend(), thread_lease_name(thread_id), ttl=ttl, wait=wait) as fresh:
        token = set_thread_hold(fresh)
        try:
            yield fresh
        finally:
            _reset(token)
