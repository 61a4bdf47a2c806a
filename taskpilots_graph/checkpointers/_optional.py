"""LangGraph's optional saver operations on every backend: copy a thread, delete runs.

LangGraph's own in-memory and SQLite savers implement neither ``copy_thread`` nor
``delete_for_runs`` (nor ``prune``: see :mod:`.retention`), and its PostgreSQL saver only
``prune``. LangGraph tooling, and its conformance suite, find out what a saver can do by
looking for an override on its type, so a wrapper that overrides them must have them
everywhere. They are built here once for memory, SQLite and PostgreSQL.

``copy_thread(source, target)``
    Copies every checkpoint of every namespace, oldest first, through the checkpointer's
    own ``list`` and ``put`` / ``put_writes``: checkpoint ids, metadata, parents and pending
    writes (with the task path they were written under) stay as they are, and whatever the
    checkpointer does to values on their way to storage happens to the copy too. The
    thread's recovery records come along, written *before* the checkpoints (a copy cut
    short never has checkpoints without the record of what they already did): its event
    log, model decisions and artifacts, and its ledger entries under the rule below. The
    target must be new (no checkpoint, event or ledger entry); a source without
    checkpoints raises :class:`~taskpilots_graph.errors.ThreadNotFound`.

    Ledger rule. A tool call's default invocation key is derived from its thread id, so
    the copy, resuming the same tool call, asks for a key of its own. Each entry the source
    wrote under its default key is copied under the key the copy will ask for, with
    ``extra["copied_from"] = {"thread_id", "key", "status"}``:

    * an effect whose outcome is settled keeps its status: committed or compensated (the
      copy returns the recorded result and never performs it again; the repeat guard of
      the copy finds it too, under a new tool-call id), or failed before its request left;
      so does an intent paused on an ``interrupt()`` (the tool never acted yet);
    * any other entry (an intent without an outcome, a failure after the request may have
      left, an uncertain effect) becomes ``uncertain`` in the copy: only the service
      knows, under the *source's* key, whether it happened, so the copy stops on it and a
      person decides instead of performing it under a key the service never saw.

    The undo of a copied effect (``undo:<effect key>``) is copied by the same rule as the
    undo of the copy's effect. Entries under a business key (``side_effect(key=...)``) are
    shared by every thread already and are not copied: the copy finds them by their key.
    Events that name a copied entry's key name the copy's key instead; the checkpoints'
    values are copied as they are. Artifacts kept by a plugged-in
    :class:`~taskpilots_graph.checkpointers.artifacts.ArtifactStore` are not copied (the
    protocol cannot list a thread's artifacts); they stay readable while the source keeps
    them.

    Copy a thread no run is writing to (hold its lease, or copy a finished or stopped
    one): the copy reads the source in several steps, not one snapshot. A copy cut short
    leaves a partial target: ``delete_thread`` it and copy again.

``delete_for_runs(run_ids)``
    Deletes the checkpoints whose metadata names one of the runs, in every thread and
    namespace, with their pending writes (and, on PostgreSQL and in memory, the channel
    values no remaining checkpoint refers to), in one transaction. Events, ledger entries,
    decisions and artifacts stay: they are what the deleted runs *did*, and a later run
    of the thread still finds its committed effects there instead of performing them
    again. A remaining checkpoint whose parent was deleted keeps naming it; reading that
    parent finds nothing.

Both are synchronous or asynchronous as the wrapped saver is; the other form is bridged
(a worker thread for a sync saver, the saver's own event loop for an async one).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import WRITES_IDX_MAP, CheckpointTuple
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from taskpilots_graph._twins import Steps, arun_steps, both, io, run_steps
from taskpilots_graph.checkpointers._sqlite_connect import mapped_errors
from taskpilots_graph.checkpointers.base import DecisionRecord, PendingRecord
from taskpilots_graph.checkpointers.memory import AsyncMemoryStore, MemoryStore
from taskpilots_graph.errors import ConfigurationError, ThreadNotFound, UnsupportedOperation
from taskpilots_graph.events import Event, EventRecord, check_thread_id, encode_payload
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus, Step, default_key, next_step

if TYPE_CHECKING:
    from taskpilots_graph.checkpointers._api import RecoveryAPI

__all__ = [
    "COPIED_FROM",
    "DELTA_MARKERS",
    "acopy_thread",
    "adelete_for_runs",
    "copied_entry",
    "copy_thread",
    "delete_for_runs",
    "rows_for",
]

COPIED_FROM = "copied_from"
"""Key in ``LedgerEntry.extra`` of a copied entry: the source thread, key and status."""

DELTA_MARKERS = ("counters_since_delta_snapshot", "delta_writes_versioned")
"""Checkpoint metadata keys of threads that use a ``DeltaChannel`` (as LangGraph's
PostgreSQL saver detects them): their values are rebuilt from older checkpoints."""

# The key prefix of an effect's undo (``nodes._undo.undo_key``; the checkpointers do not
# import the nodes, which import them).
_UNDO = "undo:"

# Event payload fields that name a ledger key (``_protocol``: the call's own, and the
# earlier effect a caught repeat returned).
_KEY_FIELDS = ("key", "earlier_key")

T = TypeVar("T")


# -- the copy, I/O free -------------------------------------------------------------------


def copied_entry(
    entry: LedgerEntry, source: str, target: str, keys: Mapping[str, str] | None = None
) -> LedgerEntry | None:
    """The ``target`` thread's copy of a ledger entry of ``source``, by the ledger rule of
    the module docs; ``None`` for an entry the copy shares instead (a business key, or an
    entry another thread wrote).

    ``keys`` maps the source's effect keys already copied to the copy's: the undo of such
    an effect (``undo:<effect key>``) is copied as the undo of the copy's effect.
    """
    if entry.thread_id != source:
        return None

    def key(thread_id: str) -> str:
        return default_key(
            thread_id=thread_id,
            checkpoint_ns=entry.checkpoint_ns,
            tool_call_id=entry.tool_call_id,
            tool=entry.tool,
            args=entry.args,
        )

    undone = entry.key.removeprefix(_UNDO)
    if undone != entry.key and keys and undone in keys:
        new_key = _UNDO + keys[undone]
    elif entry.key == key(source):
        new_key = key(target)
    else:
        return None
    settled = next_step(entry) in (Step.RETURN_RECORDED, Step.EXECUTE)
    extra = {k: v for k, v in entry.extra.items() if k != COPIED_FROM}
    extra[COPIED_FROM] = {"thread_id": source, "key": entry.key, "status": entry.status.value}
    return dataclasses.replace(
        entry,
        key=new_key,
        thread_id=target,
        status=entry.status if settled else LedgerStatus.UNCERTAIN,
        extra=extra,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Records:
    """What the target gets before its checkpoints: ledger entries, decisions and events."""

    entries: list[LedgerEntry]
    records: list[PendingRecord]


def _records(
    source: str,
    target: str,
    ledger: Sequence[LedgerEntry],
    events: Sequence[Event],
    decisions: Iterable[tuple[str, str, str, float]],
) -> _Records:
    entries: list[LedgerEntry] = []
    keys: dict[str, str] = {}
    # Effects first, then the undos of the effects copied (whatever their order in time).
    for undos in (False, True):
        for entry in ledger:
            if entry.key.startswith(_UNDO) is undos and (
                copy := copied_entry(entry, source, target, keys)
            ):
                entries.append(copy)
                keys[entry.key] = copy.key
    records: list[PendingRecord] = [
        DecisionRecord(target, ns, digest, message, created_at)
        for ns, digest, message, created_at in decisions
    ]
    for event in events:
        payload = dict(event.payload)
        for field in _KEY_FIELDS:
            if isinstance(payload.get(field), str) and payload[field] in keys:
                payload[field] = keys[payload[field]]
        records.append(
            EventRecord(
                thread_id=target,
                kind=event.kind,
                ts=event.ts.timestamp(),
                checkpoint_ns=event.checkpoint_ns,
                checkpoint_id=event.checkpoint_id,
                payload=encode_payload(payload),
            )
        )
    return _Records(entries, records)


def _config(thread_id: str, checkpoint_ns: str | None = None) -> RunnableConfig:
    configurable: dict[str, Any] = {"thread_id": thread_id}
    if checkpoint_ns is not None:
        configurable["checkpoint_ns"] = checkpoint_ns
    return {"configurable": configurable}


def _oldest_first(tuples: Iterable[CheckpointTuple]) -> list[CheckpointTuple]:
    # Checkpoint ids sort by time (uuid6): parents are written before their children.
    return sorted(
        tuples,
        key=lambda t: (t.config["configurable"].get("checkpoint_ns", ""), t.checkpoint["id"]),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Put:
    """One checkpoint of the copy: the ``put`` arguments and the ``put_writes`` calls."""

    config: RunnableConfig
    checkpoint: Any
    metadata: Any
    versions: Any
    writes: list[tuple[RunnableConfig, list[tuple[str, Any]], str, str]]


def _put(tup: CheckpointTuple, target: str, paths: Mapping[tuple[str, str, str], str]) -> _Put:
    ns = str(tup.config["configurable"].get("checkpoint_ns", ""))
    checkpoint_id = tup.checkpoint["id"]
    config = _config(target, ns)
    if tup.parent_config is not None:
        config["configurable"]["checkpoint_id"] = tup.parent_config["configurable"]["checkpoint_id"]
    # Every channel, not only the ones that changed: the copy may start at a checkpoint
    # whose ancestors were pruned, and savers that keep values apart (memory, PostgreSQL)
    # store exactly the versions they are handed.
    versions = dict(tup.checkpoint["channel_versions"])
    here = {**config["configurable"], "checkpoint_id": checkpoint_id}
    # One put_writes per task and kind, in the order the saver returned them: the special
    # channels (errors, interrupts, ...) keep their fixed indexes, the others count from 0.
    by_task: dict[tuple[str, bool], list[tuple[str, Any]]] = {}
    for task_id, channel, value in tup.pending_writes or ():
        by_task.setdefault((task_id, channel in WRITES_IDX_MAP), []).append((channel, value))
    writes: list[tuple[RunnableConfig, list[tuple[str, Any]], str, str]] = [
        ({"configurable": dict(here)}, items, task_id, paths.get((ns, checkpoint_id, task_id), ""))
        for (task_id, _), items in by_task.items()
    ]
    return _Put(config, tup.checkpoint, dict(tup.metadata or {}), versions, writes)


def _refuse_target(target: str, has_checkpoint: bool, events: int, entries: int) -> None:
    if has_checkpoint or events or entries:
        raise ConfigurationError(
            f"copy_thread: the target thread {target!r} already has checkpoints or recovery "
            "records; copy to a new thread id (or delete_thread the target first)"
        )


def _check_ids(source: str, target: str) -> None:
    check_thread_id(source)
    check_thread_id(target)
    if source == target:
        raise ConfigurationError(f"copy_thread: source and target are the same thread {source!r}")


# -- the drivers -------------------------------------------------------------------------


def copy_thread(cp: RecoveryAPI, source: str, target: str) -> None:
    """Copy a thread with its recovery records (see the module docs)."""
    _check_ids(source, target)
    run_steps(_copy_thread(cp, source, target, rows_for(cp, "copy_thread")))


async def acopy_thread(cp: RecoveryAPI, source: str, target: str) -> None:
    """Async form of :func:`copy_thread`."""
    _check_ids(source, target)
    rows = rows_for(cp, "copy_thread")
    if not rows.has_async:  # a sync saver's async methods raise: use its sync ones
        await asyncio.to_thread(copy_thread, cp, source, target)
        return
    await arun_steps(_copy_thread(cp, source, target, rows))


def _listed(cp: RecoveryAPI, config: RunnableConfig, limit: int | None = None) -> list[Any]:
    return list(cp.list(config, limit=limit))


async def _alisted(cp: RecoveryAPI, config: RunnableConfig, limit: int | None = None) -> list[Any]:
    return [t async for t in cp.alist(config, limit=limit)]


def _copy_thread(cp: RecoveryAPI, source: str, target: str, rows: Rows) -> Steps[None]:
    tuples = _oldest_first((yield both(_listed, _alisted, cp, _config(source))))
    if not tuples:
        raise ThreadNotFound(source)
    has_checkpoint = bool((yield both(_listed, _alisted, cp, _config(target), 1)))
    events = yield io(cp, "_call", "events", target)
    entries = yield io(cp, "ledger", target)
    _refuse_target(target, has_checkpoint, len(events), len(entries))
    yield io(cp, "append_records", [], flush=source)  # the source's deferred events too
    entries = yield io(cp, "ledger", source)
    events = yield io(cp, "_call", "events", source)
    plan = _records(source, target, entries, events, (yield io(rows, "decisions", source)))
    yield from _write_records(cp, plan)
    if cp.artifact_store is None:
        yield io(rows, "copy_artifacts", source, target)
    paths = yield io(rows, "task_paths", source)
    writer = _storing_all(cp)
    for tup in tuples:
        put = _put(tup, target, paths)
        yield io(writer, "put", put.config, put.checkpoint, put.metadata, put.versions)
        for args in put.writes:
            yield io(writer, "put_writes", *args)


def _storing_all(cp: RecoveryAPI) -> RecoveryAPI:
    """``cp``, or a view of it that stores every checkpoint (a density view would hold
    some back; a copy must have them all)."""
    if cp.held is None:
        return cp
    view = copy.copy(cp)
    view.held = None
    return view


def _write_records(cp: RecoveryAPI, plan: _Records) -> Steps[None]:
    # The first entry carries the decisions and events in its transaction.
    if not plan.entries:
        if plan.records:
            yield io(cp, "_call", "append_events", plan.records)
        return
    for i, entry in enumerate(plan.entries):
        records = plan.records if i == 0 else ()
        yield io(cp, "_call", "ledger_write", entry, expect=None, events=records)


def delete_for_runs(cp: RecoveryAPI, run_ids: Sequence[str]) -> None:
    """Delete the runs' checkpoints and writes (see the module docs)."""
    runs = _run_ids(run_ids)
    if runs:
        rows_for(cp, "delete_for_runs").delete_for_runs(runs)


