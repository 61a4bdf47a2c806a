"""The library's clock and sleep, replaceable in tests (see :mod:`taskpilots_graph.testing`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["Clock", "asleep", "now", "set_clock", "sleep"]


@dataclass(frozen=True, slots=True)
class Clock:
    """Where the current time comes from and how waiting is done."""

    now: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    asleep: Callable[[float], Awaitable[None]] = asyncio.sleep


_clock = Clock()


def set_clock(clock: Clock) -> Clock:
    """Install ``clock``; returns the previous one so it can be restored."""
    global _clock
    previous, _clock = _clock, clock
    return previous


def now() -> float:
    """Seconds since the epoch, from the installed clock."""
    return _clock.now()


def sleep(seconds: float) -> None:
    """Wait ``seconds`` with the installed clock."""
    if seconds > 0:
        _clock.sleep(seconds)


async def asleep(seconds: float) -> None:
    """Wait ``seconds`` asynchronously with the installed clock."""
    if seconds > 0:
        await _clock.asleep(seconds)
