"""The rows of LangGraph's PostgreSQL savers that :mod:`._optional` needs (sync and async).

Kept apart so that ``psycopg`` is imported only when a PostgreSQL saver is wrapped (the
``postgres`` extra is optional). The statements run on the saver's own cursor (its pool or
its connection, under its lock) and the recovery tables live in the same database.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from taskpilots_graph.checkpointers._backend_rows import Rows, bridge
from taskpilots_graph.errors import UnsupportedOperation

__all__ = ["postgres_rows"]

_SQL: Final = {
    "task_paths": "SELECT DISTINCT checkpoint_ns, checkpoint_id, task_id, task_path "
    "FROM checkpoint_writes WHERE thread_id = %s",
    "decisions": "SELECT checkpoint_ns, input_digest, message, created_at "
    "FROM taskpilots_decisions WHERE thread_id = %s",
    "copy_artifacts": "INSERT INTO taskpilots_artifacts "
    "(id, thread_id, media_type, size, created_at, payload) "
    "SELECT id, %s, media_type, size, created_at, payload FROM taskpilots_artifacts "
    "WHERE thread_id = %s ON CONFLICT (id, thread_id) DO NOTHING",
    # The runs' checkpoints go first, returning what their values were stored under.
    "delete_checkpoints": "DELETE FROM checkpoints WHERE metadata ->> 'run_id' = ANY(%s) "
    "RETURNING thread_id, checkpoint_ns, checkpoint_id, "
    "checkpoint -> 'channel_versions' AS versions",
    "delete_writes": "DELETE FROM checkpoint_writes "
    "WHERE thread_id = %s AND checkpoint_ns = %s AND checkpoint_id = ANY(%s)",
    # Values of a namespace still referred to, after the deletion (same transaction).
    "referenced": "SELECT DISTINCT v.key AS channel, v.value AS version FROM checkpoints c "
    "CROSS JOIN LATERAL jsonb_each_text(c.checkpoint -> 'channel_versions') AS v "
    "WHERE c.thread_id = %s AND c.checkpoint_ns = %s",
    "delete_blobs": "DELETE FROM checkpoint_blobs WHERE thread_id = %s AND checkpoint_ns = %s "
    "AND channel = %s AND version = ANY(%s)",
}

_Namespace = tuple[str, str]


def _deleted(
    rows: Sequence[Any],
) -> tuple[dict[_Namespace, list[str]], dict[_Namespace, set[tuple[str, str]]]]:
    """The deleted checkpoint ids and the (channel, version) pairs they referred to, per
    (thread, namespace)."""
    ids: dict[_Namespace, list[str]] = {}
    freed: dict[_Namespace, set[tuple[str, str]]] = {}
    for row in rows:
        where = (row["thread_id"], row["checkpoint_ns"])
        ids.setdefault(where, []).append(row["checkpoint_id"])
        versions = row["versions"] or {}
        freed.setdefault(where, set()).update((k, str(v)) for k, v in versions.items())
    return ids, freed


def _garbage(freed: set[tuple[str, str]], referenced: Sequence[Any]) -> dict[str, list[str]]:
    # Only values a deleted checkpoint used: a run writing meanwhile stores new versions
    # before its checkpoint, and those are never candidates.
    kept = {(r["channel"], r["version"]) for r in referenced}
    garbage: dict[str, list[str]] = {}
    for channel, version in sorted(freed - kept):
        garbage.setdefault(channel, []).append(version)
    return garbage


class _PostgresRows(Rows):
    has_async = False
    own_prune = True

    def __init__(self, saver: PostgresSaver) -> None:
        self.saver = saver

    def _fetch(self, sql: str, params: Sequence[Any]) -> list[Any]:
        with self.saver._cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall())

    def task_paths(self, thread_id: str) -> dict[tuple[str, str, str], str]:
        rows = self._fetch(_SQL["task_paths"], (thread_id,))
        return {
            (r["checkpoint_ns"], r["checkpoint_id"], r["task_id"]): r["task_path"] for r in rows
        }

    def decisions(self, thread_id: str) -> list[tuple[str, str, str, float]]:
        rows = self._fetch(_SQL["decisions"], (thread_id,))
        return [
            (r["checkpoint_ns"], r["input_digest"], r["message"], float(r["created_at"]))
            for r in rows
        ]

    def copy_artifacts(self, source: str, target: str) -> None:
        with self.saver._cursor() as cur:
            cur.execute(_SQL["copy_artifacts"], (target, source))

    def delete_for_runs(self, run_ids: list[str]) -> None:
        with self.saver._cursor() as cur, cur.connection.transaction():
            cur.execute(_SQL["delete_checkpoints"], (run_ids,))
            ids, freed = _deleted(cur.fetchall())
            for (thread_id, ns), gone in ids.items():
                cur.execute(_SQL["delete_writes"], (thread_id, ns, gone))
                cur.execute(_SQL["referenced"], (thread_id, ns))
                garbage = _garbage(freed[thread_id, ns], cur.fetchall())
                for channel, versions in garbage.items():
                    cur.execute(_SQL["delete_blobs"], (thread_id, ns, channel, versions))

    def delta_threads(self, thread_ids: list[str]) -> list[str]:
        return []  # LangGraph's own prune refuses them there


class _AsyncPostgresRows(Rows):
    own_prune = True

    def __init__(self, saver: AsyncPostgresSaver) -> None:
        self.saver = saver

    async def _fetch(self, sql: str, params: Sequence[Any]) -> list[Any]:
        async with self.saver._cursor() as cur:
            await cur.execute(sql, params)
            return list(await cur.fetchall())

    async def atask_paths(self, thread_id: str) -> dict[tuple[str, str, str], str]:
        rows = await self._fetch(_SQL["task_paths"], (thread_id,))
        return {
            (r["checkpoint_ns"], r["checkpoint_id"], r["task_id"]): r["task_path"] for r in rows
        }

    async def adecisions(self, thread_id: str) -> list[tuple[str, str, str, float]]:
        rows = await self._fetch(_SQL["decisions"], (thread_id,))
        return [
            (r["checkpoint_ns"], r["input_digest"], r["message"], float(r["created_at"]))
            for r in rows
        ]

    async def acopy_artifacts(self, source: str, target: str) -> None:
        async with self.saver._cursor() as cur:
            await cur.execute(_SQL["copy_artifacts"], (target, source))

    async def adelete_for_runs(self, run_ids: list[str]) -> None:
        async with self.saver._cursor() as cur, cur.connection.transaction():
            await cur.execute(_SQL["delete_checkpoints"], (run_ids,))
            ids, freed = _deleted(await cur.fetchall())
            for (thread_id, ns), gone in ids.items():
                await cur.execute(_SQL["delete_writes"], (thread_id, ns, gone))
                await cur.execute(_SQL["referenced"], (thread_id, ns))
                garbage = _garbage(freed[thread_id, ns], await cur.fetchall())
                for channel, versions in garbage.items():
                    await cur.execute(_SQL["delete_blobs"], (thread_id, ns, channel, versions))

    async def adelta_threads(self, thread_ids: list[str]) -> list[str]:
        return []

    def _bridge(self, coro: Any) -> Any:
        return bridge(self.saver.loop, coro)


def postgres_rows(saver: Any, operation: str) -> Rows:
    """The row access of a LangGraph PostgreSQL saver.

    Raises:
        UnsupportedOperation: For another saver of the package (a shallow one, say).
    """
    if isinstance(saver, PostgresSaver):
        return _PostgresRows(saver)
    if isinstance(saver, AsyncPostgresSaver):
        return _AsyncPostgresRows(saver)
    raise UnsupportedOperation(operation, type(saver).__name__)
