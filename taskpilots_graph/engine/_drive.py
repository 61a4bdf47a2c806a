"""The one sync and the one async driver of the ledger protocol's requests.

They serve every caller (the executor, ``RecoveryMiddleware``, an undo, an orphan intent):
ledger reads and writes (a write carries the events buffered before it), the wait for a
live intent's owner, the pre-check and the tool, with the call's thread lease and business
lock (:class:`~._locks.CallLocks`), in one body that each driver runs in its form
(:mod:`taskpilots_graph._twins`). Callers differ only in ``run_tool``, ``check_args`` and
the requests of their own (``other``); both agent forms drive their calls, and settle the
events the calls leave, through :class:`LeaseOwner`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar, cast

from langgraph.config import get_config

from taskpilots_graph._compat import task_durability, task_id
from taskpilots_graph._twins import IO, Steps, arun_steps, both, io, run_steps
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.engine._await import await_owner
from taskpilots_graph.engine._locks import CallLocks
from taskpilots_graph.engine._precheck import acall_precheck, call_precheck
from taskpilots_graph.engine._requests import (
    AwaitOwner,
    CheckArgs,
    FindPrevious,
    FindRepeat,
    ReadEntry,
    RunPrecheck,
    RunTool,
    WriteEntry,
    WriteEvent,
    latest_successes,
)
from taskpilots_graph.errors import ConfigurationError, LedgerConflict
from taskpilots_graph.events import EventRecord
from taskpilots_graph.leases import LeaseBackend
from taskpilots_graph.locks import adefault_lease_backend, default_lease_backend
from taskpilots_graph.tools import reset_invocation, set_invocation

__all__ = ["AsyncDriver", "Driver", "LeaseOwner"]

T = TypeVar("T")
_LOCAL = object()  # marker: the request needs I/O


class LeaseOwner:
    """Where an adapter's thread leases and business locks live: the backend named with
    ``leases=``, else the checkpointer's own database (so ``lock=`` is always enforced);
    and the adapter's calls driven under them."""

    checkpointer: RecoveryAPI
    leases: LeaseBackend | None
    lease_ttl: float

    def _set_leases(self, leases: LeaseBackend | None, lease_ttl: float) -> None:
        if not isinstance(lease_ttl, int | float) or not math.isfinite(lease_ttl) or lease_ttl <= 0:
            raise ConfigurationError(f"lease_ttl must be a positive number, got {lease_ttl!r}")
        self.leases, self.lease_ttl = leases, float(lease_ttl)

    def lease_backend(self) -> LeaseBackend:
        return self.leases if self.leases is not None else default_lease_backend(self.checkpointer)

    async def alease_backend(self) -> LeaseBackend:
        """Async form of :meth:`lease_backend`."""
        cp = self.checkpointer
        return self.leases if self.leases is not None else await adefault_lease_backend(cp)

    def _driven(
        self,
        thread_id: str,
        gen: Generator[Any, Any, T],
        run_tool: Callable[[RunTool], Steps[Any]],
        pending: list[EventRecord],
        check_args: Callable[[dict[str, Any]], object] | None = None,
        other: Callable[[Any], Steps[Any]] | None = None,
    ) -> Steps[T]:
        """Carry out ``gen``'s requests with the driver of the form the caller runs in;
        ``run_tool`` and ``other`` (its own requests) are bodies run in that form too, and
        ``pending`` holds the events waiting for the next write (see :meth:`_settled`)."""

        def form(kind: type[Driver | AsyncDriver], run: Callable[..., Any], backend: Any) -> Any:
            tool = lambda request: run(run_tool(request))  # noqa: E731
            own = None if other is None else (lambda request: run(other(request)))
            args = (self.checkpointer, thread_id, backend, self.lease_ttl, tool, check_args, own)
            return partial(kind(*args, pending).drive, gen)

        sync = form(Driver, run_steps, self.lease_backend)
        done: T = yield IO(sync, form(AsyncDriver, arun_steps, self.alease_backend))
        return done

    def _settled(self, thread_id: str, pending: list[EventRecord], body: Steps[T]) -> Steps[T]:
        """``body``'s result; the events in ``pending`` then ride along with the thread's next
        durable write, or are written at once (with the thread's deferred ones) if it fails."""
        try:
            result = yield from body
        except BaseException:
            yield io(self.checkpointer, "append_records", pending, flush=thread_id)
            raise
        self.checkpointer.defer_records(pending)
        return result


def _task_id() -> str | None:
    """The LangGraph task this call runs in (its put_writes can carry a commit); ``None``
    outside a task, or where put_writes are not written per task (``durability="exit"``)."""
    try:
        config = get_config()
    except RuntimeError:  # not inside a graph's task
        return None
    return None if task_durability(config) == "exit" else task_id(config)


def _held(cp: RecoveryAPI, request: WriteEntry, events: list[EventRecord]) -> bool:
    """Whether a commit that may ride was handed to the checkpointer for its task's
    put_writes (see ``RecoveryAPI.hold_commit``) instead of being written now."""
    if not request.may_ride or (task := _task_id()) is None:
        return False
    return cp.hold_commit(request.entry, expect=request.expect, events=events, task_id=task)


