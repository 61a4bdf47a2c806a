"""Checkpoints that reach the disk late.

Under ``durability="async"`` a step waits briefly for its input checkpoint before its first
side effect (``taskpilots_graph.checkpointers._stored``). With the saver's puts slowed past
that wait, the step takes the cautious path instead: the model's decision is recorded with
the intent. Tests of that path slow the puts with :func:`slow_puts`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from taskpilots_graph.checkpointers._stored import STORED_WAIT

__all__ = ["LATE", "slow_puts"]

LATE = STORED_WAIT + 0.3
"""How late each checkpoint reaches the disk, in seconds."""


def slow_puts(monkeypatch: pytest.MonkeyPatch, cp: Any) -> None:
    """Make every put of ``cp``'s LangGraph saver (sync and async) reach the disk late."""
    inner = cp.inner
    put, aput = inner.put, inner.aput

    def late_put(*args: Any, **kwargs: Any) -> Any:
        time.sleep(LATE)
        return put(*args, **kwargs)

    async def late_aput(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(LATE)
        return await aput(*args, **kwargs)

    monkeypatch.setattr(inner, "put", late_put)
    monkeypatch.setattr(inner, "aput", late_aput)
