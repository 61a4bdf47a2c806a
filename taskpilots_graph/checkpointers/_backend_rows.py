"""Each backend's own rows, which the public saver API does not reach, for :mod:`._optional`
and :mod:`.retention`: memory and SQLite here, PostgreSQL in :mod:`._optional_pg` (imported
only when such a saver is wrapped)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from taskpilots_graph._twins import Steps, asynced, io, synced
from taskpilots_graph.checkpointers._sqlite_connect import mapped_errors
from taskpilots_graph.checkpointers.memory import AsyncMemoryStore, MemoryStore
from taskpilots_graph.errors import UnsupportedOperation

if TYPE_CHECKING:
    from taskpilots_graph.checkpointers._api import RecoveryAPI

__all__ = ["DELTA_MARKERS", "Rows", "bridge", "drop_memory_checkpoints", "rows_for"]

DELTA_MARKERS = ("counters_since_delta_snapshot", "delta_writes_versioned")
"""Checkpoint metadata keys of threads that use a ``DeltaChannel`` (as LangGraph's
PostgreSQL saver detects them): their values are rebuilt from older checkpoints."""

T = TypeVar("T")


class Rows:
    """Reads and deletions of one backend's own rows, sync and async.

    A backend implements one form (a sync saver the plain methods, an async saver the
    ``a``-prefixed ones) and the other is bridged: a worker thread for a sync saver, the
    saver's own event loop for an async one (from another thread, as LangGraph's async
    savers allow their sync methods).
    """

    has_async = True
    """Whether the wrapped saver's own async methods work (not so for sync savers)."""

    own_prune = False
    """Whether the wrapped saver has LangGraph's ``prune`` itself (PostgreSQL)."""

    def task_paths(self, thread_id: str) -> dict[tuple[str, str, str], str]:
        """The task path of each (namespace, checkpoint id, task id) with pending writes."""
        return self._bridge(self.atask_paths(thread_id))

    def decisions(self, thread_id: str) -> list[tuple[str, str, str, float]]:
        """The thread's model decisions: (namespace, input digest, message, created at)."""
        return self._bridge(self.adecisions(thread_id))

    def copy_artifacts(self, source: str, target: str) -> None:
        """Give ``target`` its own copy of every artifact of ``source``."""
        self._bridge(self.acopy_artifacts(source, target))

    def delete_for_runs(self, run_ids: list[str]) -> None:
        """Delete the runs' checkpoints and their writes in one transaction."""
        self._bridge(self.adelete_for_runs(run_ids))

    def delta_threads(self, thread_ids: list[str]) -> list[str]:
        """The threads among ``thread_ids`` that use a ``DeltaChannel``."""
        return self._bridge(self.adelta_threads(thread_ids))

    async def atask_paths(self, thread_id: str) -> dict[tuple[str, str, str], str]:
        """Async form of :meth:`task_paths`."""
        return await self._off_loop(self.task_paths, thread_id)

    async def adecisions(self, thread_id: str) -> list[tuple[str, str, str, float]]:
        """Async form of :meth:`decisions`."""
        return await self._off_loop(self.decisions, thread_id)

    async def acopy_artifacts(self, source: str, target: str) -> None:
        """Async form of :meth:`copy_artifacts`."""
        await self._off_loop(self.copy_artifacts, source, target)

    async def adelete_for_runs(self, run_ids: list[str]) -> None:
        """Async form of :meth:`delete_for_runs`."""
        await self._off_loop(self.delete_for_runs, run_ids)

    async def adelta_threads(self, thread_ids: list[str]) -> list[str]:
        """Async form of :meth:`delta_threads`."""
        return await self._off_loop(self.delta_threads, thread_ids)

    async def _off_loop(self, call: Callable[..., T], *args: Any) -> T:
        # A sync saver's call blocks: a worker thread keeps the event loop free.
        return await asyncio.to_thread(call, *args)

    def _bridge(self, coro: Coroutine[Any, Any, T]) -> T:
        coro.close()
        raise NotImplementedError  # every backend implements one of the two forms


def rows_for(cp: RecoveryAPI, operation: str) -> Rows:
    """The row access for ``cp``'s wrapped saver.

    Raises:
        UnsupportedOperation: For a saver this library does not know the tables of.
    """
    inner = cp.inner
    if isinstance(inner, InMemorySaver):
        store = getattr(cp, "store", None)  # both checkpointers have one
        memory = store.sync if isinstance(store, AsyncMemoryStore) else store
        if not isinstance(memory, MemoryStore):
            raise UnsupportedOperation(operation, f"{type(inner).__name__} with a custom store")
        return _MemoryRows(inner, memory)
    if isinstance(inner, SqliteSaver):
        return _SqliteRows(inner)
    if isinstance(inner, AsyncSqliteSaver):
        return _AsyncSqliteRows(inner)
    if any(c.__module__.startswith("langgraph.checkpoint.postgres") for c in type(inner).__mro__):
        from taskpilots_graph.checkpointers._optional_pg import postgres_rows

        return postgres_rows(inner, operation)
    raise UnsupportedOperation(operation, type(inner).__name__)


