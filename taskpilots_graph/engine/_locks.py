"""The guards of one side-effecting call, shared by both drivers of the protocol.

Before a side effect's first intent is written, the run's thread lease is checked (a run
that lost it stops with :class:`~taskpilots_graph.errors.LeaseLost` before anything
happens) and a ``lock=`` tool takes its business lock, kept until the call is settled; its
fencing token goes on every ledger write of the call (``extra["fencing"]``) and into
``current_invocation().fencing``. Just before the tool runs, both are checked again. A lock
that cannot be taken raises (``ThreadBusy``, ``LockBackendUnavailable``) before anything is
written: the call fails closed. The recovery agent's executor and ``RecoveryMiddleware``
carry these out alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from taskpilots_graph.guard import held_here
from taskpilots_graph.leases import LeaseBackend
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus
from taskpilots_graph.locks.hold import abusiness_lock, business_lock
from taskpilots_graph.tools import Invocation

__all__ = ["CallLocks", "lock_target"]


def lock_target(name: str, tool: str) -> tuple[str, str]:
    """The (business object, operation) a ``lock=`` name stands for.

    ``"order-42:refund"`` splits on its *last* ``:`` into ``("order-42", "refund")`` (so
    object ids may contain ``:``); a name without a ``:`` (or with nothing on one side of
    it) is the object id as a whole, and the operation is the tool's name.
    """
    object_id, sep, operation = name.rpartition(":")
    if sep and object_id and operation:
        return object_id, operation
    return name, tool


@dataclass
class CallLocks:
    """The thread-lease checks and the business lock of one call (driver state)."""

    thread_id: str
    ttl: float
    fencing: int | None = None
    _check: Callable[[], None] | None = None
    _taken: set[str] = field(default_factory=set)
    _started: bool = False

    def _target(self, entry: LedgerEntry) -> tuple[str, str] | None:
        if entry.status is LedgerStatus.INTENDED and not self._started:
            # About to execute: the last point where nothing has happened yet.
            self._started = True
            self._check_thread()
        # Once per lock name: a retry keeps the lock it holds, a fallback takes its own.
        if entry.status is not LedgerStatus.INTENDED or not entry.lock or entry.lock in self._taken:
            return None
        self._taken.add(entry.lock)
        return lock_target(entry.lock, entry.tool)

    def before_write(
        self, entry: LedgerEntry, backend: Callable[[], LeaseBackend], stack: contextlib.ExitStack
    ) -> LedgerEntry:
        """Take the entry's business lock before its first intent (raises if it cannot)."""
        if (target := self._target(entry)) is not None:
            held = stack.enter_context(
                business_lock(backend(), *target, ttl=self.ttl, timeout=self.ttl)
            )
            self._check, self.fencing = held.check, held.fencing
        return self.stamp(entry)

    async def abefore_write(
        self,
        entry: LedgerEntry,
        backend: Callable[[], Awaitable[LeaseBackend]],
        stack: contextlib.AsyncExitStack,
    ) -> LedgerEntry:
        """Async form of :meth:`before_write`."""
        if (target := self._target(entry)) is not None:
            held = await stack.enter_async_context(
                abusiness_lock(await backend(), *target, ttl=self.ttl, timeout=self.ttl)
            )
            self._check, self.fencing = held.check, held.fencing
        return self.stamp(entry)

    def stamp(self, entry: LedgerEntry) -> LedgerEntry:
        if self.fencing is None or entry.extra.get("fencing") == self.fencing:
            return entry
        return replace(entry, extra={**entry.extra, "fencing": self.fencing})

    def _check_thread(self) -> None:
        if (held := held_here(self.thread_id)) is not None:  # LeaseLost if the run's lease was lost
            held.check()

    def before_call(self, invocation: Invocation) -> Invocation:
        """Check the thread lease and the business lock just before the tool runs."""
        self._check_thread()
        if self._check is not None:
            self._check()
        return invocation if self.fencing is None else replace(invocation, fencing=self.fencing)
