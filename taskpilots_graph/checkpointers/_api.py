"""The recovery methods both checkpointers offer, each in a sync and an async form.

A subclass says how to reach its store from either side with two primitives: ``_call``
(sync) and ``_acall`` (async). The sync checkpointer calls its store directly and sends async
calls to a worker thread; the async one awaits its store and runs sync calls on its loop.
Everything else (validation, argument shapes, docs) is written once here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from taskpilots_graph.checkpointers._wrapper import DelegatingSaver
from taskpilots_graph.checkpointers.base import EventRecord, prepare_event
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus

__all__ = ["RecoveryAPI"]


class RecoveryAPI(DelegatingSaver):
    """Event log, ledger and decision records on top of a delegating saver."""

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def _acall(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    # -- event log ---------------------------------------------------------------------------

    def append_event(
        self,
        thread_id: str,
        kind: EventKind | str,
        payload: Mapping[str, Any] | None = None,
        *,
        checkpoint_id: str | None = None,
        checkpoint_ns: str = "",
    ) -> Event:
        """Append an event to the thread's log; it is durable when this returns.

        Raises:
            ConfigurationError: For an empty thread id, an unknown kind, or a payload that
                is not a JSON object of at most ``MAX_PAYLOAD_BYTES``.
        """
        record = prepare_event(
            thread_id, kind, payload, checkpoint_id=checkpoint_id, checkpoint_ns=checkpoint_ns
        )
        return cast(list[Event], self._call("append_events", [record]))[0]

    async def aappend_event(
        self,
        thread_id: str,
        kind: EventKind | str,
        payload: Mapping[str, Any] | None = None,
        *,
        checkpoint_id: str | None = None,
        checkpoint_ns: str = "",
    ) -> Event:
        """Async form of :meth:`append_event`."""
        record = prepare_event(
            thread_id, kind, payload, checkpoint_id=checkpoint_id, checkpoint_ns=checkpoint_ns
        )
        return cast(list[Event], await self._acall("append_events", [record]))[0]

    def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        """The thread's events in order (those with ``seq > after_seq``).

        Raises:
            CorruptRecordError: If a stored event cannot be decoded.
        """
        return cast(list[Event], self._call("events", thread_id, after_seq=after_seq))

    async def aevents(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        """Async form of :meth:`events`."""
        return cast(list[Event], await self._acall("events", thread_id, after_seq=after_seq))

    # -- ledger ------------------------------------------------------------------------------

    def ledger(self, thread_id: str | None = None) -> list[LedgerEntry]:
        """Ledger entries of one thread (or of every thread), oldest first.

        Raises:
            CorruptRecordError: If a stored entry cannot be decoded.
        """
        return cast(list[LedgerEntry], self._call("ledger", thread_id))

    async def aledger(self, thread_id: str | None = None) -> list[LedgerEntry]:
        """Async form of :meth:`ledger`."""
        return cast(list[LedgerEntry], await self._acall("ledger", thread_id))

    def ledger_entry(self, key: str) -> LedgerEntry | None:
        """The entry recorded under an invocation key, if any."""
        return cast(LedgerEntry | None, self._call("ledger_get", key))

    async def aledger_entry(self, key: str) -> LedgerEntry | None:
        """Async form of :meth:`ledger_entry`."""
        return cast(LedgerEntry | None, await self._acall("ledger_get", key))

    def write_ledger(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[EventRecord] = (),
    ) -> list[Event]:
        """Insert or compare-and-set an entry and its events in one durable transaction.

        Raises:
            LedgerConflict: If another run changed the entry first.
        """
        return cast(list[Event], self._call("ledger_write", entry, expect=expect, events=events))

    async def awrite_ledger(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[EventRecord] = (),
    ) -> list[Event]:
        """Async form of :meth:`write_ledger`."""
        return cast(
            list[Event], await self._acall("ledger_write", entry, expect=expect, events=events)
        )

    def append_records(self, records: Sequence[EventRecord]) -> list[Event]:
        """Append prepared events in one durable transaction (executor use)."""
        return cast(list[Event], self._call("append_events", records)) if records else []

    async def aappend_records(self, records: Sequence[EventRecord]) -> list[Event]:
        """Async form of :meth:`append_records`."""
        return cast(list[Event], await self._acall("append_events", records)) if records else []

    # -- model decisions ---------------------------------------------------------------------

    def decision(self, thread_id: str, checkpoint_ns: str, input_digest: str) -> str | None:
        """A model decision recorded for exactly this input (serialised message), if any."""
        return cast(str | None, self._call("decision_get", thread_id, checkpoint_ns, input_digest))

    async def adecision(self, thread_id: str, checkpoint_ns: str, input_digest: str) -> str | None:
        """Async form of :meth:`decision`."""
        return cast(
            str | None, await self._acall("decision_get", thread_id, checkpoint_ns, input_digest)
        )

    def record_decision(
        self, thread_id: str, checkpoint_ns: str, input_digest: str, message: str
    ) -> None:
        """Record a model decision durably; the first record for an input wins."""
        self._call("decision_put", thread_id, checkpoint_ns, input_digest, message)

    async def arecord_decision(
        self, thread_id: str, checkpoint_ns: str, input_digest: str, message: str
    ) -> None:
        """Async form of :meth:`record_decision`."""
        await self._acall("decision_put", thread_id, checkpoint_ns, input_digest, message)

    # -- whole threads -----------------------------------------------------------------------

    def delete_thread(self, thread_id: str) -> None:
        """Delete the thread's checkpoints, writes, events, ledger entries and decisions."""
        # Checkpoints go first: a crash in between leaves an orphan log, never a thread that
        # could resume without the record of what it already did.
        self.inner.delete_thread(thread_id)
        self._call("delete_thread", thread_id)

    async def adelete_thread(self, thread_id: str) -> None:
        """Async form of :meth:`delete_thread`."""
        await self.inner.adelete_thread(thread_id)
        await self._acall("delete_thread", thread_id)
