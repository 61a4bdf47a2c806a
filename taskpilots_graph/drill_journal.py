"""What a drill watches: every completed tool execution, journaled outside the agent.

:class:`Journal` notes each execution in a SQLite file of its own, outside the agent's
database and process, so a SIGKILL cannot hide a repeat. :func:`instrumented` swaps a
graph's tools (:mod:`taskpilots_graph.tool_tables`) for journaling twins (and, for a drill,
one faulty twin) for the duration of a block; :mod:`taskpilots_graph.drill_runs` drives the
graph with them.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any

from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool

from taskpilots_graph.tool_tables import tool_tables

__all__ = ["Journal", "Wrap", "instrumented"]


class Journal:
    """Completed tool executions, in a SQLite file that survives the process that ran them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        with closing(self._connect()) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS executions (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                "thread_id TEXT NOT NULL, tool TEXT NOT NULL, args TEXT NOT NULL, key TEXT)"
            )

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30, isolation_level=None)

    def record(self, thread_id: str, tool: str, args: dict[str, Any], key: str | None) -> None:
        """Durably note one completed execution (autocommit: done before a SIGKILL)."""
        with closing(self._connect()) as conn:
            conn.execute(
                "INSERT INTO executions (thread_id, tool, args, key) VALUES (?, ?, ?, ?)",
                (thread_id, tool, _canonical(args), key),
            )

    def executions(self, thread_id: str) -> list[tuple[str, str, str | None]]:
        """``(tool, canonical args, key)`` of the thread's executions, in order."""
        with closing(self._connect()) as conn:
            rows = conn.execute(
                "SELECT tool, args, key FROM executions WHERE thread_id = ? ORDER BY seq",
                (thread_id,),
            ).fetchall()
        return [(str(t), str(a), k) for t, a, k in rows]


def _canonical(args: Any) -> str:
    return json.dumps(args, sort_keys=True, default=str, separators=(",", ":"))


# -- instrumenting a graph's tools -------------------------------------------------------------

Wrap = Callable[[BaseTool], Any]  # a tool -> its testing.FaultyTool


def _recording(tool: BaseTool, on_done: Callable[[str, dict[str, Any], str | None], None]) -> Any:
    """``tool`` with every completed execution reported to ``on_done`` (declaration kept)."""
    from taskpilots_graph.tools import SideEffectTool, invocation_key, twin

    inner = tool.tool if isinstance(tool, SideEffectTool) else tool

    def run(config: RunnableConfig, **kwargs: Any) -> Any:
        result = inner.invoke(kwargs, config=config)
        on_done(inner.name, kwargs, invocation_key())
        return result

    async def arun(config: RunnableConfig, **kwargs: Any) -> Any:
        result = await inner.ainvoke(kwargs, config=config)
        on_done(inner.name, kwargs, invocation_key())
        return result

    return twin(tool, run, arun)


@contextmanager
def instrumented(
    graph: Any,
    journal: Journal,
    thread_id: str,
    *,
    fault: tuple[str, Wrap] | None = None,
    kill_after: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Swap the graph's tools for journaling (and one faulty) twins; restore them after.

    Yields the fault injector (a :class:`~taskpilots_graph.testing.FaultyTool`) by name.
    """

    def on_done(tool: str, args: dict[str, Any], key: str | None) -> None:
        journal.record(thread_id, tool, args, key)
        if tool == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # the crash drill: die right after the effect

    tables = tool_tables(graph)
    saved = [dict(t) for t in tables]
    faults: dict[str, Any] = {}
    try:
        for table in tables:
            for name, tool in list(table.items()):
                twin = _recording(tool, on_done)
                if fault is not None and fault[0] == name:
                    faulty = faults.get(name) or fault[1](twin)
                    faults[name] = faulty
                    twin = faulty.tool  # the same injector behind every table
                table[name] = twin
        yield faults
    finally:
        for table, original in zip(tables, saved, strict=True):
            table.clear()
            table.update(original)
