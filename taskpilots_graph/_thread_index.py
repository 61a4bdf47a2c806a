"""Which threads a checkpointer holds, and each one's latest root checkpoint.

The one way the package lists a store's threads: :func:`thread_ids` for listings (threads,
metrics, takeovers, plots), :func:`thread_index` where the latest checkpoint id matters too
(the supervisor re-reads a thread's state only when that id moved; retention finds idle
threads).

LangGraph's ``BaseCheckpointSaver`` has no public call that lists thread ids: ``list(None)``
loads and deserialises every checkpoint of every thread, the whole history, on each call.
So this module, and no other, reads the savers LangGraph ships below their public API:
``InMemorySaver.storage`` (a dict by thread), and the ``checkpoints`` table of the SQLite
and PostgreSQL savers through their ``cursor()`` / ``conn`` / ``lock``. Those savers keep one
row per checkpoint keyed by ``(thread_id, checkpoint_ns, checkpoint_id)`` with time-ordered
ids, so one grouped query answers "which threads, and the newest checkpoint of each". Any
other saver is listed through ``list(None)``.
"""

from __future__ import annotations

from typing import Any, Final

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver

__all__ = ["athread_ids", "athread_index", "thread_ids", "thread_index"]

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
    # Compared by name: the SQLite and PostgreSQL savers are optional imports. Subclasses
    # (the recovery checkpointers' own SQLite savers) keep the table, so they count too.
    return any(c.__module__.startswith(module) and c.__name__ == name for c in type(saver).__mro__)


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
    for item in checkpointer.list(None):
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
    async for item in checkpointer.alist(None):
        configurable = item.config["configurable"]
        if configurable.get("checkpoint_ns", "") == "":
            tid, cid = str(configurable["thread_id"]), str(configurable["checkpoint_id"])
            index[tid] = max(index.get(tid, cid), cid)
    return index


def thread_ids(checkpointer: BaseCheckpointSaver[Any]) -> list[str]:
    """Every thread of ``checkpointer`` that has a checkpoint, sorted by id."""
    return sorted(thread_index(checkpointer))


async def athread_ids(checkpointer: BaseCheckpointSaver[Any]) -> list[str]:
    """Async form of :func:`thread_ids`."""
    return sorted(await athread_index(checkpointer))
