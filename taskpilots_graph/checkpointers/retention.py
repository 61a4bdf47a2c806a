"""Retention: prune old checkpoints of threads, sweep whole threads past an age.

``cp.prune(thread_ids, keep="latest" | "milestones")`` deletes a thread's checkpoints older
than the latest of each namespace (keeping, with ``"milestones"``, those where a business
milestone was reached: the ``rewind`` targets) together with the writes and blobs only they
needed. The event log, the ledger and the artifacts stay. ``cp.sweep(older_than=...)``
deletes whole threads whose last activity is older than the cutoff.

Neither ever touches a thread that may still need its history, and both say why in the
report (:class:`PruneReport`): a pending takeover (a person has to decide), an uncertain
ledger entry (an intent without a known outcome, or one marked uncertain), or a lease held
(a run may be writing to it; pass the lease backend as ``leases=``). An unknown thread id
given to ``prune`` raises :class:`~taskpilots_graph.errors.ThreadNotFound` before anything
is deleted.

LangGraph's own form, ``cp.prune(thread_ids, strategy="keep_latest" | "delete")``
(:func:`prune_strategy`), works on every backend with LangGraph's semantics and without the
refusals above, as LangGraph tooling expects: ``"keep_latest"`` keeps every recovery record,
``"delete"`` deletes the threads whole.

Pruning runs while no run writes to the thread: the latest checkpoint is chosen inside the
deleting statement, so a checkpoint written meanwhile survives, but LangGraph's PostgreSQL
saver writes a checkpoint's blobs before its row, and a prune in between could drop them.
Runs that hold thread leases are protected by the lease check.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from langgraph.checkpoint.base import CheckpointTuple
from langgraph.checkpoint.memory import InMemorySaver

from taskpilots_graph._thread_index import athread_ids, thread_ids
from taskpilots_graph._twins import Steps, arun_steps, asynced, both, io, run_steps, synced
from taskpilots_graph.checkpointers._backend_rows import Rows, drop_memory_checkpoints, rows_for
from taskpilots_graph.errors import ConfigurationError, ThreadNotFound, UnsupportedOperation
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.leases import LeaseBackend, thread_lease_name
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus

if TYPE_CHECKING:
    from taskpilots_graph.checkpointers._api import RecoveryAPI

__all__ = [
    "PRUNE_STRATEGIES",
    "Keep",
    "PruneReport",
    "aprune",
    "aprune_strategy",
    "asweep",
    "prune",
    "prune_strategy",
    "refusal",
    "sweep",
]

Keep = Literal["latest", "milestones"]

PRUNE_STRATEGIES = ("keep_latest", "delete")
"""The ``strategy=`` values of LangGraph's ``prune``."""

_OPEN = (LedgerStatus.INTENDED, LedgerStatus.UNCERTAIN)


@dataclass(frozen=True, slots=True)
class PruneReport:
    """What a prune or sweep did.

    Attributes:
        pruned: Threads whose old checkpoints were deleted (``prune``).
        deleted: Threads deleted whole (``sweep``).
        refused: Threads left untouched, with the reason.
        checkpoints_removed: Checkpoints deleted by ``prune``.
    """

    pruned: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    refused: dict[str, str] = field(default_factory=dict)
    checkpoints_removed: int = 0


def refusal(
    latest: CheckpointTuple | None, ledger: Iterable[LedgerEntry], lease_owner: str | None
) -> str | None:
    """Why a thread must keep its history, or ``None`` (pure)."""
    if lease_owner is not None:
        return f"its lease is held by {lease_owner!r}: a run may be writing to it"
    for entry in ledger:
        if entry.status in _OPEN:
            return f"ledger entry {entry.key} ({entry.tool}) is {entry.status.value}"
    if latest is not None:
        flow = (latest.checkpoint.get("channel_values") or {}).get("flow") or {}
        if flow.get("takeover") or flow.get("stage") == "awaiting_human":
            return "a takeover is pending"
        if any(write[1] == "__interrupt__" for write in latest.pending_writes or ()):
            return "an interrupt is pending"
    return None


def milestone_checkpoints(events: Iterable[Event]) -> list[str]:
    """Checkpoints where a milestone was reached (and not superseded by a rewind)."""
    return sorted(
        {
            str(e.payload["checkpoint_id"])
            for e in events
            if e.kind is EventKind.MILESTONE_REACHED
            and not e.superseded
            and e.payload.get("checkpoint_id")
        }
    )


