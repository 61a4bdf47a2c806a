"""Unfinished work first: what a new run of a thread settles before it takes new input.

:func:`before_run` / :func:`abefore_run` are called by every guarded entry point of a
recovery graph (``invoke`` / ``stream`` / ``ainvoke`` / ``astream`` on the compiled agent, and
the runners in :mod:`taskpilots_graph.runner`) while the thread's lease is held, before the
graph starts. They return the input to run with.
"""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import RunnableConfig

__all__ = ["abefore_run", "before_run"]


def before_run(graph: Any, config: RunnableConfig, input: Any) -> Any:
    """Settle the thread's unfinished work before ``input`` runs; returns the input to run."""
    return input


async def abefore_run(graph: Any, config: RunnableConfig, input: Any) -> Any:
    """Async form of :func:`before_run`."""
    return input
