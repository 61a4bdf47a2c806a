"""The recovery-store methods that run one statement, written once for both SQL backends.

Each store (SQLite and PostgreSQL, sync and async) says how to run one statement with
``_run``; the methods here build the statement and decode its rows. Also the row helpers
both backends share.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Literal

from taskpilots_graph.checkpointers import _schema as sql
from taskpilots_graph.checkpointers._rows import (
    decision_params,
    ledger_list_sql,
    repeat_params,
    row_to_committed,
    row_to_entry,
)
from taskpilots_graph.checkpointers.artifacts import ARTIFACTS_TABLE, PreparedArtifact, stored_bytes
from taskpilots_graph.checkpointers.base import rows_to_events
from taskpilots_graph.checkpointers.messages import LoadedRow
from taskpilots_graph.compaction import EventCompaction
from taskpilots_graph.errors import MigrationError
from taskpilots_graph.events import Event
from taskpilots_graph.ledger import CommittedEffect, LedgerEntry

__all__ = [
    "STATEMENTS",
    "AsyncSqlQueries",
    "Fetch",
    "SqlQueries",
    "afetched",
    "artifact_key",
    "compaction_params",
    "fetched",
    "loaded_rows",
    "pending_migrations",
]

Fetch = Literal["one", "all", "count"]
"""What ``_run`` returns: the first row, every row, or the number of rows changed."""


def pending_migrations(dialect: sql.Dialect, current: int) -> list[tuple[int, str]]:
    """The migrations a schema at version ``current`` still needs, with their versions.

    Raises:
        MigrationError: The schema is newer than this library's.
    """
    if current > sql.SCHEMA_VERSION:
        raise MigrationError(
            f"the database schema is at version {current}, newer than this library's "
            f"{sql.SCHEMA_VERSION}; upgrade taskpilots-graph"
        )
    return [(v, sql.MIGRATIONS[dialect][v - 1]) for v in range(current + 1, sql.SCHEMA_VERSION + 1)]


def loaded_rows(rows: Any) -> list[LoadedRow]:
    return [(int(p), bytes(k), str(t), bytes(b)) for p, k, t, b in rows]


def compaction_params(plan: Sequence[EventCompaction]) -> list[tuple[Any, ...]]:
    return [(change.encoded, change.thread_id, change.seq) for change in plan]


def artifact_key(artifact: PreparedArtifact) -> dict[str, Any]:
    return {"id": artifact.ref.id, "thread_id": artifact.thread_id}


def fetched(cur: Any, fetch: Fetch) -> Any:
    """What ``fetch`` asks of a cursor that has executed a statement."""
    if fetch == "one":
        return cur.fetchone()
    return cur.fetchall() if fetch == "all" else cur.rowcount


async def afetched(cur: Any, fetch: Fetch) -> Any:
    """Async form of :func:`fetched`."""
    if fetch == "one":
        return await cur.fetchone()
    return await cur.fetchall() if fetch == "all" else cur.rowcount


def _statements(d: sql.Dialect) -> dict[str, str]:
    return {
        "events": sql.SELECT_EVENTS[d],
        "messages_read": sql.MESSAGES[d]["read"],
        "ledger_get": sql.LEDGER[d]["get"],
        "ledger_repeat": sql.LEDGER[d]["repeat"],
        "ledger_committed_digests": sql.LEDGER[d]["committed_digests"],
        "decision_get": sql.LEDGER[d]["decision_get"],
        "decision_digests": sql.LEDGER[d]["decision_digests"],
        "decision_forget": sql.LEDGER[d]["decision_forget"],
        "get_artifact": sql.ARTIFACTS[d]["get"],
        "delete_artifacts": sql.ARTIFACTS[d]["delete"],
    }


STATEMENTS: Final = {d: _statements(d) for d in ("sqlite", "postgres")}
"""The statement of each store method of one statement but ``ledger``, by dialect."""


def _entry(row: Any) -> LedgerEntry | None:
    return None if row is None else row_to_entry(row)


def _committed(row: Any) -> CommittedEffect | None:
    return None if row is None else row_to_committed(row)


def _message(row: Any) -> str | None:
    return None if row is None else str(row[0])


def _artifact(row: Any, artifact_id: str) -> bytes | None:
    return None if row is None else stored_bytes(row[0], artifact_id, where=ARTIFACTS_TABLE)


def _digests(thread_id: str, checkpoint_ns: str) -> dict[str, Any]:
    return {"thread_id": thread_id, "checkpoint_ns": checkpoint_ns}


class SqlQueries:
    """Sync store methods of one statement each, over ``_run``."""

    _dialect: sql.Dialect
    _run: Callable[..., Any]
    """``_run(operation, params, fetch, *, statement=None, write=False, binary=None)``: run
    the statement of store method ``operation`` (``STATEMENTS`` unless given). ``write``: it
    changes rows; ``binary``: PostgreSQL's result format (bytes come back raw, not as hex
    text twice their size)."""

    def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        return rows_to_events(self._run("events", (thread_id, after_seq), "all"))

    def messages_read(self, thread_id: str, seq: int, length: int) -> list[LoadedRow]:
        """The rows of positions ``0..length-1`` of sequence ``seq``, by position."""
        params = {"thread_id": thread_id, "seq": seq, "len": length}
        return loaded_rows(self._run("messages_read", params, "all", binary=True))

    def ledger_get(self, key: str) -> LedgerEntry | None:
        return _entry(self._run("ledger_get", {"key": key}, "one"))

    def ledger(self, thread_id: str | None = None) -> list[LedgerEntry]:
        statement, params = ledger_list_sql(self._dialect, thread_id)
        return [row_to_entry(r) for r in self._run("ledger", params, "all", statement=statement)]

    def ledger_repeat(self, thread_id: str, tool: str, args_digest: str) -> CommittedEffect | None:
        params = repeat_params(thread_id, tool, args_digest)
        return _committed(self._run("ledger_repeat", params, "one"))

    def ledger_committed_digests(self, thread_id: str) -> list[tuple[str, str]]:
        rows = self._run("ledger_committed_digests", {"thread_id": thread_id}, "all")
        return [(str(tool), str(digest)) for tool, digest in rows]

    def decision_get(self, thread_id: str, checkpoint_ns: str, input_digest: str) -> str | None:
        params = decision_params(thread_id, checkpoint_ns, input_digest)
        return _message(self._run("decision_get", params, "one"))

    def decision_digests(self, thread_id: str, checkpoint_ns: str) -> list[str]:
        rows = self._run("decision_digests", _digests(thread_id, checkpoint_ns), "all")
        return [str(row[0]) for row in rows]

    def decision_forget(self, thread_id: str, since: float) -> int:
        params = {"thread_id": thread_id, "since": since}
        return int(self._run("decision_forget", params, "count", write=True))

    def get_artifact(self, artifact_id: str) -> bytes | None:
        row = self._run("get_artifact", {"id": artifact_id}, "one", binary=True)
        return _artifact(row, artifact_id)

    def delete_artifacts(self, thread_id: str) -> None:
        self._run("delete_artifacts", {"thread_id": thread_id}, "count", write=True)


class AsyncSqlQueries:
    """Async twin of :class:`SqlQueries`."""

    _dialect: sql.Dialect
    _run: Callable[..., Awaitable[Any]]

    async def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        return rows_to_events(await self._run("events", (thread_id, after_seq), "all"))

    async def messages_read(self, thread_id: str, seq: int, length: int) -> list[LoadedRow]:
        params = {"thread_id": thread_id, "seq": seq, "len": length}
        return loaded_rows(await self._run("messages_read", params, "all", binary=True))

    async def ledger_get(self, key: str) -> LedgerEntry | None:
        return _entry(await self._run("ledger_get", {"key": key}, "one"))

    async def ledger(self, thread_id: str | None = None) -> list[LedgerEntry]:
        statement, params = ledger_list_sql(self._dialect, thread_id)
        rows = await self._run("ledger", params, "all", statement=statement)
        return [row_to_entry(row) for row in rows]

    async def ledger_repeat(
        self, thread_id: str, tool: str, args_digest: str
    ) -> CommittedEffect | None:
        params = repeat_params(thread_id, tool, args_digest)
        return _committed(await self._run("ledger_repeat", params, "one"))

    async def ledger_committed_digests(self, thread_id: str) -> list[tuple[str, str]]:
        rows = await self._run("ledger_committed_digests", {"thread_id": thread_id}, "all")
        return [(str(tool), str(digest)) for tool, digest in rows]

    async def decision_get(
        self, thread_id: str, checkpoint_ns: str, input_digest: str
    ) -> str | None:
        params = decision_params(thread_id, checkpoint_ns, input_digest)
        return _message(await self._run("decision_get", params, "one"))

    async def decision_digests(self, thread_id: str, checkpoint_ns: str) -> list[str]:
        rows = await self._run("decision_digests", _digests(thread_id, checkpoint_ns), "all")
        return [str(row[0]) for row in rows]

    async def decision_forget(self, thread_id: str, since: float) -> int:
        params = {"thread_id": thread_id, "since": since}
        return int(await self._run("decision_forget", params, "count", write=True))

    async def get_artifact(self, artifact_id: str) -> bytes | None:
        row = await self._run("get_artifact", {"id": artifact_id}, "one", binary=True)
        return _artifact(row, artifact_id)

    async def delete_artifacts(self, thread_id: str) -> None:
        await self._run("delete_artifacts", {"thread_id": thread_id}, "count", write=True)