def _check_keep(keep: str) -> None:
    if keep not in ("latest", "milestones"):
        raise ConfigurationError(f"keep must be 'latest' or 'milestones', got {keep!r}")


def _thread_ids(thread_ids: Sequence[str]) -> list[str]:
    if isinstance(thread_ids, str):
        raise ConfigurationError("thread_ids must be a sequence of thread ids, not a str")
    return list(dict.fromkeys(str(t) for t in thread_ids))


def _cutoff(older_than: float | timedelta) -> float:
    seconds = older_than.total_seconds() if isinstance(older_than, timedelta) else older_than
    if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds < 0:
        raise ConfigurationError(f"older_than must be a duration >= 0, got {older_than!r}")
    return time.time() - float(seconds)


def _checkpoint_time(latest: CheckpointTuple) -> float:
    return datetime.fromisoformat(latest.checkpoint["ts"]).timestamp()


def _prune_memory(saver: InMemorySaver, thread_id: str, keep: Sequence[str]) -> int:
    removed = 0
    for ns, checkpoints in list(saver.storage.get(thread_id, {}).items()):
        latest = max(checkpoints, default=None)
        gone = [c for c in list(checkpoints) if c != latest and c not in keep]
        # With their writes and the channel values only they referred to.
        removed += drop_memory_checkpoints(saver, thread_id, ns, gone)
    return removed


def _lease_owner(leases: LeaseBackend | None, thread_id: str) -> Steps[str | None]:
    held = None if leases is None else (yield io(leases, "holder", thread_lease_name(thread_id)))
    return None if held is None else held.owner


def _config(thread_id: str) -> Any:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}


def _prune(
    cp: RecoveryAPI,
    thread_ids: Sequence[str],
    *,
    keep: Keep = "latest",
    leases: LeaseBackend | None = None,
) -> Steps[PruneReport]:
    """Delete the threads' old checkpoints (see the module docs)."""
    _check_keep(keep)
    ids = _thread_ids(thread_ids)
    latest = {}
    for t in ids:
        latest[t] = yield io(cp.inner, "get_tuple", _config(t))
    if missing := [t for t, tup in latest.items() if tup is None]:
        raise ThreadNotFound(missing[0])
    refused: dict[str, str] = {}
    pruned: list[str] = []
    removed = 0
    for thread_id in ids:
        entries = yield io(cp, "ledger", thread_id)
        reason = refusal(latest[thread_id], entries, (yield from _lease_owner(leases, thread_id)))
        if reason is not None:
            refused[thread_id] = reason
            continue
        events = (yield io(cp, "events", thread_id)) if keep == "milestones" else []
        kept = milestone_checkpoints(events)
        if isinstance(cp.inner, InMemorySaver):
            removed += _prune_memory(cp.inner, thread_id, kept)
        else:
            removed += int((yield io(cp, "_call", "prune_checkpoints", thread_id, kept)))
        pruned.append(thread_id)
    return PruneReport(pruned=tuple(pruned), refused=refused, checkpoints_removed=removed)


prune = synced(_prune)
aprune = asynced(_prune)


def _strategy_ids(thread_ids: Sequence[str], strategy: str) -> list[str]:
    if strategy not in PRUNE_STRATEGIES:
        raise ConfigurationError(
            f"unknown prune strategy {strategy!r}; use 'keep_latest' or 'delete' (or keep=...)"
        )
    return _thread_ids(thread_ids)


def _refuse_delta(threads: Sequence[str]) -> None:
    if threads:
        raise ConfigurationError(
            f"prune(strategy='keep_latest') refuses threads that use a DeltaChannel "
            f"({', '.join(threads)}): their values are rebuilt from older checkpoints. Nothing "
            "was pruned; prune them with strategy='delete', or leave them whole"
        )


@contextmanager
def _delta_refused() -> Iterator[None]:
    """LangGraph's PostgreSQL ``prune`` refuses DeltaChannel threads with a bare
    ``NotImplementedError`` (and prunes none): the same typed error as the other backends."""
    try:
        yield
    except UnsupportedOperation:
        raise
    except NotImplementedError as exc:
        raise ConfigurationError(
            f"prune(strategy='keep_latest') refuses threads that use a DeltaChannel ({exc}); "
            "nothing was pruned: prune them with strategy='delete', or leave them whole"
        ) from exc