@dataclass
class _Carrier:
    """What both drivers share; ``pending`` holds the events that wait for the next durable
    write, shared with the caller, who flushes what is left when the call ends."""

    cp: RecoveryAPI
    thread_id: str
    backend: Callable[[], Any]  # the lease backend (async driver: a coroutine function)
    ttl: float
    run_tool: Callable[[RunTool], Any] | None  # None: the caller's protocol runs no tool
    check_args: Callable[[dict[str, Any]], object] | None = None
    other: Callable[[Any], Any] | None = None  # the caller's own requests
    pending: list[EventRecord] = field(default_factory=list)

    def _guarded(self, request: Any, locks: CallLocks) -> Any:
        # Before the try of the loop: a lost lease stops the run before the effect; it is no
        # failure of the tool, and the protocol must not record it as one.
        if isinstance(request, RunTool) and request.effect:
            return replace(request, invocation=locks.before_call(request.invocation))
        return request

    def _local(self, request: Any) -> Any:
        """The answer to a request that needs no I/O, else ``_LOCAL``."""
        if isinstance(request, CheckArgs):
            return None if self.check_args is None else self.check_args(request.args)
        if isinstance(request, WriteEvent):
            self.pending.append(request.event)
            return None
        return _LOCAL

    def _drive(self, gen: Generator[Any, Any, T], held: Any) -> Steps[T]:
        """Both drivers' loop; ``held``: the (async) exit stack of the call's business lock."""
        locks = CallLocks(self.thread_id, self.ttl)
        value: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                request = gen.throw(thrown) if thrown is not None else gen.send(value)
            except StopIteration as stop:
                return cast(T, stop.value)
            value, thrown = None, None
            request = self._guarded(request, locks)
            try:
                if isinstance(request, WriteEntry):
                    take = (locks.before_write, locks.abefore_write)
                    entry = yield both(*take, request.entry, self.backend, held)
                    value = yield from self._write(replace(request, entry=entry))
                elif (value := self._local(request)) is _LOCAL:
                    value = yield from self._io(request)
            except Exception as exc:  # the protocol lets LangGraph control flow through
                thrown = exc

    def _write(self, request: WriteEntry) -> Steps[Any]:
        entry, expect = request.entry, request.expect
        with self._batched(request) as events:
            # Only the sync saver's put_writes carry a commit (``RecoveryAPI.hold_commit``).
            if (yield both(_held, lambda *_: False, self.cp, request, events)):
                return []
            return (yield io(self.cp, "write_ledger", entry, expect=expect, events=events))

    def _io(self, request: Any) -> Steps[Any]:
        """The answer to a request that needs I/O, in one body for both drivers (the async
        driver's ``backend``, ``run_tool`` and ``other`` return awaitables)."""
        cp = self.cp
        if isinstance(request, RunTool):
            assert self.run_tool is not None, "this caller's protocol runs no tool"
            token = set_invocation(request.invocation)
            try:
                return (yield both(self.run_tool, self.run_tool, request))
            finally:
                reset_invocation(token)
        if isinstance(request, FindRepeat):
            asked = (request.thread_id, request.tool, request.args_digest)
            return (yield io(cp, "committed_effect", *asked))
        if isinstance(request, FindPrevious):
            latest = latest_successes((yield io(cp, "events", request.thread_id)))
            return latest.get((request.key, request.tool_call_id))
        if isinstance(request, ReadEntry):
            return (yield io(cp, "ledger_entry", request.key, thread_id=request.thread_id))
        if isinstance(request, AwaitOwner):
            backend = yield both(self.backend, self.backend)
            return (yield from await_owner(request, backend=backend, cp=cp, timeout=self.ttl))
        if isinstance(request, RunPrecheck):
            assert request.call is not None, "the protocol names the call it asks about"
            return (yield both(call_precheck, acall_precheck, request.call, request))
        assert self.other is not None, f"unexpected request {request!r}"
        return (yield both(self.other, self.other, request))

    @contextlib.contextmanager
    def _batched(self, request: WriteEntry) -> Iterator[list[EventRecord]]:
        """The events to write with ``request``'s entry: those pending, then its own."""
        events = [*self.pending, request.event]
        self.pending.clear()
        try:
            yield events
        except LedgerConflict:
            self.pending[:0] = events[:-1]  # nothing was written: the events wait for the next
            raise


@dataclass
class Driver(_Carrier):
    """Carries out one call's requests synchronously (see the module)."""

    def drive(self, gen: Generator[Any, Any, T]) -> T:
        """Run ``gen`` to its end; each answer (or error) of a request is sent back into it."""
        with contextlib.ExitStack() as held:
            return run_steps(self._drive(gen, held))


@dataclass
class AsyncDriver(_Carrier):
    """Carries out one call's requests asynchronously (see the module)."""

    async def drive(self, gen: Generator[Any, Any, T]) -> T:
        """Async form of :meth:`Driver.drive`."""
        async with contextlib.AsyncExitStack() as held:
            return await arun_steps(self._drive(gen, held))
