"""In-process recovery store, the companion of LangGraph's ``InMemorySaver``.

Nothing here survives the process, exactly like the saver it accompanies; it exists for tests,
notebooks and quick experiments.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from taskpilots_graph.checkpointers._rows import entry_params
from taskpilots_graph.checkpointers.artifacts import PreparedArtifact
from taskpilots_graph.checkpointers.base import DecisionRecord, PendingRecord
from taskpilots_graph.checkpointers.messages import LoadedRow, MessageRows
from taskpilots_graph.compaction import CompactionPolicy
from taskpilots_graph.errors import LedgerConflict
from taskpilots_graph.events import Event
from taskpilots_graph.ledger import CommittedEffect, LedgerEntry, LedgerStatus, world_keys

__all__ = ["AsyncMemoryStore", "MemoryStore"]


class MemoryStore:
    """Recovery store held in process memory (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, list[Event]] = {}
        self._ledger: dict[str, LedgerEntry] = {}
        self._decisions: dict[tuple[str, str, str], str] = {}
        self._decided_at: dict[tuple[str, str, str], float] = {}
        # artifact id -> thread id -> payload: one copy per thread, as in the SQL stores.
        self._artifacts: dict[str, dict[str, bytes]] = {}
        self._messages: dict[str, _ThreadMessages] = {}

    def setup(self, inner_setup: Callable[[], None] | None = None) -> None:
        """Nothing to create in memory; runs ``inner_setup`` if given."""
        if inner_setup is not None:
            inner_setup()

    def _append(self, records: Sequence[PendingRecord]) -> list[Event]:
        stored = []
        for record in records:
            if isinstance(record, DecisionRecord):
                self._decide(record)
                continue
            log = self._events.setdefault(record.thread_id, [])
            log.append(record.to_event(len(log) + 1))
            stored.append(log[-1])
        return stored

    def append_events(self, records: Sequence[PendingRecord]) -> list[Event]:
        with self._lock:
            return self._append(records)

    def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        with self._lock:
            return [e for e in self._events.get(thread_id, ()) if e.seq > after_seq]

    def delete_thread(self, thread_id: str, *, forget_effects: bool = False) -> None:
        with self._lock:
            self._events.pop(thread_id, None)
            own = [e for e in self._ledger.values() if e.thread_id == thread_id]
            kept = set() if forget_effects else world_keys(own)
            for entry in own:
                if entry.key not in kept:
                    del self._ledger[entry.key]
            self._decisions = {k: m for k, m in self._decisions.items() if k[0] != thread_id}
            self._decided_at = {k: t for k, t in self._decided_at.items() if k[0] != thread_id}
            self._drop_artifacts(thread_id)
            self._messages.pop(thread_id, None)

    def messages_write(self, rows: MessageRows) -> None:
        """Store a checkpoint's new sequences, references and messages (see :mod:`.messages`)."""
        with self._lock:
            stored = self._messages.setdefault(rows.thread_id, _ThreadMessages())
            for message in rows.messages:
                stored.messages.setdefault(message.key, (message.type, message.payload))
            for sequence in rows.sequences:
                stored.parents[sequence.seq] = (sequence.parent_seq, sequence.parent_len)
            for seq, position, key in rows.refs:
                stored.refs.setdefault(seq, {})[position] = key

    def messages_read(self, thread_id: str, seq: int, length: int) -> list[LoadedRow]:
        """The rows of positions ``0..length-1`` of a sequence, as the SQL stores read them."""
        with self._lock:
            stored = self._messages.get(thread_id, _ThreadMessages())
            rows: list[LoadedRow] = []
            upto: int = length
            current: int | None = seq
            # Walk to the root: each sequence gives the positions from its parent_len up to
            # the limit its child left it; missing rows are simply not returned.
            while current is not None and upto > 0:
                parent, parent_len = stored.parents.get(current, (None, 0))
                for position, key in stored.refs.get(current, {}).items():
                    if position < upto and key in stored.messages:
                        rows.append((position, key, *stored.messages[key]))
                current, upto = parent, min(upto, parent_len)
        return sorted(rows)

    def ledger_get(self, key: str) -> LedgerEntry | None:
        with self._lock:
            return self._ledger.get(key)

    def ledger_write(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[PendingRecord] = (),
    ) -> list[Event]:
        entry_params(entry)  # same validation as the SQL stores
        with self._lock:
            current = self._ledger.get(entry.key)
            found = None if current is None else (current.status, current.attempt)
            if current is not None if expect is None else found != expect:
                raise LedgerConflict(entry.key)
            self._ledger[entry.key] = entry
            return self._append(events)

    def ledger(self, thread_id: str | None = None) -> list[LedgerEntry]:
        with self._lock:
            entries = [e for e in self._ledger.values() if thread_id in (None, e.thread_id)]
        return sorted(entries, key=lambda e: (e.created_at, e.key))

    def ledger_repeat(self, thread_id: str, tool: str, args_digest: str) -> CommittedEffect | None:
        wanted = (tool, args_digest, LedgerStatus.COMMITTED)
        for step, entry in enumerate(self.ledger(thread_id), start=1):
            if (entry.tool, entry.args_digest, entry.status) == wanted:
                return CommittedEffect(entry, step)
        return None

    def ledger_committed_digests(self, thread_id: str) -> list[tuple[str, str]]:
        return sorted(
            {
                (e.tool, e.args_digest)
                for e in self.ledger(thread_id)
                if e.status is LedgerStatus.COMMITTED
            }
        )

    def decision_get(self, thread_id: str, checkpoint_ns: str, input_digest: str) -> str | None:
        with self._lock:
            return self._decisions.get((thread_id, checkpoint_ns, input_digest))

    def decision_digests(self, thread_id: str, checkpoint_ns: str) -> list[str]:
        with self._lock:
            return [d for t, ns, d in self._decisions if (t, ns) == (thread_id, checkpoint_ns)]

    def _decide(self, record: DecisionRecord) -> None:
        key = (record.thread_id, record.checkpoint_ns, record.input_digest)
        if key not in self._decisions:
            self._decisions[key] = record.message
            self._decided_at[key] = record.created_at

    def decision_forget(self, thread_id: str, since: float) -> int:
        with self._lock:
            gone = [k for k, at in self._decided_at.items() if k[0] == thread_id and at > since]
            for key in gone:
                del self._decisions[key], self._decided_at[key]
            return len(gone)

    def put_artifact(self, artifact: PreparedArtifact) -> None:
        with self._lock:
            copies = self._artifacts.setdefault(artifact.ref.id, {})
            copies.setdefault(artifact.thread_id, artifact.data)

    def get_artifact(self, artifact_id: str) -> bytes | None:
        with self._lock:
            copies = self._artifacts.get(artifact_id)
            return next(iter(copies.values())) if copies else None

    def _drop_artifacts(self, thread_id: str) -> None:
        for artifact_id in list(self._artifacts):
            copies = self._artifacts[artifact_id]
            copies.pop(thread_id, None)
            if not copies:
                del self._artifacts[artifact_id]

    def delete_artifacts(self, thread_id: str) -> None:
        with self._lock:
            self._drop_artifacts(thread_id)

    def compact_events(self, thread_id: str, policy: CompactionPolicy) -> int:
        with self._lock:
            log = self._events.get(thread_id, [])
            position = {event.seq: i for i, event in enumerate(log)}
            plan = policy.plan(log)
            for change in plan:
                i = position[change.seq]
                log[i] = dataclasses.replace(log[i], payload=change.payload)
        return len(plan)


class _ThreadMessages:
    """One thread's stored messages: payloads by key, sequences' parents, references."""

    __slots__ = ("messages", "parents", "refs")

    def __init__(self) -> None:
        self.messages: dict[bytes, tuple[str, bytes]] = {}
        self.parents: dict[int, tuple[int | None, int]] = {}
        self.refs: dict[int, dict[int, bytes]] = {}


class AsyncMemoryStore:
    """Async face of :class:`MemoryStore`; operations never block, so they run inline.

    Every public method of :class:`MemoryStore` but ``setup`` is offered as a coroutine
    function of the same name and arguments.
    """

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.sync = store or MemoryStore()

    async def setup(self, inner_setup: Callable[[], Awaitable[None]] | None = None) -> None:
        """Nothing to create in memory; awaits ``inner_setup`` if given."""
        if inner_setup is not None:
            await inner_setup()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # (copy and pickle probe dunders before ``sync`` exists)
            raise AttributeError(name)
        method = getattr(self.sync, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return method(*args, **kwargs)

        return call
