"""What rides along with another durable write, and the primitives every section of the
recovery methods (:class:`~._api.RecoveryAPI`) shares.

A subclass reaches its store with ``_call`` (sync) and ``_acall`` (async), declared by
:class:`~._wrapper.DelegatingSaver`: the sync checkpointer calls its store directly and sends
async calls to a worker thread; the async one awaits its store and runs sync calls on its
loop. Everything else (validation, argument shapes, docs) is written once by the sections.

Deferred records. Records that need no durability of their own wait in memory and ride
along with the thread's next durable write: events of pure tool calls and step summaries,
and the model decision a step acts on (needed on disk before its first side effect, so it
goes in the ledger intent's transaction). A side-effecting step then costs exactly its two
ledger writes. A crash loses only deferred records, and a lost decision led to no effect;
ledger facts and their events are always written in their own transaction.

Held commits. The commit of a tool that settles a lost commit itself (idempotent, or with a
pre-check) is held here per (thread, task) and written in the transaction of that task's
put_writes: the task's writes and its commit are durable together or not at all, for no
commit of their own. Anything else that reads or writes the thread's ledger or events
first, or puts the thread's next checkpoint, writes the held commits on their own first.
LangGraph runs a task's put_writes in its background executor, concurrently with the put of
the next checkpoint and even with later steps (``durability="sync"`` waits for the put
only), so every hand-over holds the thread's commit mutex until the commit is durable, and
a put_writes or put takes the mutex before writing: neither can make a step durable while
its commit may still be lost (the step's writes or checkpoint without the commit would
leave an intent that the repeat guard does not see). Only the sync checkpointer holds
commits.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from langchain_core.runnables import RunnableConfig

from taskpilots_graph._twins import Steps, io
from taskpilots_graph.checkpointers._ride_rows import riding
from taskpilots_graph.checkpointers._wrapper import DelegatingSaver
from taskpilots_graph.checkpointers.base import DecisionRecord, HeldCommit, PendingRecord
from taskpilots_graph.errors import LedgerConflict
from taskpilots_graph.events import EventRecord, check_thread_id
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus

__all__ = ["PendingWrites"]

T = TypeVar("T")
_MUTEX_STRIPES = 64
_CARRY_WAIT = 0.2  # seconds a put waits for a put_writes to take the commits it may carry


def _thread_of(config: RunnableConfig) -> str:
    return str(config.get("configurable", {}).get("thread_id") or "")


class PendingWrites(DelegatingSaver):
    """Records and commits waiting in memory to ride along with another durable write, and
    the state the sections share with density views."""

    if TYPE_CHECKING:  # the ledger's: a held commit counts for the repeat guard at once

        def _note_effect(self, entry: LedgerEntry) -> None: ...

    def _shared(self, name: str, make: Callable[[], T]) -> T:
        """``name``, made on first use, in state that the views made by ``with_density``
        (copies) share with this checkpointer."""
        state: dict[str, Any] = self.__dict__.setdefault("_shared_state", {})
        found: T | None = state.get(name)
        return found if found is not None else state.setdefault(name, make())

    def _deferred_lock(self) -> threading.Lock:
        """Guards the records deferred and the commits held for the thread's next write."""
        return self._shared("_pending_lock", threading.Lock)

    # -- deferred records --------------------------------------------------------------------

    def defer_records(self, records: Sequence[PendingRecord]) -> None:
        """Keep events (or decisions) until the thread's next durable write."""
        for record in records:
            check_thread_id(record.thread_id)
        if records:
            with self._deferred_lock():
                for record in records:
                    self._deferred().setdefault(record.thread_id, []).append(record)

    def _deferred(self) -> dict[str, list[PendingRecord]]:
        return self._shared("_pending_events", dict)

    def _deferred_decision(self, thread_id: str, checkpoint_ns: str, digest: str) -> str | None:
        with self._deferred_lock():
            for record in self._deferred().get(thread_id, ()):
                if isinstance(record, DecisionRecord) and (
                    record.checkpoint_ns,
                    record.input_digest,
                ) == (checkpoint_ns, digest):
                    return record.message
        return None

    def _take_deferred(self, thread_ids: set[str]) -> list[PendingRecord]:
        with self._deferred_lock():
            pending = self._deferred()
            return [r for t in sorted(thread_ids) for r in pending.pop(t, [])]

    def _restore_deferred(self, records: Sequence[PendingRecord]) -> None:
        with self._deferred_lock():
            for record in reversed(records):
                self._deferred().setdefault(record.thread_id, []).insert(0, record)

    def _with_deferred(
        self, records: Sequence[EventRecord], flush: str | None
    ) -> list[PendingRecord]:
        threads = {r.thread_id for r in records} | ({flush} if flush else set())
        return [*self._take_deferred(threads), *records] if threads else list(records)

    # -- held commits ------------------------------------------------------------------------

    def hold_commit(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[PendingRecord],
        task_id: str,
    ) -> bool:
        """Hold a ledger commit for the put_writes of ``task_id``; ``False`` (nothing held:
        write it with :meth:`write_ledger`) when this checkpointer's saver cannot carry it."""
        if self.held is not None or not getattr(self.inner, "rides_commits", False):
            return False  # held checkpoints batch put_writes; other savers have no hook
        ride = getattr(getattr(self, "store", None), "ledger_ride", None)
        if not callable(ride) or inspect.iscoroutinefunction(ride):
            return False
        check_thread_id(entry.thread_id)
        with self._deferred_lock():
            # The events deferred for the thread ride first, as with a ledger write. A model
            # decision stays where readers of this process find it until it is durable.
            deferred = self._deferred().pop(entry.thread_id, [])
            decisions: list[PendingRecord] = [r for r in deferred if isinstance(r, DecisionRecord)]
            if decisions:
                self._deferred()[entry.thread_id] = decisions
            earlier = [r for r in deferred if not isinstance(r, DecisionRecord)]
            commit = HeldCommit(entry, expect, (*earlier, *events), task_id)
            self._held_commits().setdefault(entry.thread_id, []).append(commit)
            self._commit_holding()[0] = True
        self._note_effect(entry)
        return True

    def _held_commits(self) -> dict[str, list[HeldCommit]]:
        return self._shared("_held_commit_map", dict)

    def _commit_mutex(self, thread_id: str) -> threading.RLock:
        """The mutex of ``thread_id``'s held commits (striped: bounded memory)."""
        stripes = self._shared(
            "_commit_mutexes", lambda: [threading.RLock() for _ in range(_MUTEX_STRIPES)]
        )
        return stripes[hash(thread_id) % _MUTEX_STRIPES]

    def _commit_holding(self) -> list[bool]:
        return self._shared("_commit_holding_flag", lambda: [False])

    def _holds_commits(self) -> bool:
        # Once any commit was held, a put_writes may be carrying one: taken from the map,
        # not yet durable. From then on writers take the thread's mutex to wait for it
        # (an empty map does not mean that nothing is on its way).
        return self._commit_holding()[0]

    def _held_threads(self, thread_id: str | None = None, *, key: str | None = None) -> set[str]:
        """Threads holding commits: ``thread_id``'s, the one of entry ``key``, or all."""
        with self._deferred_lock():
            held = self._held_commits()
            if thread_id is not None:
                return {thread_id} if held.get(thread_id) else set()
            if key is not None:
                return {t for t, cs in held.items() if any(c.entry.key == key for c in cs)}
            return {t for t, cs in held.items() if cs}

    def _held_before(self, records: Sequence[EventRecord], flush: str | None) -> set[str]:
        """Threads whose held commits go before an append of events: only when the append
        writes anything (events keep their order); an empty flush (the end of a tool call)
        leaves them to ride."""
        threads = {r.thread_id for r in records} | ({flush} if flush else set())
        with self._deferred_lock():
            deferred = self._deferred()
            if not records and not any(deferred.get(t) for t in threads):
                return set()
        return threads  # held or being carried: _flush_held waits on the thread's mutex

    def _take_held(
        self, thread_id: str, which: Callable[[HeldCommit], bool] = lambda c: not c.parked
    ) -> list[HeldCommit]:
        """Take the thread's held commits that ``which`` selects (default: not parked)."""
        with self._deferred_lock():
            held = self._held_commits()
            commits = held.pop(thread_id, [])
            rest = [c for c in commits if not which(c)]
            if rest:
                held[thread_id] = rest
            return [c for c in commits if which(c)]

    def _restore_held(self, commits: Sequence[HeldCommit]) -> None:
        with self._deferred_lock():
            for commit in reversed(commits):
                self._held_commits().setdefault(commit.entry.thread_id, []).insert(0, commit)

    def _flush_held(self, thread_ids: Iterable[str], *, parked: bool = False) -> None:
        """Write the held commits of ``thread_ids`` now, each in its own transaction (the
        parked ones too if ``parked``); waits for a put_writes carrying one of them."""
        if not self._holds_commits():
            return  # nothing was ever held: no mutex to wait for
        for thread_id in thread_ids:
            if parked:  # a put: give the thread's put_writes, already on its way, the ride
                self._await_carriers(thread_id)
            with self._commit_mutex(thread_id):
                self._write_held(self._take_held(thread_id, lambda c: parked or not c.parked))

    def _carried(self) -> threading.Condition:
        return self._shared("_carried_condition", threading.Condition)

    def _await_carriers(self, thread_id: str) -> None:
        """Wait briefly until a put_writes has taken each of the thread's held commits.

        A put runs concurrently with the put_writes of the tasks before it (LangGraph's
        background executor), which have the commits' ride: had the put written them on
        their own first, each would have cost a transaction of its own.
        """

        def taken() -> bool:
            with self._deferred_lock():
                return all(c.parked for c in self._held_commits().get(thread_id, ()))

        with self._carried():
            self._carried().wait_for(taken, _CARRY_WAIT)

    def _write_held(self, commits: Sequence[HeldCommit]) -> None:
        for done, commit in enumerate(commits):
            try:
                self._call("ledger_write", commit.entry, expect=commit.expect, events=commit.events)
            except LedgerConflict as exc:
                raise LedgerConflict(commit.entry.key, performed=True) from exc
            except BaseException:  # not written: for the put of the next checkpoint only
                self._restore_held([replace(c, parked=True) for c in commits[done:]])
                raise

    async def _aflush_held(self, thread_ids: Iterable[str], *, parked: bool = False) -> None:
        """Async form of :meth:`_flush_held` (commits are held by the sync checkpointer
        only: its writes and the mutex wait run in a worker thread)."""
        if self._holds_commits():
            await asyncio.to_thread(self._flush_held, list(thread_ids), parked=parked)

    def _before_read(self, config: RunnableConfig) -> Steps[None]:
        """A run loads the thread: the parked commits of a run that failed are dropped (that
        run's writes did not become durable; this one settles the calls)."""
        if self._holds_commits():
            thread_id = _thread_of(config)
            with self._commit_mutex(thread_id):
                self._take_held(thread_id, lambda c: c.parked)
        yield from ()

    def _before_put(self, config: RunnableConfig) -> Steps[None]:
        # Before the checkpoint that completes a step: that step's commits are durable
        # (carried by a put_writes that ended, or written here).
        yield io(self, "_flush_held", [_thread_of(config)], parked=True)

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        thread_id = _thread_of(config)
        if not self._holds_commits():
            super().put_writes(config, writes, task_id, task_path)
            return
        with self._commit_mutex(thread_id):
            commits = self._take_held(thread_id, lambda c: c.task_id == task_id and not c.parked)
            if commits:
                with self._carried():
                    self._carried().notify_all()  # a put may wait for this
                self._carry(commits, config, writes, task_id, task_path)
                return
        # Nothing of this task's is held, and no hand-over of the thread is under way.
        super().put_writes(config, writes, task_id, task_path)

    def _carry(
        self,
        commits: list[HeldCommit],
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str,
    ) -> None:
        """The task's put_writes with its held commits in the saver's transaction."""
        store = getattr(self, "store", None)
        write = store.ledger_ride(commits)  # type: ignore[union-attr]
        if write is None:  # the store cannot carry these: commits first, on their own
            self._write_held(commits)
            super().put_writes(config, writes, task_id, task_path)
            return
        try:
            with riding(store) as carried:
                carried.take(commits, write=write)
                super().put_writes(config, writes, task_id, task_path)
        except LedgerConflict as exc:
            raise LedgerConflict(exc.key, performed=True) from exc
        except BaseException:
            if not carried.written:  # for the put of the next checkpoint only
                self._restore_held([replace(c, parked=True) for c in commits])
            raise
        if carried.stranded:  # the saver did not take them (not expected): now, on their own
            self._write_held(commits)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        # A sync task of an async run: its commit goes first, on its own.
        await self._aflush_held([_thread_of(config)])
        await super().aput_writes(config, writes, task_id, task_path)
