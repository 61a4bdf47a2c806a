"""The thread lease around each step of :class:`RecoveryMiddleware`.

langchain's ``create_agent`` builds the graph, so the middleware cannot wrap the whole run
the way the recovery agent's own graph does: no hook spans a run and is sure to run again
when it ends by an exception or an interrupt. It holds the thread lease around each step
it wraps instead (each model call and each tool call), which covers every side effect. A
runner that already holds the lease (``tp.run``, ``tp.resume``, ... always do) is not asked
again: then the lease spans the whole run.

The tool calls of one model message run in parallel (one task each, from one checkpoint):
they share one hold, counted, so they do not lock each other out. Business locks (``lock=``)
are the engine driver's, as in the recovery agent's executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from taskpilots_graph.guard import held_here
from taskpilots_graph.leases import LeaseBackend, thread_lease_name
from taskpilots_graph.locks.heartbeat import AsyncHold, Hold
from taskpilots_graph.locks.hold import (
    ahold,
    hold,
    reset_thread_hold,
    set_thread_hold,
)

__all__ = ["StepLeases"]

_Key = tuple[str, str | None]


@dataclass
class _Shared:
    held: Hold | AsyncHold
    exit: Callable[[], Any]
    users: int = 1


@dataclass
class StepLeases:
    """Thread leases held around the middleware's steps, shared by parallel steps of a run."""

    backend: Callable[[], LeaseBackend]
    abackend: Callable[[], Awaitable[LeaseBackend]]
    ttl: float
    _shared: dict[_Key, _Shared] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _alocks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = field(
        default_factory=weakref.WeakKeyDictionary
    )

    def _release(self, key: _Key, shared: _Shared, token: Any) -> Callable[[], Any] | None:
        with contextlib.suppress(ValueError):
            reset_thread_hold(token)
        with self._lock:
            shared.users -= 1
            if shared.users:
                return None
            del self._shared[key]
            return shared.exit

    @contextlib.contextmanager
    def step(self, thread_id: str, run: str | None) -> Iterator[None]:
        """Hold ``thread:<thread_id>`` for a step of the run that started from ``run``."""
        if held_here(thread_id) is not None:
            yield
            return
        key = (thread_id, run)
        with self._lock:  # acquired under the lock: parallel calls of a step share one hold
            shared = self._shared.get(key)
            if shared is not None:
                shared.users += 1
            else:
                stack = contextlib.ExitStack()
                held = stack.enter_context(
                    hold(self.backend(), thread_lease_name(thread_id), ttl=self.ttl)
                )
                shared = self._shared[key] = _Shared(held, stack.close)
        token = set_thread_hold(shared.held)
        try:
            yield
        finally:
            done = self._release(key, shared, token)
            if done is not None:
                done()

    def _alock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        with self._lock:
            found = self._alocks.get(loop)
            if found is None:
                found = self._alocks[loop] = asyncio.Lock()
            return found

    @contextlib.asynccontextmanager
    async def astep(self, thread_id: str, run: str | None) -> AsyncIterator[None]:
        """Async form of :meth:`step`."""
        if held_here(thread_id) is not None:
            yield
            return
        key = (thread_id, run)
        async with self._alock():
            with self._lock:
                shared = self._shared.get(key)
                if shared is not None:
                    shared.users += 1
            if shared is None:
                stack = contextlib.AsyncExitStack()
                backend = await self.abackend()
                held = await stack.enter_async_context(
                    ahold(backend, thread_lease_name(thread_id), ttl=self.ttl)
                )
                with self._lock:
                    shared = self._shared[key] = _Shared(held, stack.aclose)
        token = set_thread_hold(shared.held)
        try:
            yield
        finally:
            done = self._release(key, shared, token)
            if done is not None:
                await done()