async def adelete_for_runs(cp: RecoveryAPI, run_ids: Sequence[str]) -> None:
    """Async form of :func:`delete_for_runs`."""
    runs = _run_ids(run_ids)
    if runs:
        await rows_for(cp, "delete_for_runs").adelete_for_runs(runs)


def _run_ids(run_ids: Sequence[str]) -> list[str]:
    if isinstance(run_ids, str):
        raise ConfigurationError("run_ids must be a sequence of run ids, not a str")
    return list(dict.fromkeys(str(r) for r in run_ids))


# -- rows the public saver API does not reach ------------------------------------------------


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
        return await asyncio.to_thread(self.task_paths, thread_id)

    async def adecisions(self, thread_id: str) -> list[tuple[str, str, str, float]]:
        """Async form of :meth:`decisions`."""
        return await asyncio.to_thread(self.decisions, thread_id)

    async def acopy_artifacts(self, source: str, target: str) -> None:
        """Async form of :meth:`copy_artifacts`."""
        await asyncio.to_thread(self.copy_artifacts, source, target)

    async def adelete_for_runs(self, run_ids: list[str]) -> None:
        """Async form of :meth:`delete_for_runs`."""
        await asyncio.to_thread(self.delete_for_runs, run_ids)

    async def adelta_threads(self, thread_ids: list[str]) -> list[str]:
        """Async form of :meth:`delta_threads`."""
        return await asyncio.to_thread(self.delta_threads, thread_ids)

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

    async def atask_paths(self, thread_id: str) -> dict[tuple[str, str, str], str]:
        return self.task_paths(thread_id)

    async def adecisions(self, thread_id: str) -> list[tuple[str, str, str, float]]:
        return self.decisions(thread_id)

    async def acopy_artifacts(self, source: str, target: str) -> None:
        self.copy_artifacts(source, target)

    async def adelete_for_runs(self, run_ids: list[str]) -> None:
        self.delete_for_runs(run_ids)

    async def adelta_threads(self, thread_ids: list[str]) -> list[str]:
        return self.delta_threads(thread_ids)


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


