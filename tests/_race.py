"""Real processes racing round after round: the machinery of the multi-process race tests.

Each racer runs in a process of its own (the "spawn" context, so nothing is inherited from
pytest's process), and every round starts at one instant for all of them: they wait on a
shared barrier. A racer is a module-level function (spawn pickles it by name) called as
``racer(*args, barrier)`` and returning what it wants to report; its exception fails the
test with its traceback, and aborts the barrier so the other racers stop too.
"""

from __future__ import annotations

import multiprocessing
import queue
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import pytest


def _report(
    index: int, racer: Callable[..., Any], args: tuple[Any, ...], barrier: Any, out: Any
) -> None:
    try:
        out.put((index, "ok", racer(*args, barrier)))
    except BaseException:
        barrier.abort()
        out.put((index, "error", traceback.format_exc()))


def race(
    racer: Callable[..., Any], racers: Sequence[tuple[Any, ...]], *, timeout: float = 180
) -> list[Any]:
    """Run ``racer(*args, barrier)`` for each ``args`` in a process of its own.

    Returns:
        What each racer returned, in the order of ``racers``.
    """
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(racers), timeout=90)
    out = context.Queue()
    processes = [
        context.Process(target=_report, args=(index, racer, tuple(args), barrier, out))
        for index, args in enumerate(racers)
    ]
    for process in processes:
        process.start()
    reports: dict[int, Any] = {}
    try:
        for _ in processes:
            index, status, body = out.get(timeout=timeout)
            assert status == "ok", body
            reports[index] = body
    except queue.Empty:
        pytest.fail("a racing process did not report")
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [reports[index] for index in range(len(racers))]
