"""Pieces shared by the sync and async recovery checkpointers (I/O free): the recovery store
protocols (a store also keeps artifacts, :mod:`.artifacts`, and compacts its event log in
place), the records a store writes beside a ledger entry, and event-row decoding.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from taskpilots_graph.checkpointers.artifacts import PreparedArtifact
from taskpilots_graph.checkpointers.messages import LoadedRow, MessageRows
from taskpilots_graph.compaction import CompactionPolicy
from taskpilots_graph.errors import CorruptRecordError
from taskpilots_graph.events import Event, EventRecord, event_from_row
from taskpilots_graph.ledger import CommittedEffect, LedgerEntry, LedgerStatus

__all__ = [
    "AsyncMessageStore",
    "AsyncRecoveryStore",
    "DecisionRecord",
    "HeldCommit",
    "MessageStore",
    "PendingRecord",
    "RecoveryStore",
    "rows_to_events",
    "skipping_corrupt_events",
]


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """A model decision to record, written like events (``append_events``, ``ledger_write``).

    The act node needs a decision on disk before the first side effect it leads to, not
    before: deferred into the ledger intent's transaction, it costs no commit of its own.
    """

    thread_id: str
    checkpoint_ns: str
    input_digest: str
    message: str
    created_at: float

    def params(self) -> dict[str, Any]:
        """Parameters of the decision insert (``LEDGER["decision_put"]``)."""
        return asdict(self)


PendingRecord = EventRecord | DecisionRecord
"""What a store writes in one transaction beside a ledger entry: events and decisions."""


@dataclass(frozen=True, slots=True)
class HeldCommit:
    """A ledger commit held for the put_writes of the task that performed it.

    Only commits of tools that settle a lost commit themselves ride (an idempotent service
    or a pre-check): written in the same transaction as the task's writes, a crash loses
    both or neither, and a lost one is settled on resume like any unrecorded attempt.
    """

    entry: LedgerEntry
    expect: tuple[LedgerStatus, int] | None
    events: tuple[PendingRecord, ...]
    task_id: str
    parked: bool = False
    """Its put_writes failed: only the put of the next checkpoint of the run that failed
    writes it (before that checkpoint); the thread's next run drops it and settles the call
    as an unrecorded attempt, as it would after a commit that failed on its own."""


_SKIPPED: ContextVar[list[CorruptRecordError] | None] = ContextVar(
    "taskpilots_skipped_event_rows", default=None
)


@contextmanager
def skipping_corrupt_events() -> Iterator[list[CorruptRecordError]]:
    """Within the block, an event row that cannot be decoded is skipped and its error
    collected in the yielded list, instead of failing the whole read.

    For listings and metrics only, which must not fail a whole store for one bad row; a
    run, a resume or a replay always reads with corrupt rows refused (a skipped event could
    make a run repeat an effect). Works for stores called in this context (the sync
    checkpointer, and the async one awaited from this task).
    """
    skipped: list[CorruptRecordError] = []
    token = _SKIPPED.set(skipped)
    try:
        yield skipped
    finally:
        _SKIPPED.reset(token)


_EVENT_COLUMNS = ("thread_id", "seq", "kind", "ts", "checkpoint_ns", "checkpoint_id", "payload")


def rows_to_events(rows: Iterable[Sequence[Any]]) -> list[Event]:
    """Decode rows selected in the column order of ``SELECT_EVENTS``.

    Raises:
        CorruptRecordError: For a row that cannot be decoded (skipped and collected instead
            inside :func:`skipping_corrupt_events`).
    """
    skipped = _SKIPPED.get()
    events = []
    for row in rows:
        try:
            event = event_from_row(**dict(zip(_EVENT_COLUMNS, row, strict=False)))
        except CorruptRecordError as exc:
            if skipped is None:
                raise
            skipped.append(exc)
            continue
        events.append(event)
    return events


class RecoveryStore(Protocol):
    """Synchronous storage of the recovery data that lives beside the checkpoints."""

    def setup(self, inner_setup: Callable[[], None] | None = None) -> None:
        """Run the saver's ``inner_setup``, then create or migrate the store's tables;
        idempotent, and safe when several processes call it at once."""

    def append_events(self, records: Sequence[PendingRecord]) -> list[Event]:
        """Append events and record decisions (the first record for an input wins) in one
        transaction; durable on return."""

    def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        """The thread's events with ``seq > after_seq``, in order."""

    def delete_thread(self, thread_id: str, *, forget_effects: bool = False) -> None:
        """Remove what is stored for the thread; entries under a business key stay unless
        ``forget_effects``."""

    def ledger_get(self, key: str) -> LedgerEntry | None:
        """The entry recorded under ``key``, if any."""

    def ledger_write(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[PendingRecord] = (),
    ) -> list[Event]:
        """Insert (``expect=None``) or compare-and-set update an entry, with its events.

        Entry, events and decisions commit in one transaction, durable on return.

        Raises:
            LedgerConflict: If the key exists (insert) or its (status, attempt) moved on.
        """

    def ledger(self, thread_id: str | None = None) -> list[LedgerEntry]:
        """Entries of one thread, or of all threads, oldest first."""

    def ledger_repeat(self, thread_id: str, tool: str, args_digest: str) -> CommittedEffect | None:
        """The thread's earliest committed entry of ``tool`` with these canonical arguments,
        and its position among the thread's entries (oldest first, from 1); one indexed
        read."""

    def ledger_committed_digests(self, thread_id: str) -> list[tuple[str, str]]:
        """The (tool, arguments digest) pairs of the thread's committed entries."""

    def decision_get(self, thread_id: str, checkpoint_ns: str, input_digest: str) -> str | None:
        """A model decision recorded for exactly this input, if any."""

    def decision_digests(self, thread_id: str, checkpoint_ns: str) -> list[str]:
        """The input digests of every decision recorded for the thread and namespace."""

    def decision_forget(self, thread_id: str, since: float) -> int:
        """Delete the thread's decisions recorded after ``since`` (epoch seconds)."""

    def put_artifact(self, artifact: PreparedArtifact) -> None:
        """Store an artifact for its thread (a no-op if the thread has it); durable on return."""

    def get_artifact(self, artifact_id: str) -> bytes | None:
        """The payload stored under ``artifact_id`` by any thread, or ``None``."""

    def delete_artifacts(self, thread_id: str) -> None:
        """Remove the thread's artifacts (``delete_thread`` does this too)."""

    def compact_events(self, thread_id: str, policy: CompactionPolicy) -> int:
        """Rewrite the payloads ``policy`` reduces, in one transaction; seq and kind stay.

        Returns:
            The number of events rewritten.

        Raises:
            CorruptRecordError: If a stored event cannot be decoded (nothing is rewritten).
        """


