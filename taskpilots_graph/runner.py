"""Running threads after the fact: ``resume`` a thread by id, in any process."""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.pregel import Pregel
from langgraph.types import StateSnapshot

from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.errors import ConfigurationError, PendingTakeover, ThreadNotFound
from taskpilots_graph.events import EventKind

__all__ = ["aresume", "resume"]


def _config(thread_id: str, config: RunnableConfig | None) -> RunnableConfig:
    if not isinstance(thread_id, str) or not thread_id:
        raise ConfigurationError("thread_id must be a non-empty string")
    base: dict[str, Any] = dict(config or {})
    base["configurable"] = {**base.get("configurable", {}), "thread_id": thread_id}
    return base  # type: ignore[return-value]


def _saver(graph: Pregel[Any, Any]) -> BaseCheckpointSaver[Any]:
    cp = graph.checkpointer
    if not isinstance(cp, BaseCheckpointSaver):
        raise ConfigurationError(
            "resume needs a graph compiled with a checkpointer, e.g. "
            "builder.compile(checkpointer=RecoveryCheckpointer(...))"
        )
    return cp


def _has_work(snapshot: StateSnapshot, thread_id: str) -> bool:
    if snapshot.interrupts:
        raise PendingTakeover(thread_id, [i.id for i in snapshot.interrupts])
    # `next` alone is not enough: after a crash between a task's writes and the next
    # checkpoint, `next` can be empty while `tasks` still holds the finished task.
    return bool(snapshot.next or snapshot.tasks)


def resume(
    graph: Pregel[Any, Any],
    thread_id: str,
    *,
    config: RunnableConfig | None = None,
    **kwargs: Any,
) -> Any:
    """Continue a thread from its latest checkpoint, in this or any other process.

    Completed steps are not run again; side effects recorded in the ledger are reconciled,
    not repeated. A thread with nothing left to do returns its current values.

    Args:
        graph: The compiled graph (with its checkpointer) that ran the thread.
        thread_id: The thread to continue.
        config: Extra run config (callbacks, recursion limit, ...).
        **kwargs: Passed to ``graph.invoke`` (e.g. ``durability=``).

    Returns:
        What ``graph.invoke`` returns.

    Raises:
        ThreadNotFound: If the thread has no checkpoint.
        PendingTakeover: If the thread waits on a person (answer it with ``decide``).
    """
    cfg = _config(thread_id, config)
    cp = _saver(graph)
    if cp.get_tuple(cfg) is None:
        raise ThreadNotFound(thread_id)
    snapshot = graph.get_state(cfg)
    if not _has_work(snapshot, thread_id):
        return snapshot.values
    if isinstance(cp, RecoveryAPI):
        cp.append_event(thread_id, EventKind.RUN_RESUMED, {"next": list(snapshot.next)})
    return graph.invoke(None, cfg, **kwargs)


async def aresume(
    graph: Pregel[Any, Any],
    thread_id: str,
    *,
    config: RunnableConfig | None = None,
    **kwargs: Any,
) -> Any:
    """Async form of :func:`resume`."""
    cfg = _config(thread_id, config)
    cp = _saver(graph)
    if await cp.aget_tuple(cfg) is None:
        raise ThreadNotFound(thread_id)
    snapshot = await graph.aget_state(cfg)
    if not _has_work(snapshot, thread_id):
        return snapshot.values
    if isinstance(cp, RecoveryAPI):
        await cp.aappend_event(thread_id, EventKind.RUN_RESUMED, {"next": list(snapshot.next)})
    return await graph.ainvoke(None, cfg, **kwargs)
