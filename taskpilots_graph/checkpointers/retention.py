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

Pruning runs while no run writes to the thread: the latest checkpoint is chosen inside the
deleting statement, so a checkpoint written meanwhile survives, but LangGraph's PostgreSQL
saver writes a checkpoint's blobs before its row, and a prune in between could drop them.
Runs that hold thread leases are protected by the lease check.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from langgraph.checkpoint.base import CheckpointTuple
from langgraph.checkpoint.memory import InMemorySaver

from taskpilots_graph.errors import ConfigurationError, ThreadNotFound
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus
from taskpilots_graph.locks.base import LeaseBackend, thread_lease_name

if TYPE_CHECKING:
    from taskpilots_graph.checkpointers._api import RecoveryAPI

__all__ = ["Keep", "PruneReport", "aprune", "asweep", "prune", "refusal", "sweep"]

Keep = Literal["latest", "milestones"]

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
    for ns, checkpoints in saver.storage.get(thread_id, {}).items():
        latest = max(checkpoints, default=None)
        for checkpoint_id in [c for c in checkpoints if c != latest and c not in keep]:
            del checkpoints[checkpoint_id]
            saver.writes.pop((thread_id, ns, checkpoint_id), None)
            removed += 1
    return removed


def _lease_owner(leases: LeaseBackend | None, thread_id: str) -> str | None:
    held = leases.holder(thread_lease_name(thread_id)) if leases is not None else None
    return None if held is None else held.owner


async def _alease_owner(leases: LeaseBackend | None, thread_id: str) -> str | None:
    held = await leases.aholder(thread_lease_name(thread_id)) if leases is not None else None
    return None if held is None else held.owner


def _config(thread_id: str) -> Any:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}


def prune(
    cp: RecoveryAPI,
    thread_ids: Sequence[str],
    *,
    keep: Keep = "latest",
    leases: LeaseBackend | None = None,
) -> PruneReport:
    """Delete the threads' old checkpoints (see the module docs)."""
    _check_keep(keep)
    ids = _thread_ids(thread_ids)
    latest = {t: cp.inner.get_tuple(_config(t)) for t in ids}
    if missing := [t for t, tup in latest.items() if tup is None]:
        raise ThreadNotFound(missing[0])
    refused: dict[str, str] = {}
    pruned: list[str] = []
    removed = 0
    for thread_id in ids:
        reason = refusal(latest[thread_id], cp.ledger(thread_id), _lease_owner(leases, thread_id))
        if reason is not None:
            refused[thread_id] = reason
            continue
        kept = milestone_checkpoints(cp.events(thread_id)) if keep == "milestones" else []
        if isinstance(cp.inner, InMemorySaver):
            removed += _prune_memory(cp.inner, thread_id, kept)
        else:
            removed += int(cp._call("prune_checkpoints", thread_id, kept))
        pruned.append(thread_id)
    return PruneReport(pruned=tuple(pruned), refused=refused, checkpoints_removed=removed)


async def aprune(
    cp: RecoveryAPI,
    thread_ids: Sequence[str],
    *,
    keep: Keep = "latest",
    leases: LeaseBackend | None = None,
) -> PruneReport:
    """Async form of :func:`prune`."""
    _check_keep(keep)
    ids = _thread_ids(thread_ids)
    latest = {t: await cp.inner.aget_tuple(_config(t)) for t in ids}
    if missing := [t for t, tup in latest.items() if tup is None]:
        raise ThreadNotFound(missing[0])
    refused: dict[str, str] = {}
    pruned: list[str] = []
    removed = 0
    for thread_id in ids:
        owner = await _alease_owner(leases, thread_id)
        reason = refusal(latest[thread_id], await cp.aledger(thread_id), owner)
        if reason is not None:
            refused[thread_id] = reason
            continue
        kept = milestone_checkpoints(await cp.aevents(thread_id)) if keep == "milestones" else []
        if isinstance(cp.inner, InMemorySaver):
            removed += _prune_memory(cp.inner, thread_id, kept)
        else:
            removed += int(await cp._acall("prune_checkpoints", thread_id, kept))
        pruned.append(thread_id)
    return PruneReport(pruned=tuple(pruned), refused=refused, checkpoints_removed=removed)


def sweep(
    cp: RecoveryAPI, *, older_than: float | timedelta, leases: LeaseBackend | None = None
) -> PruneReport:
    """Delete whole threads (checkpoints, events, ledger, artifacts) idle for longer than
    ``older_than`` (seconds or a ``timedelta``), except those that must keep their history.

    Threads are found by scanning the checkpoints (one pass over ``list(None)``). Deleting a
    thread also forgets its ledger entries, so a business key it committed is no longer
    recognised afterwards: choose the age accordingly.
    """
    cutoff = _cutoff(older_than)
    newest: dict[str, CheckpointTuple] = {}
    for tup in cp.inner.list(None):
        thread_id = str(tup.config["configurable"]["thread_id"])
        if tup.config["configurable"].get("checkpoint_ns", "") == "" and (
            thread_id not in newest or tup.checkpoint["id"] > newest[thread_id].checkpoint["id"]
        ):
            newest[thread_id] = tup
    refused: dict[str, str] = {}
    deleted: list[str] = []
    for thread_id, tup in sorted(newest.items()):
        events = cp.events(thread_id)
        last = max([_checkpoint_time(tup), *(e.ts.timestamp() for e in events[-1:])])
        if last >= cutoff:
            continue
        latest = cp.inner.get_tuple(_config(thread_id))
        reason = refusal(latest, cp.ledger(thread_id), _lease_owner(leases, thread_id))
        if reason is not None:
            refused[thread_id] = reason
            continue
        cp.delete_thread(thread_id)
        deleted.append(thread_id)
    return PruneReport(deleted=tuple(deleted), refused=refused)


async def asweep(
    cp: RecoveryAPI, *, older_than: float | timedelta, leases: LeaseBackend | None = None
) -> PruneReport:
    """Async form of :func:`sweep`."""
    cutoff = _cutoff(older_than)
    newest: dict[str, CheckpointTuple] = {}
    async for tup in cp.inner.alist(None):
        thread_id = str(tup.config["configurable"]["thread_id"])
        if tup.config["configurable"].get("checkpoint_ns", "") == "" and (
            thread_id not in newest or tup.checkpoint["id"] > newest[thread_id].checkpoint["id"]
        ):
            newest[thread_id] = tup
    refused: dict[str, str] = {}
    deleted: list[str] = []
    for thread_id, tup in sorted(newest.items()):
        events = await cp.aevents(thread_id)
        last = max([_checkpoint_time(tup), *(e.ts.timestamp() for e in events[-1:])])
        if last >= cutoff:
            continue
        latest = await cp.inner.aget_tuple(_config(thread_id))
        owner = await _alease_owner(leases, thread_id)
        reason = refusal(latest, await cp.aledger(thread_id), owner)
        if reason is not None:
            refused[thread_id] = reason
            continue
        await cp.adelete_thread(thread_id)
        deleted.append(thread_id)
    return PruneReport(deleted=tuple(deleted), refused=refused)