class _SqliteRows(Rows):
    """``SqliteSaver``'s file, on its connection and under its lock."""

    has_async = False

    def __init__(self, saver: SqliteSaver) -> None:
        self.saver = saver

    def _run(self, operation: str, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        conn = self.saver.conn
        with mapped_errors(operation), self.saver.cursor(transaction=False) as cur:
            try:
                rows = [cur.execute(sql, params).fetchall() for sql, params in statements]
                conn.commit()
            except BaseException:
                conn.rollback()
                raise
        return rows[-1] if rows else []

    def task_paths(self, thread_id: str) -> dict[tuple[str, str, str], str]:
        found = self._run("copy_thread", [(_SQLITE["task_paths"], (thread_id,))])
        return {(ns, cid, task): path for ns, cid, task, path in found}

    def decisions(self, thread_id: str) -> list[tuple[str, str, str, float]]:
        found = self._run("copy_thread", [(_SQLITE["decisions"], (thread_id,))])
        return [(ns, d, m, float(at)) for ns, d, m, at in found]

    def copy_artifacts(self, source: str, target: str) -> None:
        self._run("copy_thread", [(_SQLITE["copy_artifacts"], (target, source))])

    def delete_for_runs(self, run_ids: list[str]) -> None:
        runs = (json.dumps(run_ids),)
        self._run(
            "delete_for_runs",
            [(_SQLITE["delete_writes"], runs), (_SQLITE["delete_checkpoints"], runs)],
        )

    def delta_threads(self, thread_ids: list[str]) -> list[str]:
        found = self._run("prune", [(_SQLITE["delta"], (json.dumps(thread_ids),))])
        return [str(row[0]) for row in found]


class _AsyncSqliteRows(Rows):
    """``AsyncSqliteSaver``'s file, on its connection and under its lock."""

    def __init__(self, saver: AsyncSqliteSaver) -> None:
        self.saver = saver

    async def _run(
        self, operation: str, statements: Sequence[tuple[str, Sequence[Any]]]
    ) -> list[Any]:
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

    async def atask_paths(self, thread_id: str) -> dict[tuple[str, str, str], str]:
        found = await self._run("copy_thread", [(_SQLITE["task_paths"], (thread_id,))])
        return {(ns, cid, task): path for ns, cid, task, path in found}

    async def adecisions(self, thread_id: str) -> list[tuple[str, str, str, float]]:
        found = await self._run("copy_thread", [(_SQLITE["decisions"], (thread_id,))])
        return [(ns, d, m, float(at)) for ns, d, m, at in found]

    async def acopy_artifacts(self, source: str, target: str) -> None:
        await self._run("copy_thread", [(_SQLITE["copy_artifacts"], (target, source))])

    async def adelete_for_runs(self, run_ids: list[str]) -> None:
        runs = (json.dumps(run_ids),)
        await self._run(
            "delete_for_runs",
            [(_SQLITE["delete_writes"], runs), (_SQLITE["delete_checkpoints"], runs)],
        )

    async def adelta_threads(self, thread_ids: list[str]) -> list[str]:
        found = await self._run("prune", [(_SQLITE["delta"], (json.dumps(thread_ids),))])
        return [str(row[0]) for row in found]

    def _bridge(self, coro: Coroutine[Any, Any, T]) -> T:
        return bridge(self.saver.loop, coro)


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