def prune_strategy(cp: RecoveryAPI, thread_ids: Sequence[str], strategy: str) -> PruneReport:
    """LangGraph's ``prune(thread_ids, strategy=...)`` on every backend.

    ``"keep_latest"`` deletes every checkpoint but the latest of each namespace, with the
    pending writes (and stored channel values) only the deleted ones needed; events, ledger
    entries, decisions and artifacts all stay, so nothing a kept checkpoint may need to
    recover is lost. PostgreSQL uses LangGraph's own ``prune``; in memory and on SQLite it
    is :func:`prune`'s deletion without its refusals. A thread that uses a
    ``DeltaChannel`` is refused (as LangGraph's PostgreSQL saver does), before anything is
    deleted. ``"delete"`` deletes each thread whole, recovery records included, as
    ``delete_thread`` does: no checkpoint is left that could need them. Unknown thread
    ids are skipped, as LangGraph's savers do.

    Raises:
        ConfigurationError: For an unknown strategy, a single string as ``thread_ids``, or
            ``"keep_latest"`` on a thread that uses a ``DeltaChannel``.
    """
    ids = _strategy_ids(thread_ids, strategy)
    return run_steps(_prune_strategy(cp, ids, strategy, None)) if ids else PruneReport()


async def aprune_strategy(cp: RecoveryAPI, thread_ids: Sequence[str], strategy: str) -> PruneReport:
    """Async form of :func:`prune_strategy`."""
    ids = _strategy_ids(thread_ids, strategy)
    if not ids:
        return PruneReport()
    rows = rows_for(cp, "prune")
    if not rows.has_async:  # a sync saver's async methods raise: use its sync ones
        return await asyncio.to_thread(prune_strategy, cp, ids, strategy)
    return await arun_steps(_prune_strategy(cp, ids, strategy, rows))


def _prune_strategy(
    cp: RecoveryAPI, ids: list[str], strategy: str, rows: Rows | None
) -> Steps[PruneReport]:
    """The body of :func:`prune_strategy` (``rows``: found already, or found here)."""
    if strategy == "delete":
        for thread_id in ids:
            yield io(cp, "delete_thread", thread_id)
        return PruneReport(deleted=tuple(ids))
    rows = rows_for(cp, "prune") if rows is None else rows
    if rows.own_prune:
        with _delta_refused():
            yield io(cp.inner, "prune", ids, strategy=strategy)
        return PruneReport(pruned=tuple(ids))
    _refuse_delta((yield io(rows, "delta_threads", ids)))
    removed = 0
    for thread_id in ids:
        if isinstance(cp.inner, InMemorySaver):
            removed += _prune_memory(cp.inner, thread_id, ())
        else:
            removed += int((yield io(cp, "_call", "prune_checkpoints", thread_id, [])))
    return PruneReport(pruned=tuple(ids), checkpoints_removed=removed)


def _sweep(
    cp: RecoveryAPI, *, older_than: float | timedelta, leases: LeaseBackend | None = None
) -> Steps[PruneReport]:
    """Delete whole threads (checkpoints, events, ledger, artifacts) idle for longer than
    ``older_than`` (seconds or a ``timedelta``), except those that must keep their history.

    Threads are listed as everywhere else (:mod:`taskpilots_graph._thread_index`). Deleting
    a thread keeps its ledger entries under a business key (see ``delete_thread``), so a
    business key it committed still deduplicates afterwards.
    """
    cutoff = _cutoff(older_than)
    refused: dict[str, str] = {}
    deleted: list[str] = []
    for thread_id in (yield both(thread_ids, athread_ids, cp.inner)):
        latest = yield io(cp.inner, "get_tuple", _config(thread_id))
        if latest is None:
            continue  # deleted since it was listed
        events = yield io(cp, "events", thread_id)
        last = max([_checkpoint_time(latest), *(e.ts.timestamp() for e in events[-1:])])
        if last >= cutoff:
            continue
        entries = yield io(cp, "ledger", thread_id)
        reason = refusal(latest, entries, (yield from _lease_owner(leases, thread_id)))
        if reason is not None:
            refused[thread_id] = reason
            continue
        yield io(cp, "delete_thread", thread_id)
        deleted.append(thread_id)
    return PruneReport(deleted=tuple(deleted), refused=refused)


sweep = synced(_sweep)
asweep = asynced(_sweep)