class _MemoryRows(Rows):
    """``InMemorySaver``'s dictionaries and the in-memory recovery store (no I/O: both
    forms run inline)."""

    def __init__(self, saver: InMemorySaver, store: MemoryStore) -> None:
        self.saver = saver
        self.store = store

    def task_paths(self, thread_id: str) -> dict[tuple[str, str, str], str]:
        return {
            (ns, checkpoint_id, task_id): path
            for (t, ns, checkpoint_id), writes in list(self.saver.writes.items())
            if t == thread_id
            for task_id, _, _, path in writes.values()
        }

    def decisions(self, thread_id: str) -> list[tuple[str, str, str, float]]:
        # The store has no listing of its own; read under its lock, as it does.
        store = self.store
        with store._lock:
            return [
                (ns, digest, message, store._decided_at[(t, ns, digest)])
                for (t, ns, digest), message in store._decisions.items()
                if t == thread_id
            ]

    def copy_artifacts(self, source: str, target: str) -> None:
        with self.store._lock:
            for copies in self.store._artifacts.values():
                if source in copies:
                    copies.setdefault(target, copies[source])

    def delete_for_runs(self, run_ids: list[str]) -> None:
        runs = set(run_ids)
        saver = self.saver
        for thread_id, namespaces in list(saver.storage.items()):
            for ns, checkpoints in list(namespaces.items()):
                gone = [
                    checkpoint_id
                    for checkpoint_id, (_, metadata, _) in list(checkpoints.items())
                    if saver.serde.loads_typed(metadata).get("run_id") in runs
                ]
                if gone:
                    drop_memory_checkpoints(saver, thread_id, ns, gone)

    def delta_threads(self, thread_ids: list[str]) -> list[str]:
        saver = self.saver
        return [
            thread_id
            for thread_id in thread_ids
            if any(
                marker in saver.serde.loads_typed(metadata)
                for checkpoints in list(saver.storage.get(thread_id, {}).values())
                for _, metadata, _ in list(checkpoints.values())
                for marker in DELTA_MARKERS
            )
        ]

    async def _off_loop(self, call: Callable[..., T], *args: Any) -> T:
        return call(*args)


def drop_memory_checkpoints(
    saver: InMemorySaver, thread_id: str, ns: str, checkpoint_ids: Iterable[str]
) -> int:
    """Delete checkpoints of one namespace from an ``InMemorySaver``, with their writes and
    the channel values no remaining checkpoint refers to; returns how many were deleted.

    Only values a deleted checkpoint referred to are candidates: a ``put`` running
    meanwhile stores its new values (new versions) before its checkpoint, and those are
    never touched.
    """
    checkpoints = saver.storage.get(thread_id, {}).get(ns, {})
    freed: set[tuple[str, Any]] = set()
    removed = 0
    for checkpoint_id in checkpoint_ids:
        stored = checkpoints.pop(checkpoint_id, None)
        if stored is None:
            continue
        removed += 1
        freed.update(saver.serde.loads_typed(stored[0]).get("channel_versions", {}).items())
        saver.writes.pop((thread_id, ns, checkpoint_id), None)
    kept = {
        item
        for stored in list(checkpoints.values())
        for item in saver.serde.loads_typed(stored[0]).get("channel_versions", {}).items()
    }
    for channel, version in freed - kept:
        saver.blobs.pop((thread_id, ns, channel, version), None)
    return removed


# SQLite: SqliteSaver keeps each checkpoint whole (values inline) in ``checkpoints`` and its
# pending writes in ``writes``; metadata is JSON text. The recovery tables are the store's.
_SQLITE_RUNS = "SELECT value FROM json_each(?)"
_SQLITE = {
    "task_paths": "SELECT DISTINCT checkpoint_ns, checkpoint_id, task_id, task_path "
    "FROM writes WHERE thread_id = ?",
    "decisions": "SELECT checkpoint_ns, input_digest, message, created_at "
    "FROM taskpilots_decisions WHERE thread_id = ?",
    "copy_artifacts": "INSERT INTO taskpilots_artifacts "
    "(id, thread_id, media_type, size, created_at, payload) "
    "SELECT id, ?, media_type, size, created_at, payload FROM taskpilots_artifacts "
    "WHERE thread_id = ? ON CONFLICT (id, thread_id) DO NOTHING",
    "delete_writes": "DELETE FROM writes WHERE EXISTS (SELECT 1 FROM checkpoints c "
    "WHERE c.thread_id = writes.thread_id AND c.checkpoint_ns = writes.checkpoint_ns "
    "AND c.checkpoint_id = writes.checkpoint_id "
    f"AND json_extract(CAST(c.metadata AS TEXT), '$.run_id') IN ({_SQLITE_RUNS}))",
    "delete_checkpoints": "DELETE FROM checkpoints WHERE "
    f"json_extract(CAST(metadata AS TEXT), '$.run_id') IN ({_SQLITE_RUNS})",
    "delta": "SELECT DISTINCT thread_id FROM checkpoints "
    "WHERE thread_id IN (SELECT value FROM json_each(?)) AND ("
    + " OR ".join(
        f"json_extract(CAST(metadata AS TEXT), '$.{m}') IS NOT NULL" for m in DELTA_MARKERS
    )
    + ")",
}

