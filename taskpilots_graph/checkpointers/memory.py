"""In-process recovery store, the companion of LangGraph's ``InMemorySaver``.

Nothing here survives the process, exactly like the saver it accompanies; it exists for tests,
notebooks and quick experiments.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

from taskpilots_graph.checkpointers.base import EventRecord
from taskpilots_graph.events import Event

__all__ = ["AsyncMemoryStore", "MemoryStore"]


class MemoryStore:
    """Recovery store held in process memory (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, list[Event]] = {}

    def setup(self, inner_setup: Callable[[], None] | None = None) -> None:
        """Nothing to create in memory; runs ``inner_setup`` if given."""
        if inner_setup is not None:
            inner_setup()

    def append_event(self, record: EventRecord) -> Event:
        with self._lock:
            log = self._events.setdefault(record.thread_id, [])
            event = record.to_event(len(log) + 1)
            log.append(event)
            return event

    def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        with self._lock:
            return list(self._events.get(thread_id, ())[after_seq:])

    def delete_thread(self, thread_id: str) -> None:
        with self._lock:
            self._events.pop(thread_id, None)


class AsyncMemoryStore:
    """Async face of :class:`MemoryStore`; operations never block, so they run inline."""

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.sync = store or MemoryStore()

    async def setup(self, inner_setup: Callable[[], Awaitable[None]] | None = None) -> None:
        """Nothing to create in memory; awaits ``inner_setup`` if given."""
        if inner_setup is not None:
            await inner_setup()

    async def append_event(self, record: EventRecord) -> Event:
        return self.sync.append_event(record)

    async def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        return self.sync.events(thread_id, after_seq=after_seq)

    async def delete_thread(self, thread_id: str) -> None:
        self.sync.delete_thread(thread_id)
