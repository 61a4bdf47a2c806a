"""LangGraph's optional saver operations on every backend: copy a thread, delete runs.

LangGraph's own in-memory and SQLite savers implement neither ``copy_thread`` nor
``delete_for_runs`` (nor ``prune``: see :mod:`.retention`), and its PostgreSQL saver only
``prune``. LangGraph tooling, and its conformance suite, find out what a saver can do by
looking for an override on its type, so a wrapper that overrides them must have them
everywhere. They are built here once for memory, SQLite and PostgreSQL (each one's own
rows: :mod:`._backend_rows`).

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
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import WRITES_IDX_MAP, CheckpointTuple

from taskpilots_graph._twins import Steps, arun_steps, asynced, both, io, run_steps, synced
from taskpilots_graph.checkpointers._backend_rows import Rows, rows_for
from taskpilots_graph.checkpointers.base import DecisionRecord, PendingRecord
from taskpilots_graph.errors import ConfigurationError, ThreadNotFound
from taskpilots_graph.events import Event, EventRecord, check_thread_id, encode_payload
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus, Step, default_key, next_step

if TYPE_CHECKING:
    from taskpilots_graph.checkpointers._api import RecoveryAPI

__all__ = [
    "COPIED_FROM",
    "acopy_thread",
    "adelete_for_runs",
    "copied_entry",
    "copy_thread",
    "delete_for_runs",
]

COPIED_FROM = "copied_from"
"""Key in ``LedgerEntry.extra`` of a copied entry: the source thread, key and status."""

# The key prefix of an effect's undo (``nodes._undo.undo_key``; the checkpointers do not
# import the nodes, which import them).
_UNDO = "undo:"

# Event payload fields that name a ledger key (``_protocol``: the call's own, and the
# earlier effect a caught repeat returned).
_KEY_FIELDS = ("key", "earlier_key")


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
    if has_checkpoint or events or entries:
        raise ConfigurationError(
            f"copy_thread: the target thread {target!r} already has checkpoints or recovery "
            "records; copy to a new thread id (or delete_thread the target first)"
        )
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


def _delete_for_runs(cp: RecoveryAPI, run_ids: Sequence[str]) -> Steps[None]:
    """Delete the runs' checkpoints and writes (see the module docs)."""
    if isinstance(run_ids, str):
        raise ConfigurationError("run_ids must be a sequence of run ids, not a str")
    if runs := list(dict.fromkeys(str(r) for r in run_ids)):
        yield io(rows_for(cp, "delete_for_runs"), "delete_for_runs", runs)


delete_for_runs = synced(_delete_for_runs)
adelete_for_runs = asynced(_delete_for_runs)
