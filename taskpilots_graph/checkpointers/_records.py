"""The thread's records in the recovery store: its event log, its ledger and the model
decisions. Reads and writes first write the commits held for the thread, and writes carry
the records deferred for their threads (:mod:`._ride`)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, cast

from taskpilots_graph import compaction
from taskpilots_graph._twins import Steps, asynced, io, synced
from taskpilots_graph.checkpointers._ride import PendingWrites
from taskpilots_graph.checkpointers.base import DecisionRecord
from taskpilots_graph.events import (
    Event,
    EventKind,
    EventRecord,
    check_thread_id,
    mark_superseded,
    prepare_event,
)
from taskpilots_graph.leases import held_thread_lease
from taskpilots_graph.ledger import CommittedEffect, LedgerEntry, LedgerStatus

__all__ = ["RecoveryRecords", "TenureMemo"]

_KEYS = "keys"
"""The memo scope of the keys of a thread's ledger entries."""


class TenureMemo:
    """What is on record for a thread, per scope, as far as its current lease tenure knows:
    while a run holds the lease nobody else writes these records, so one read of a scope,
    kept up to date by this checkpointer's own writes, spares a read per lookup. Weakly keyed
    by the hold (a new tenure reads again); without the lease every lookup reads."""

    def __init__(self) -> None:
        self._known = weakref.WeakKeyDictionary[object, dict[str, set[Hashable]]]()
        # Items noted before their scope was read: a read in flight may not see them.
        self._early = weakref.WeakKeyDictionary[object, dict[str, set[Hashable]]]()
        self._lock = threading.Lock()  # a note and a read's remember may race (tasks)

    def _scopes(
        self, thread_id: str
    ) -> tuple[dict[str, set[Hashable]], dict[str, set[Hashable]]] | None:
        tenure = held_thread_lease(thread_id)
        if tenure is None:
            return None
        return self._known.setdefault(tenure, {}), self._early.setdefault(tenure, {})

    def unknown(self, thread_id: str, scope: str) -> bool:
        """Whether ``scope`` is to be read now: the lease is held and the scope not read."""
        memo = self._scopes(thread_id)
        return memo is not None and scope not in memo[0]

    def remember(self, thread_id: str, scope: str, items: Iterable[Hashable]) -> None:
        """What a read of ``scope`` found."""
        found = set(items)
        if (memo := self._scopes(thread_id)) is not None:
            known, early = memo
            with self._lock:
                known.setdefault(scope, set()).update(found, early.pop(scope, ()))

    def may_hold(self, thread_id: str, scope: str, item: Hashable) -> bool:
        """``False`` only when ``scope`` was read and ``item`` is not on record."""
        memo = self._scopes(thread_id)
        return memo is None or item in memo[0].get(scope, {item})

    def note(self, thread_id: str, scope: str, item: Hashable) -> None:
        """``item`` was just recorded (kept for the scope's first read, if it is not read)."""
        if (memo := self._scopes(thread_id)) is not None:
            known, early = memo
            with self._lock:
                (known[scope] if scope in known else early.setdefault(scope, set())).add(item)

    def forget(self, thread_id: str) -> None:
        """Everything known for the thread's tenure (its records changed)."""
        if (tenure := held_thread_lease(thread_id)) is not None:
            self._known.pop(tenure, None)
            self._early.pop(tenure, None)


class RecoveryRecords(PendingWrites):
    """The thread's event log, ledger and model decisions, and the compaction of old events."""

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
        entries = cast(list[LedgerEntry], (yield io(self, "_call", "ledger", thread_id)))
        if thread_id is not None:  # the tenure's lookups need no read of their own
            committed = (e for e in entries if e.status is LedgerStatus.COMMITTED)
            self._effects().remember(thread_id, _KEYS, (e.key for e in entries))
            self._effects().remember(thread_id, "", ((e.tool, e.args_digest) for e in committed))
        return entries

    ledger = synced(_ledger)
    aledger = asynced(_ledger)

    def _ledger_entry(self, key: str, *, thread_id: str | None = None) -> Steps[LedgerEntry | None]:
        """The entry recorded under an invocation key, if any.

        ``thread_id``: the thread whose runs alone write ``key`` (its default key). Under
        that thread's lease, once its ledger was read (as a run does first), a key it does
        not hold is answered ``None`` without a read.
        """
        if thread_id is not None and not self._effects().may_hold(thread_id, _KEYS, key):
            return None
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
        if self._effects().unknown(thread_id, ""):
            found = yield io(self, "_call", "ledger_committed_digests", thread_id)
            self._effects().remember(thread_id, "", ((tool, digest) for tool, digest in found))
        if not self._effects().may_hold(thread_id, "", (tool, args_digest)):
            return None
        found = yield io(self, "_call", "ledger_repeat", thread_id, tool, args_digest)
        return cast(CommittedEffect | None, found)

    committed_effect = synced(_committed_effect)
    acommitted_effect = asynced(_committed_effect)

    def _effects(self) -> TenureMemo:
        """The thread's committed (tool, arguments digest) pairs (scope ``""``) and the keys
        of its entries (scope :data:`_KEYS`)."""
        return self._shared("_committed_effects", TenureMemo)

    def _note_effect(self, entry: LedgerEntry) -> None:
        self._effects().note(entry.thread_id, _KEYS, entry.key)
        if entry.status is LedgerStatus.COMMITTED:
            self._effects().note(entry.thread_id, "", (entry.tool, entry.args_digest))

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
        threads = {entry.thread_id, *(event.thread_id for event in events)}
        yield io(self, "_flush_held", threads)
        batch = [*self._take_deferred(threads), *events]
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

    def _compact_events(
        self,
        thread_id: str,
        *,
        keep_last: int,
        key_fields: Iterable[str] = compaction.DEFAULT_KEY_FIELDS,
        protected_kinds: Iterable[EventKind | str] = compaction.DEFAULT_PROTECTED_KINDS,
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
        policy = compaction.CompactionPolicy.of(
            keep_last, key_fields=key_fields, protected_kinds=protected_kinds
        )
        return cast(int, (yield io(self, "_call", "compact_events", thread_id, policy)))

    compact_events = synced(_compact_events)
    acompact_events = asynced(_compact_events)

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
        if self._inputs().unknown(thread_id, checkpoint_ns):
            digests = yield io(self, "_call", "decision_digests", thread_id, checkpoint_ns)
            self._inputs().remember(thread_id, checkpoint_ns, digests)
        if not self._inputs().may_hold(thread_id, checkpoint_ns, input_digest):
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
        self._inputs().note(thread_id, checkpoint_ns, input_digest)

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
        self._inputs().note(thread_id, checkpoint_ns, input_digest)

    def _forget_decisions(self, thread_id: str, *, since: float) -> Steps[int]:
        """Forget the thread's model decisions recorded after ``since`` (used by rewind)."""
        yield io(self, "append_records", [], flush=thread_id)  # deferred ones are forgotten too
        self._inputs().forget(thread_id)
        return cast(int, (yield io(self, "_call", "decision_forget", thread_id, since)))

    forget_decisions = synced(_forget_decisions)
    aforget_decisions = asynced(_forget_decisions)

    def _inputs(self) -> TenureMemo:
        """The inputs with a recorded decision, per namespace (the scope)."""
        return self._shared("_decision_inputs", TenureMemo)
