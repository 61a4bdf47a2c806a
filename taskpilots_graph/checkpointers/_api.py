"""The recovery methods both checkpointers offer, each in a sync and an async form.

A subclass says how to reach its store from either side with two primitives: ``_call``
(sync) and ``_acall`` (async). The sync checkpointer calls its store directly and sends async
calls to a worker thread; the async one awaits its store and runs sync calls on its loop.
Everything else (validation, argument shapes, docs) is written once here.

Artifacts go to the recovery store unless an :class:`ArtifactStore` was plugged in
(``artifact_store``); those are synchronous and run on a worker thread for async callers.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

from langchain_core.runnables import RunnableConfig

from taskpilots_graph._twins import Steps, arun_steps, asynced, io, run_steps, synced
from taskpilots_graph.checkpointers._stored import STORED_WAIT, StoredCheckpoints
from taskpilots_graph.checkpointers._wrapper import DelegatingSaver
from taskpilots_graph.checkpointers.artifacts import (
    ARTIFACTS_TABLE,
    ArtifactRef,
    ArtifactStore,
    check_artifact_id,
    prepare_artifact,
    verify_artifact,
)
from taskpilots_graph.checkpointers.base import DecisionRecord, HeldCommit, PendingRecord
from taskpilots_graph.checkpointers.density import CheckpointDensity, HeldCheckpoints
from taskpilots_graph.checkpointers.messages import riding
from taskpilots_graph.compaction import (
    DEFAULT_KEY_FIELDS,
    DEFAULT_PROTECTED_KINDS,
    CompactionPolicy,
)
from taskpilots_graph.errors import ArtifactNotFound, ConfigurationError, LedgerConflict
from taskpilots_graph.events import (
    Event,
    EventKind,
    EventRecord,
    check_thread_id,
    mark_superseded,
    prepare_event,
)
from taskpilots_graph.leases import LeaseBackend, held_thread_lease
from taskpilots_graph.ledger import CommittedEffect, LedgerEntry, LedgerStatus

# ``retention`` and ``_optional`` (copy, prune, sweep, delete by run) are imported where
# they are used: they load aiosqlite's async saver and more, which a run never needs.
if TYPE_CHECKING:
    from taskpilots_graph.checkpointers.retention import Keep, PruneReport

__all__ = ["RecoveryAPI", "checked_artifact_store"]

T = TypeVar("T")


def checked_artifact_store(artifacts: object) -> ArtifactStore | None:
    """``artifacts`` if it is ``None`` or implements :class:`ArtifactStore`.

    Raises:
        ConfigurationError: Otherwise (a path string, say), naming the classes to use.
    """
    if artifacts is None or isinstance(artifacts, ArtifactStore):
        return artifacts
    raise ConfigurationError(
        f"artifacts must be an ArtifactStore, got {type(artifacts).__name__}; use "
        "FileArtifactStore(path) or FsspecArtifactStore(url), or omit it to keep artifacts "
        "in the checkpointer's database"
    )


class RecoveryAPI(DelegatingSaver):
    """Event log, ledger, decision records and artifacts on top of a delegating saver."""

    artifact_store: ArtifactStore | None = None
    """A store of its own for artifacts; ``None`` keeps them in the recovery store."""

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def with_density(self, density: CheckpointDensity) -> Self:
        """A view of this checkpointer that stores checkpoints as ``density`` says.

        The view shares the saver, the recovery store and the events waiting for their
        write; only LangGraph's checkpoint writes go through the density. The agent builds
        it from ``create_recovery_agent(checkpoint_density=...)``.
        """
        if density.kind == "every_step":
            return self
        self._deferred()  # created now, so that the view shares them
        self._deferred_lock()
        self._held_commits()
        self._commit_holding()
        self._commit_mutex("")
        self._carried()
        self._stored()
        self._inputs_by_hold()
        self._effects_by_hold()
        view = copy.copy(self)
        view.held = HeldCheckpoints(density)
        return view

    async def _acall(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _shared(self, name: str, make: Callable[[], T]) -> T:
        """Attribute ``name``, made on first use: the views made by :meth:`with_density`
        (copies) share what was made before them."""
        found: T | None = self.__dict__.get(name)
        return found if found is not None else self.__dict__.setdefault(name, make())

    # -- stored checkpoints ------------------------------------------------------------------

    def _stored(self) -> StoredCheckpoints:
        return self._shared("_stored_checkpoints", StoredCheckpoints)

    def _on_disk(self, config: RunnableConfig) -> None:
        conf = config.get("configurable") or {}
        if conf.get("checkpoint_id"):
            self._stored().note(str(conf.get("thread_id")), str(conf["checkpoint_id"]))

    def checkpoint_stored(
        self, thread_id: str, checkpoint_id: str, *, wait: float = STORED_WAIT
    ) -> bool:
        """Whether the checkpoint is on disk, waiting up to ``wait`` seconds for its put.

        A step run under ``durability="async"`` asks before its first side effect (see
        :mod:`taskpilots_graph.checkpointers._stored`). Always ``False`` on a view that
        holds checkpoints back (a density other than every step): there is nothing to
        wait for.
        """
        if self.held is not None:
            return False
        return self._stored().wait(thread_id, checkpoint_id, wait)

    async def acheckpoint_stored(
        self, thread_id: str, checkpoint_id: str, *, wait: float = STORED_WAIT
    ) -> bool:
        """Async form of :meth:`checkpoint_stored`."""
        if self.held is not None:
            return False
        return await self._stored().await_stored(thread_id, checkpoint_id, wait)

    # -- event log ---------------------------------------------------------------------------

    def _append_event(
        self,
        thread_id: str,
        kind: EventKind | str,
        payload: Mapping[str, Any] | None = None,
        *,
        checkpoint_id: str | None = None,
        checkpoint_ns: str = "",
    ) -> Steps[Event]:
        """Append an event to the thread's log; it is durable when this returns.

        Raises:
            ConfigurationError: For an empty thread id, an unknown kind, or a payload that
                is not a JSON object of at most ``MAX_PAYLOAD_BYTES``.
        """
        record = prepare_event(
            thread_id, kind, payload, checkpoint_id=checkpoint_id, checkpoint_ns=checkpoint_ns
        )
        return cast(list[Event], (yield io(self, "_call", "append_events", [record])))[0]

    append_event = synced(_append_event)
    aappend_event = asynced(_append_event)

    def _events(self, thread_id: str, *, after_seq: int = 0) -> Steps[list[Event]]:
        """The thread's events in order (those with ``seq > after_seq``).

        Raises:
            CorruptRecordError: If a stored event cannot be decoded.
        """
        yield io(self, "_flush_held", [thread_id])  # the events of held commits too
        yield io(self, "append_records", [], flush=thread_id)  # own deferred events too
        events = yield io(self, "_call", "events", thread_id, after_seq=after_seq)
        return mark_superseded(cast(list[Event], events))

    events = synced(_events)
    aevents = asynced(_events)

    # -- ledger ------------------------------------------------------------------------------

    def _ledger(self, thread_id: str | None = None) -> Steps[list[LedgerEntry]]:
        """Ledger entries of one thread (or of every thread), oldest first.

        Raises:
            CorruptRecordError: If a stored entry cannot be decoded.
        """
        yield io(self, "_flush_held", [thread_id] if thread_id else self._held_threads())
        return cast(list[LedgerEntry], (yield io(self, "_call", "ledger", thread_id)))

    ledger = synced(_ledger)
    aledger = asynced(_ledger)

    def _ledger_entry(self, key: str) -> Steps[LedgerEntry | None]:
        """The entry recorded under an invocation key, if any."""
        yield io(self, "_flush_held", self._held_threads(key=key))
        return cast(LedgerEntry | None, (yield io(self, "_call", "ledger_get", key)))

    ledger_entry = synced(_ledger_entry)
    aledger_entry = asynced(_ledger_entry)

    def _committed_effect(
        self, thread_id: str, tool: str, args_digest: str
    ) -> Steps[CommittedEffect | None]:
        """The thread's earliest committed effect of ``tool`` with these canonical
        arguments, and its step (the repeat guard's question).

        Under the thread's lease the thread's committed (tool, arguments) pairs are read
        once per lease tenure, then kept up to date by this checkpointer's own ledger
        writes: a fresh side effect costs no read, only a pair seen committed is looked up.
        Without the lease it is one indexed read.
        """
        yield io(self, "_flush_held", [thread_id])
        if self._effects_unknown(thread_id):
            found = yield io(self, "_call", "ledger_committed_digests", thread_id)
            self._remember_effects(thread_id, found)
        if not self._may_be_committed(thread_id, tool, args_digest):
            return None
        found = yield io(self, "_call", "ledger_repeat", thread_id, tool, args_digest)
        return cast(CommittedEffect | None, found)

    committed_effect = synced(_committed_effect)
    acommitted_effect = asynced(_committed_effect)

    # The committed (tool, arguments digest) pairs of the thread whose lease is held, per
    # lease tenure (as the decision inputs below): nobody else commits effects of a thread
    # while its lease is held, so one read replaces a read per side effect. Weakly keyed by
    # the hold: a new tenure reads again.

    def _effects_by_hold(self) -> weakref.WeakKeyDictionary[object, set[tuple[str, str]]]:
        return self._shared("_committed_effects", weakref.WeakKeyDictionary)

    def _effects_unknown(self, thread_id: str) -> bool:
        tenure = self._tenure(thread_id)
        return tenure is not None and tenure not in self._effects_by_hold()

    def _remember_effects(self, thread_id: str, pairs: Iterable[Sequence[str]]) -> None:
        tenure = self._tenure(thread_id)
        if tenure is not None:
            known = self._effects_by_hold().setdefault(tenure, set())
            known.update((tool, digest) for tool, digest in pairs)

    def _may_be_committed(self, thread_id: str, tool: str, args_digest: str) -> bool:
        tenure = self._tenure(thread_id)
        known = None if tenure is None else self._effects_by_hold().get(tenure)
        return known is None or (tool, args_digest) in known

    def _note_effect(self, entry: LedgerEntry) -> None:
        if entry.status is LedgerStatus.COMMITTED:
            tenure = self._tenure(entry.thread_id)
            known = None if tenure is None else self._effects_by_hold().get(tenure)
            if known is not None:
                known.add((entry.tool, entry.args_digest))

    def _write_ledger(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[EventRecord] = (),
    ) -> Steps[list[Event]]:
        """Insert or compare-and-set an entry and its events in one durable transaction.

        Records deferred (:meth:`defer_records`, :meth:`defer_decision`) for the entry's
        thread and for the events' threads go in the same transaction, before ``events``:
        an entry first written by another thread (a business key) still carries the
        decision of the thread about to act on it.

        Raises:
            LedgerConflict: If another run changed the entry first; nothing is written and
                the deferred records keep waiting.
            ConfigurationError: For a thread id no backend stores (nothing is written).
        """
        check_thread_id(entry.thread_id)
        yield io(self, "_flush_held", _threads(entry, events))
        batch = [*self._take_deferred(_threads(entry, events)), *events]
        try:
            written = yield io(self, "_call", "ledger_write", entry, expect=expect, events=batch)
        except BaseException:
            self._restore_deferred(batch[: len(batch) - len(events)])
            raise
        self._note_effect(entry)
        return cast(list[Event], written)

    write_ledger = synced(_write_ledger)
    awrite_ledger = asynced(_write_ledger)

    def _append_records(
        self, records: Sequence[EventRecord], *, flush: str | None = None
    ) -> Steps[list[Event]]:
        """Append prepared events in one durable transaction (node use).

        Events deferred for the same threads (and for ``flush``) go first.
        """
        yield io(self, "_flush_held", self._held_before(records, flush))
        batch = self._with_deferred(records, flush)
        return cast(list[Event], (yield io(self, "_call", "append_events", batch))) if batch else []

    append_records = synced(_append_records)
    aappend_records = asynced(_append_records)

    # -- commits riding a task's writes ------------------------------------------------------
    # The commit of a tool that settles a lost commit itself (idempotent, or with a
    # pre-check) is held here per (thread, task) and written in the transaction of that
    # task's put_writes: the task's writes and its commit are durable together or not at
    # all, for no commit of their own. Anything else that reads or writes the thread's
    # ledger or events first, or puts the thread's next checkpoint, writes the held commits
    # on their own first. LangGraph runs a task's put_writes in its background executor,
    # concurrently with the put of the next checkpoint and even with later steps
    # (``durability="sync"`` waits for the put only), so every hand-over holds the thread's
    # commit mutex until the commit is durable, and a put_writes or put takes the mutex
    # before writing: neither can make a step durable while its commit may still be lost
    # (the step's writes or checkpoint without the commit would leave an intent that the
    # repeat guard does not see). Only the sync checkpointer holds commits.

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
        commit = HeldCommit(entry, expect, tuple(events), task_id)
        with self._deferred_lock():
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
                if parked:
                    self._write_held(self._take_held(thread_id, lambda c: True))
                else:
                    self._write_held(self._take_held(thread_id))

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

    def _drop_parked(self, config: RunnableConfig) -> None:
        """A run loads the thread: the parked commits of a run that failed are dropped (that
        run's writes did not become durable; this one settles the calls)."""
        if self._holds_commits():
            thread_id = _thread_of(config)
            with self._commit_mutex(thread_id):
                self._take_held(thread_id, lambda c: c.parked)

    def _before_read(self, config: RunnableConfig) -> Steps[None]:
        self._drop_parked(config)
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

    # -- deferred records --------------------------------------------------------------------
    # Records that need no durability of their own wait in memory and ride along with the
    # thread's next durable write: events of pure tool calls and step summaries, and the
    # model decision a step acts on (needed on disk before its first side effect, so it goes
    # in the ledger intent's transaction). A side-effecting step then costs exactly its two
    # ledger writes. A crash loses only deferred records, and a lost decision led to no
    # effect; ledger facts and their events are always written in their own transaction.

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

    def _deferred_lock(self) -> threading.Lock:
        return self._shared("_pending_lock", threading.Lock)

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

    # -- model decisions ---------------------------------------------------------------------

    def _decision(self, thread_id: str, checkpoint_ns: str, input_digest: str) -> Steps[str | None]:
        """A model decision recorded (or deferred) for exactly this input, if any.

        Under the thread's lease (``tp.run``, ``resume``, ...) the thread's recorded inputs
        are read once per lease tenure, and only a known input is looked up: nobody else
        records decisions for a thread while its lease is held.
        """
        found = self._deferred_decision(thread_id, checkpoint_ns, input_digest)
        if found is not None:
            return found
        if self._inputs_unknown(thread_id, checkpoint_ns):
            digests = yield io(self, "_call", "decision_digests", thread_id, checkpoint_ns)
            self._remember_inputs(thread_id, checkpoint_ns, digests)
        if not self._may_be_recorded(thread_id, checkpoint_ns, input_digest):
            return None
        found = yield io(self, "_call", "decision_get", thread_id, checkpoint_ns, input_digest)
        return cast(str | None, found)

    decision = synced(_decision)
    adecision = asynced(_decision)

    def _record_decision(
        self, thread_id: str, checkpoint_ns: str, input_digest: str, message: str
    ) -> Steps[None]:
        """Record a model decision durably; the first record for an input wins."""
        check_thread_id(thread_id)
        record = DecisionRecord(thread_id, checkpoint_ns, input_digest, message, time.time())
        yield io(self, "_call", "append_events", [record])
        self._note_input(thread_id, checkpoint_ns, input_digest)

    record_decision = synced(_record_decision)
    arecord_decision = asynced(_record_decision)

    def defer_decision(
        self, thread_id: str, checkpoint_ns: str, input_digest: str, message: str
    ) -> None:
        """Record a model decision with the thread's next durable write (a ledger intent).

        Readers in this process see it at once (:meth:`decision`).
        """
        now = time.time()
        self.defer_records([DecisionRecord(thread_id, checkpoint_ns, input_digest, message, now)])
        self._note_input(thread_id, checkpoint_ns, input_digest)

    def _forget_decisions(self, thread_id: str, *, since: float) -> Steps[int]:
        """Forget the thread's model decisions recorded after ``since`` (used by rewind)."""
        yield io(self, "append_records", [], flush=thread_id)  # deferred ones are forgotten too
        self._forget_inputs(thread_id)
        return cast(int, (yield io(self, "_call", "decision_forget", thread_id, since)))

    forget_decisions = synced(_forget_decisions)
    aforget_decisions = asynced(_forget_decisions)

    # The inputs with a recorded decision, per lease tenure: while a run holds its thread's
    # lease nobody else records decisions for the thread, so one read at the first lookup
    # spares a read per model call. Keyed by the hold (weakly): a new tenure reads again.

    def _inputs_by_hold(self) -> weakref.WeakKeyDictionary[object, dict[str, set[str]]]:
        return self._shared("_decision_inputs", weakref.WeakKeyDictionary)

    def _tenure(self, thread_id: str) -> object | None:
        return held_thread_lease(thread_id)

    def _inputs_unknown(self, thread_id: str, checkpoint_ns: str) -> bool:
        tenure = self._tenure(thread_id)
        return tenure is not None and checkpoint_ns not in self._inputs_by_hold().get(tenure, {})

    def _remember_inputs(self, thread_id: str, checkpoint_ns: str, digests: Iterable[str]) -> None:
        tenure = self._tenure(thread_id)
        if tenure is not None:
            known = self._inputs_by_hold().setdefault(tenure, {})
            known.setdefault(checkpoint_ns, set()).update(digests)

    def _may_be_recorded(self, thread_id: str, checkpoint_ns: str, input_digest: str) -> bool:
        tenure = self._tenure(thread_id)
        known = None if tenure is None else self._inputs_by_hold().get(tenure, {})
        return known is None or input_digest in known.get(checkpoint_ns, {input_digest})

    def _note_input(self, thread_id: str, checkpoint_ns: str, input_digest: str) -> None:
        tenure = self._tenure(thread_id)
        known = None if tenure is None else self._inputs_by_hold().get(tenure, {})
        if known is not None and checkpoint_ns in known:
            known[checkpoint_ns].add(input_digest)

    def _forget_inputs(self, thread_id: str) -> None:
        tenure = self._tenure(thread_id)
        if tenure is not None:
            self._inputs_by_hold().pop(tenure, None)

    # -- event compaction --------------------------------------------------------------------

    def _compact_events(
        self,
        thread_id: str,
        *,
        keep_last: int,
        key_fields: Iterable[str] = DEFAULT_KEY_FIELDS,
        protected_kinds: Iterable[EventKind | str] = DEFAULT_PROTECTED_KINDS,
    ) -> Steps[int]:
        """Reduce the thread's events older than the last ``keep_last`` to kind + key fields.

        Payloads are rewritten in place (seq, kind and time stay); ledger-relevant fields
        (``key``, ``status``, ``proof``, ``tool``, ``tool_call_id``) are always kept and
        ``protected_kinds`` are never touched. See
        :func:`taskpilots_graph.compaction.compact_events` for the rules. Idempotent.

        Returns:
            How many events were rewritten.

        Raises:
            ConfigurationError: For a negative ``keep_last``, a bad field or an unknown kind.
            CorruptRecordError: If a stored event cannot be decoded (nothing is rewritten).
        """
        policy = CompactionPolicy.of(
            keep_last, key_fields=key_fields, protected_kinds=protected_kinds
        )
        return cast(int, (yield io(self, "_call", "compact_events", thread_id, policy)))

    compact_events = synced(_compact_events)
    acompact_events = asynced(_compact_events)

    # -- artifacts ---------------------------------------------------------------------------

    def _artifacts_call(self, method: str, *args: Any) -> Any:
        if self.artifact_store is None:
            return self._call(method, *args)
        return getattr(self.artifact_store, method)(*args)

    async def _aartifacts_call(self, method: str, *args: Any) -> Any:
        if self.artifact_store is None:
            return await self._acall(method, *args)
        # Plugged-in stores are synchronous (files, fsspec): keep them off the event loop.
        return await asyncio.to_thread(getattr(self.artifact_store, method), *args)

    def _checked(self, artifact_id: str, data: bytes | None) -> bytes:
        if data is None:
            raise ArtifactNotFound(artifact_id)
        store = self.artifact_store
        where = ARTIFACTS_TABLE if store is None else str(getattr(store, "location", store))
        return verify_artifact(artifact_id, data, where=where)

    def _put_artifact(
        self,
        thread_id: str,
        data: bytes | bytearray | memoryview | str,
        *,
        media_type: str | None = None,
    ) -> Steps[ArtifactRef]:
        """Store a raw payload for the thread and return its reference; durable on return.

        The id is the SHA-256 of the bytes (``str`` is stored as UTF-8), so storing the same
        payload again for the thread stores nothing new and returns the same id. The thread's
        artifacts are removed by :meth:`delete_thread`.

        Args:
            thread_id: The thread that owns the artifact.
            data: The payload.
            media_type: Defaults to ``text/plain; charset=utf-8`` for ``str`` and
                ``application/octet-stream`` for bytes. A payload already stored for the
                thread keeps the media type it was first stored with.

        Raises:
            ConfigurationError: For an empty thread id, data that is not bytes or text, or
                a bad media type.
        """
        artifact = prepare_artifact(check_thread_id(thread_id), data, media_type)
        yield io(self, "_artifacts_call", "put_artifact", artifact)
        return artifact.ref

    put_artifact = synced(_put_artifact)
    aput_artifact = asynced(_put_artifact)

    def _artifact(self, artifact_id: str) -> Steps[bytes]:
        """The raw payload stored under ``artifact_id``, checked against its hash.

        Raises:
            ConfigurationError: If ``artifact_id`` is not of the form ``sha256:<hex>``.
            ArtifactNotFound: If no thread holds it (never stored, or its thread deleted).
            CorruptRecordError: If the stored bytes no longer match the id.
        """
        check_artifact_id(artifact_id)
        data = yield io(self, "_artifacts_call", "get_artifact", artifact_id)
        return self._checked(artifact_id, data)

    artifact = synced(_artifact)
    aartifact = asynced(_artifact)

    # -- retention ---------------------------------------------------------------------------

    def prune(  # type: ignore[override]  # LangGraph's returns None; ours says what it did
        self,
        thread_ids: Sequence[str],
        *,
        keep: Keep = "latest",
        leases: LeaseBackend | None = None,
        strategy: str | None = None,
    ) -> PruneReport:
        """Delete the threads' checkpoints older than the latest, keeping every recovery fact.

        With ``keep="milestones"`` the checkpoints where a business milestone was reached
        (``rewind`` targets) stay too. Events, ledger entries and artifacts are never
        pruned. A thread with a pending takeover, an uncertain ledger entry or a held lease
        (when ``leases`` is given) is refused, and the report says why.

        Called LangGraph's way, with ``strategy=``, it has LangGraph's semantics on every
        backend and none of the checks above (unknown threads are skipped): ``"keep_latest"``
        keeps the latest checkpoint of each namespace with its pending writes, and every
        event, ledger entry, decision and artifact; ``"delete"`` deletes the threads whole,
        as :meth:`delete_thread` does. See :func:`~.retention.prune_strategy`.

        Raises:
            ThreadNotFound: For an unknown thread id (nothing is pruned then).
            ConfigurationError: For an unknown ``keep`` or ``strategy``, or
                ``strategy="keep_latest"`` on a thread that uses a ``DeltaChannel``.
        """
        from taskpilots_graph.checkpointers import retention

        if strategy is not None:
            return retention.prune_strategy(self, thread_ids, strategy)
        return retention.prune(self, thread_ids, keep=keep, leases=leases)

    async def aprune(  # type: ignore[override]
        self,
        thread_ids: Sequence[str],
        *,
        keep: Keep = "latest",
        leases: LeaseBackend | None = None,
        strategy: str | None = None,
    ) -> PruneReport:
        """Async form of :meth:`prune`."""
        from taskpilots_graph.checkpointers import retention

        if strategy is not None:
            return await retention.aprune_strategy(self, thread_ids, strategy)
        return await retention.aprune(self, thread_ids, keep=keep, leases=leases)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy a thread (every checkpoint, pending write and namespace) to a new thread id,
        with its events, model decisions, artifacts and ledger.

        The copy never performs again an effect the source committed: the source's ledger
        entries come along under the keys the copy asks for, committed ones as committed,
        and those whose outcome only the service knows as ``uncertain`` (a person decides).
        Entries under a business key are shared already and stay the source's. See
        :mod:`taskpilots_graph.checkpointers._optional` for the whole rule.

        Raises:
            ThreadNotFound: The source has no checkpoint.
            ConfigurationError: The target already has checkpoints or recovery records, or
                is the source, or a thread id no backend stores.
        """
        from taskpilots_graph.checkpointers import _optional as optional

        optional.copy_thread(self, source_thread_id, target_thread_id)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Async form of :meth:`copy_thread`."""
        from taskpilots_graph.checkpointers import _optional as optional

        await optional.acopy_thread(self, source_thread_id, target_thread_id)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their pending writes) the given runs wrote, in every
        thread, in one transaction.

        What the runs did stays on record (events, ledger entries, decisions, artifacts):
        a later run of the thread finds their committed effects instead of performing them
        again. Unknown run ids are ignored.

        Raises:
            ConfigurationError: ``run_ids`` is a single string.
        """
        from taskpilots_graph.checkpointers import _optional as optional

        optional.delete_for_runs(self, run_ids)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Async form of :meth:`delete_for_runs`."""
        from taskpilots_graph.checkpointers import _optional as optional

        await optional.adelete_for_runs(self, run_ids)

    def sweep(
        self, *, older_than: float | timedelta, leases: LeaseBackend | None = None
    ) -> PruneReport:
        """Delete whole threads idle for longer than ``older_than`` (seconds or a
        ``timedelta``), never one with a pending takeover, an uncertain ledger entry or a
        held lease. See :func:`taskpilots_graph.checkpointers.retention.sweep`."""
        from taskpilots_graph.checkpointers import retention

        return retention.sweep(self, older_than=older_than, leases=leases)

    async def asweep(
        self, *, older_than: float | timedelta, leases: LeaseBackend | None = None
    ) -> PruneReport:
        """Async form of :meth:`sweep`."""
        from taskpilots_graph.checkpointers import retention

        return await retention.asweep(self, older_than=older_than, leases=leases)

    # -- whole threads -----------------------------------------------------------------------

    def _delete_thread(self, thread_id: str) -> Steps[None]:
        """Delete the thread's checkpoints, writes, events, ledger entries, decisions and
        artifacts."""
        # Checkpoints go first: a crash in between leaves an orphan log, never a thread that
        # could resume without the record of what it already did.
        yield io(self.inner, "delete_thread", thread_id)
        yield io(self, "_call", "delete_thread", thread_id)  # its stored messages too
        self.message_log.forget(thread_id)  # a new run of the id starts new sequences
        if self.artifact_store is not None:
            yield io(self, "_artifacts_call", "delete_artifacts", thread_id)

    def delete_thread(self, thread_id: str) -> None:
        run_steps(self._delete_thread(thread_id))

    async def adelete_thread(self, thread_id: str) -> None:
        await arun_steps(self._delete_thread(thread_id))


_MUTEX_STRIPES = 64
_CARRY_WAIT = 0.2  # seconds a put waits for a put_writes to take the commits it may carry


def _thread_of(config: RunnableConfig) -> str:
    return str(config.get("configurable", {}).get("thread_id") or "")


def _threads(entry: LedgerEntry, events: Sequence[EventRecord]) -> set[str]:
    return {entry.thread_id, *(event.thread_id for event in events)}
