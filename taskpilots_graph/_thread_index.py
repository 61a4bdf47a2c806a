"""Which threads a checkpointer holds, and each one's latest root checkpoint (for supervisors).

A supervisor looks at every thread on every scan; loading every checkpoint to find the
thread ids (``saver.list(None)``) would read the whole history each time. LangGraph's SQLite
and PostgreSQL savers keep one row per checkpoint keyed by ``(thread_id, checkpoint_ns,
checkpoint_id)`` with time-ordered ids, so one grouped query over that key answers "which
threads, and what is the newest checkpoint of each": the supervisor re-reads a thread's
state only when that id moved. Other savers fall back to ``list(None)``.
"""

from __future__ import annotations

from typing import Any, Final

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver

__all__ = ["athread_index", "thread_index"]

# Root namespace only: subgraph checkpoints belong to their parent thread's run.
_LATEST_SQL: Final = (
    "SELECT thread_id, MAX(checkpoint_id) AS latest FROM checkpoints "
    "WHERE checkpoint_ns = '' GROUP BY thread_id"
)


def _inner(checkpointer: BaseCheckpointSaver[Any]) -> BaseCheckpointSaver[Any]:
    # Recovery checkpointers wrap a LangGraph saver by composition (``.inner``), maybe twice.
    saver = checkpointer
    while isinstance(inner := getattr(saver, "inner", None), BaseCheckpointSaver):
        saver = inner
    return saver


def _rows(rows: Any) -> dict[str, str]:
    index: dict[str, str] = {}
    for row in rows:
        thread_id, latest = (row["thread_id"], row["latest"]) if isinstance(row, dict) else row
        index[str(thread_id)] = str(latest)
    return index


def _memory(saver: InMemorySaver) -> dict[str, str]:
    return {
        str(thread_id): max(spaces[""])
        for thread_id, spaces in list(saver.storage.items())
        if spaces.get("")
    }


def _is(saver: Any, module: str, name: str) -> bool:
    # Compared by name: the SQLite and PostgreSQL savers are optional imports.
    return type(saver).__module__.startswith(module) and type(saver).__name__ == name


def thread_index(checkpointer: BaseCheckpointSaver[Any]) -> dict[str, str]:
    """Thread id → id of its latest root checkpoint, for every thread of ``checkpointer``."""
    saver = _inner(checkpointer)
    if isinstance(saver, InMemorySaver):
        return _memory(saver)
    if _is(saver, "langgraph.checkpoint.sqlite", "SqliteSaver"):
        with saver.cursor(transaction=False) as cur:  # type: ignore[attr-defined]
            return _rows(cur.execute(_LATEST_SQL).fetchall())
    if _is(saver, "langgraph.checkpoint.postgres", "PostgresSaver"):
        conn = saver.conn  # type: ignore[attr-defined]
        if hasattr(conn, "connection"):  # a pool: no need for the saver's lock
            with conn.connection() as c:
                return _rows(c.execute(_LATEST_SQL).fetchall())
        with saver.lock:  # type: ignore[attr-defined]
            return _rows(conn.execute(_LATEST_SQL).fetchall())
    index: dict[str, str] = {}
    for item in saver.list(None):
        configurable = item.config["configurable"]
        if configurable.get("checkpoint_ns", "") == "":
            tid, cid = str(configurable["thread_id"]), str(configurable["checkpoint_id"])
            index[tid] = max(index.get(tid, cid), cid)
    return index


async def athread_index(checkpointer: BaseCheckpointSaver[Any]) -> dict[str, str]:
    """Async form of :func:`thread_index`."""
    saver = _inner(checkpointer)
    if isinstance(saver, InMemorySaver):
        return _memory(saver)
    if _is(saver, "langgraph.checkpoint.sqlite", "AsyncSqliteSaver"):
        await saver.setup()  # type: ignore[attr-defined]
        async with saver.lock, saver.conn.execute(_LATEST_SQL) as cur:  # type: ignore[attr-defined]
            return _rows(await cur.fetchall())
    if _is(saver, "langgraph.checkpoint.postgres", "AsyncPostgresSaver"):
        conn = saver.conn  # type: ignore[attr-defined]
        if hasattr(conn, "connection"):
            async with conn.connection() as c:
                return _rows(await (await c.execute(_LATEST_SQL)).fetchall())
        async with saver.lock:  # type: ignore[attr-defined]
            return _rows(await (await conn.execute(_LATEST_SQL)).fetchall())
    index: dict[str, str] = {}
    async for item in saver.alist(None):
        configurable = item.config["configurable"]
        if configurable.get("checkpoint_ns", "") == "":
            tid, cid = str(configurable["thread_id"]), str(configurable["checkpoint_id"])
            index[tid] = max(index.get(tid, cid), cid)
    return index
