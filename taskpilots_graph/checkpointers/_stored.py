"""The checkpoints this process knows to be on disk, for a step about to act.

Under LangGraph's default ``durability="async"`` a step's input checkpoint (the one holding
the model's tool calls) is written in the background while the step runs. Until it is on
disk, a crash would make the model decide again, so a side effect must carry the model's
decision in its own durable intent. The put was submitted before the step began, though,
and usually ends within milliseconds: a step that waits for it briefly before its first
side effect can then act as under ``"sync"`` (no decision record, no intent for an
idempotent tool). When the put does not end in time, the step keeps the cautious path.

A checkpoint counts as stored once this process wrote it or read it back; the record is
bounded (the most recent ids), so a forgotten one only means the cautious path.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from typing import Final

__all__ = ["STORED_WAIT", "StoredCheckpoints"]

STORED_WAIT: Final = 0.5
"""Longest wait, in seconds, for a step's input checkpoint to reach the disk."""

_REMEMBERED: Final = 4096
_POLL_MAX: Final = 0.005


class StoredCheckpoints:
    """A bounded record of stored ``(thread id, checkpoint id)`` pairs, with waits."""

    def __init__(self) -> None:
        self._ids: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._changed = threading.Condition()

    def note(self, thread_id: str, checkpoint_id: str) -> None:
        """Record a checkpoint as on disk."""
        with self._changed:
            self._ids[(thread_id, checkpoint_id)] = None
            if len(self._ids) > _REMEMBERED:
                self._ids.popitem(last=False)
            self._changed.notify_all()

    def wait(self, thread_id: str, checkpoint_id: str, timeout: float) -> bool:
        """Whether the checkpoint is on disk, waiting up to ``timeout`` seconds for it."""
        key = (thread_id, checkpoint_id)
        with self._changed:
            return self._changed.wait_for(lambda: key in self._ids, timeout)

    async def await_stored(self, thread_id: str, checkpoint_id: str, timeout: float) -> bool:
        """Async form of :meth:`wait`: polls, yielding to the loop that runs the put."""
        key = (thread_id, checkpoint_id)
        deadline = time.monotonic() + timeout
        delay = 0.0
        while True:
            with self._changed:  # held for a lookup only: never blocks the loop
                if key in self._ids:
                    return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(max(delay * 2, 0.0002), _POLL_MAX)