class AsyncRecoveryStore(Protocol):
    """Asynchronous twin of :class:`RecoveryStore`."""

    async def setup(self, inner_setup: Callable[[], Awaitable[None]] | None = None) -> None:
        """Async twin of :meth:`RecoveryStore.setup`."""

    async def append_events(self, records: Sequence[PendingRecord]) -> list[Event]:
        """Append events (and write decisions) in one transaction; durable on return."""

    async def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        """The thread's events with ``seq > after_seq``, in order."""

    async def delete_thread(self, thread_id: str, *, forget_effects: bool = False) -> None:
        """Remove what is stored for the thread; entries under a business key stay unless
        ``forget_effects``."""

    async def ledger_get(self, key: str) -> LedgerEntry | None:
        """The entry recorded under ``key``, if any."""

    async def ledger_write(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[PendingRecord] = (),
    ) -> list[Event]:
        """Async twin of :meth:`RecoveryStore.ledger_write`."""

    async def ledger(self, thread_id: str | None = None) -> list[LedgerEntry]:
        """Entries of one thread, or of all threads, oldest first."""

    async def ledger_repeat(
        self, thread_id: str, tool: str, args_digest: str
    ) -> CommittedEffect | None:
        """Async twin of :meth:`RecoveryStore.ledger_repeat`."""

    async def ledger_committed_digests(self, thread_id: str) -> list[tuple[str, str]]:
        """Async twin of :meth:`RecoveryStore.ledger_committed_digests`."""

    async def decision_get(
        self, thread_id: str, checkpoint_ns: str, input_digest: str
    ) -> str | None:
        """A model decision recorded for exactly this input, if any."""

    async def decision_digests(self, thread_id: str, checkpoint_ns: str) -> list[str]:
        """The input digests of every decision recorded for the thread and namespace."""

    async def decision_forget(self, thread_id: str, since: float) -> int:
        """Delete the thread's decisions recorded after ``since`` (epoch seconds)."""

    async def put_artifact(self, artifact: PreparedArtifact) -> None:
        """Async twin of :meth:`RecoveryStore.put_artifact`."""

    async def get_artifact(self, artifact_id: str) -> bytes | None:
        """Async twin of :meth:`RecoveryStore.get_artifact`."""

    async def delete_artifacts(self, thread_id: str) -> None:
        """Async twin of :meth:`RecoveryStore.delete_artifacts`."""

    async def compact_events(self, thread_id: str, policy: CompactionPolicy) -> int:
        """Async twin of :meth:`RecoveryStore.compact_events`."""


class MessageStore(Protocol):
    """A recovery store that also keeps a thread's messages once (:mod:`.messages`).

    Every built-in store is one. A store without these methods still works: the
    checkpointer then leaves message lists inside the checkpoints, as LangGraph does.
    """

    def messages_write(self, rows: MessageRows) -> None:
        """Insert new sequences, references and (if the thread lacks their key) messages,
        atomically; durable on return. Inside a ride (:func:`._ride_rows.riding`, opened
        only for a saver declaring ``rides_messages``) a built-in store hands the rows to
        the saver's ``put`` instead, which commits them with the checkpoint."""

    def messages_read(self, thread_id: str, seq: int, length: int) -> list[LoadedRow]:
        """The rows of positions ``0..length-1`` of sequence ``seq`` (following its
        parents), ordered by position; missing rows are left out, not invented."""


class AsyncMessageStore(Protocol):
    """Async twin of :class:`MessageStore`."""

    async def messages_write(self, rows: MessageRows) -> None:
        """Async twin of :meth:`MessageStore.messages_write`."""

    async def messages_read(self, thread_id: str, seq: int, length: int) -> list[LoadedRow]:
        """Async twin of :meth:`MessageStore.messages_read`."""