_Statements = Sequence[tuple[str, Sequence[Any]]]


class _SqliteQueries(Rows):
    """A SQLite file's operations, written once for both savers: a subclass runs a list of
    statements in one transaction (``_run`` or ``_arun``, one of them bridged), giving the
    rows of the last. The bodies take ``self: Rows`` as the methods they override do."""

    def _task_paths(self: Rows, thread_id: str) -> Steps[dict[tuple[str, str, str], str]]:
        found = yield io(self, "_run", "copy_thread", [(_SQLITE["task_paths"], (thread_id,))])
        return {(ns, cid, task): path for ns, cid, task, path in found}

    def _decisions(self: Rows, thread_id: str) -> Steps[list[tuple[str, str, str, float]]]:
        found = yield io(self, "_run", "copy_thread", [(_SQLITE["decisions"], (thread_id,))])
        return [(ns, d, m, float(at)) for ns, d, m, at in found]

    def _copy_artifacts(self: Rows, source: str, target: str) -> Steps[None]:
        yield io(self, "_run", "copy_thread", [(_SQLITE["copy_artifacts"], (target, source))])

    def _delete_for_runs(self: Rows, run_ids: list[str]) -> Steps[None]:
        runs = (json.dumps(run_ids),)
        statements = [(_SQLITE["delete_writes"], runs), (_SQLITE["delete_checkpoints"], runs)]
        yield io(self, "_run", "delete_for_runs", statements)

    def _delta_threads(self: Rows, thread_ids: list[str]) -> Steps[list[str]]:
        found = yield io(self, "_run", "prune", [(_SQLITE["delta"], (json.dumps(thread_ids),))])
        return [str(row[0]) for row in found]

    task_paths, atask_paths = synced(_task_paths), asynced(_task_paths)
    decisions, adecisions = synced(_decisions), asynced(_decisions)
    copy_artifacts, acopy_artifacts = synced(_copy_artifacts), asynced(_copy_artifacts)
    delete_for_runs, adelete_for_runs = synced(_delete_for_runs), asynced(_delete_for_runs)
    delta_threads, adelta_threads = synced(_delta_threads), asynced(_delta_threads)


class _SqliteRows(_SqliteQueries):
    """``SqliteSaver``'s file, on its connection and under its lock."""

    has_async = False

    def __init__(self, saver: SqliteSaver) -> None:
        self.saver = saver

    def _run(self, operation: str, statements: _Statements) -> list[Any]:
        conn = self.saver.conn
        with mapped_errors(operation), self.saver.cursor(transaction=False) as cur:
            try:
                rows = [cur.execute(sql, params).fetchall() for sql, params in statements]
                conn.commit()
            except BaseException:
                conn.rollback()
                raise
        return rows[-1] if rows else []

    async def _arun(self, operation: str, statements: _Statements) -> list[Any]:
        return await self._off_loop(self._run, operation, statements)


class _AsyncSqliteRows(_SqliteQueries):
    """``AsyncSqliteSaver``'s file, on its connection and under its lock."""

    def __init__(self, saver: AsyncSqliteSaver) -> None:
        self.saver = saver

    async def _arun(self, operation: str, statements: _Statements) -> list[Any]:
        await self.saver.setup()  # takes the lock itself
        conn = self.saver.conn
        rows: list[Any] = []
        async with self.saver.lock:
            with mapped_errors(operation):
                try:
                    for sql, params in statements:
                        async with conn.execute(sql, params) as cur:
                            rows = list(await cur.fetchall())
                    await conn.commit()
                except BaseException:
                    await conn.rollback()
                    raise
        return rows

    def _run(self, operation: str, statements: _Statements) -> list[Any]:
        return bridge(self.saver.loop, self._arun(operation, statements))


def bridge(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on an async saver's ``loop`` from another thread, as the saver's own
    sync methods do.

    Raises:
        asyncio.InvalidStateError: When called on that loop's thread (it would wait on
            itself forever): use the async form there.
    """
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise asyncio.InvalidStateError(
            "synchronous calls to an async checkpointer are only allowed from a different "
            "thread; from the event loop use the a-prefixed method"
        )
    return asyncio.run_coroutine_threadsafe(coro, loop).result()
