"""A thread's health as a supervisor's scan sees it, and why it is resumed (pure).

:func:`thread_health` reads a thread's latest state and says what it is doing
(:class:`HealthStatus`): running under a live lease, idle, waiting on a person, parked until
its ``retry_at``, due, orphaned by a dead worker, or given up on. An orphaned or due thread
is resumed with an :class:`Attribution` saying why (thread, node, step, tool, agent, failure
kind). :class:`ScanReport` is what one scan found and did. Nothing here reads a store or
takes a lease; :mod:`taskpilots_graph.supervisor` does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any, Final, Literal

from langgraph.types import StateSnapshot

from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus
from taskpilots_graph.nodes.executor import pending_calls
from taskpilots_graph.unfinished import has_work

__all__ = [
    "Attribution",
    "Cause",
    "HealthStatus",
    "ScanReport",
    "ThreadHealth",
    "needs_recovery",
    "resumed_payload",
    "thread_health",
    "unreadable_health",
    "with_effect_in_flight",
]

# The supervisor's logger: an unreadable thread is reported where the scan is.
_log: Final = logging.getLogger("taskpilots_graph.supervisor")

Cause = Literal["worker_lost", "retry_due"]
"""Why a thread is resumed: its worker died, or its wait is over."""


class HealthStatus(StrEnum):
    """What a scan found a thread doing."""

    RUNNING = "running"  # a live worker holds its lease
    IDLE = "idle"  # nothing left to do (finished, failed or closed)
    TAKEOVER = "takeover"  # waits on a person's decision
    WAITING = "waiting"  # parked in waiting_tool until retry_at
    DUE = "due"  # parked in waiting_tool, and retry_at has passed
    ORPHANED = "orphaned"  # work left and nobody holds its lease: its worker is gone
    FAILING = "failing"  # its recovery failed too often at this checkpoint; given up on


@dataclass(frozen=True, slots=True)
class Attribution:
    """Which failure a recovery answers: where the thread stood and what went wrong.

    Attributes:
        thread_id: The thread.
        cause: ``"worker_lost"`` (work left, lease gone) or ``"retry_due"`` (a waited-out
            tool failure is due again).
        agent: The graph's name.
        node: The node that was to run next (``act``, ``think``, ``wait``, ...).
        step: The tool call id of the step concerned, if a tool step.
        tool: The tool of that step (the one in use, after a degradation).
        failure: ``"worker_lost"``, or the step's failure kind (``FailureKind`` value).
        checkpoint_id: The checkpoint the thread stood at.
    """

    thread_id: str
    cause: Cause
    agent: str
    node: str | None = None
    step: str | None = None
    tool: str | None = None
    failure: str = "worker_lost"
    checkpoint_id: str | None = None

    def payload(self) -> dict[str, Any]:
        """JSON form, as recorded in events and passed to queue jobs."""
        return asdict(self)

    @classmethod
    def from_payload(cls, data: Mapping[str, Any]) -> Attribution:
        """Rebuild from :meth:`payload` (e.g. in a queue worker).

        Raises:
            ConfigurationError: If ``data`` is not such a payload.
        """
        try:
            return cls(**{k: data[k] for k in data if k in cls.__dataclass_fields__})
        except TypeError as exc:
            raise ConfigurationError(f"not an attribution payload: {dict(data)!r}") from exc


@dataclass(frozen=True, slots=True)
class ThreadHealth:
    """One thread as a scan saw it.

    Attributes:
        thread_id: The thread.
        status: What it is doing.
        checkpoint_id: Its latest checkpoint.
        holder: Owner token of its lease (``host:pid:random``) while ``RUNNING``.
        retry_at: When a ``WAITING`` / ``DUE`` thread's tool is retried (epoch seconds).
        attribution: For ``ORPHANED`` / ``DUE`` / ``WAITING`` / ``FAILING`` threads.
        error: Why recovery kept failing (``FAILING``).
    """

    thread_id: str
    status: HealthStatus
    checkpoint_id: str | None = None
    holder: str | None = None
    retry_at: float | None = None
    attribution: Attribution | None = None
    error: str | None = None

    @property
    def recoverable(self) -> bool:
        """Whether the supervisor resumes it now."""
        return self.status in (HealthStatus.ORPHANED, HealthStatus.DUE)


@dataclass(frozen=True, slots=True)
class ScanReport:
    """What one supervisor tick found and did.

    Attributes:
        threads: Every thread's health.
        resumed: Threads this supervisor resumed (a run happened).
        dispatched: Threads handed to ``dispatch`` (a queue).
        busy: Threads another runner took first (``ThreadBusy``).
        failed: ``(thread_id, error)`` of resumes that raised.
    """

    threads: tuple[ThreadHealth, ...] = ()
    resumed: tuple[str, ...] = ()
    dispatched: tuple[str, ...] = ()
    busy: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()

    def count(self, status: HealthStatus) -> int:
        """How many threads have ``status``."""
        return sum(1 for t in self.threads if t.status is status)

    def summary(self) -> str:
        """One line for logs: counts by status and what was done."""
        counts = ", ".join(f"{s.value} {self.count(s)}" for s in HealthStatus if self.count(s))
        return (
            f"{len(self.threads)} threads ({counts or 'none'}); resumed {len(self.resumed)}, "
            f"dispatched {len(self.dispatched)}, busy {len(self.busy)}, failed {len(self.failed)}"
        )


def _checkpoint_id(snapshot: StateSnapshot) -> str | None:
    value = (snapshot.config or {}).get("configurable", {}).get("checkpoint_id")
    return str(value) if value is not None else None


def _waiting(snapshot: StateSnapshot) -> tuple[float | None, Mapping[str, Any]]:
    """(retry_at, the step waited for) if the thread is parked in ``waiting_tool``."""
    values = snapshot.values if isinstance(snapshot.values, Mapping) else {}
    flow = values.get("flow") or {}
    if flow.get("stage") != "waiting_tool":
        return None, {}
    steps = [s for s in (values.get("steps") or {}).values() if s.get("status") == "waiting_tool"]
    due = [s for s in steps if s.get("retry_at")]
    step = min(due, key=lambda s: float(s["retry_at"])) if due else {}
    retry_at = flow.get("retry_at") or (step.get("retry_at") if step else None)
    return (float(retry_at) if retry_at else None), step


def needs_recovery(snapshot: StateSnapshot, now: float) -> bool:
    """Whether an unleased thread in this state should be resumed at ``now``.

    It should when work is left, no person is asked anything, and it is not parked in
    ``waiting_tool`` with a ``retry_at`` still ahead.
    """
    if snapshot.interrupts or not has_work(snapshot):
        return False
    retry_at, _ = _waiting(snapshot)
    return retry_at is None or retry_at <= now


def _attribute(thread_id: str, snapshot: StateSnapshot, agent: str, cause: Cause) -> Attribution:
    node = (
        snapshot.next[0] if snapshot.next else (snapshot.tasks[0].name if snapshot.tasks else None)
    )
    if cause == "retry_due":
        _, step = _waiting(snapshot)
        failure = str((step.get("failure") or {}).get("kind") or "unknown")
        call_id, tool = step.get("tool_call_id"), step.get("using") or step.get("tool")
    else:
        values = snapshot.values if isinstance(snapshot.values, Mapping) else {}
        _, calls = pending_calls(values.get("messages") or [])
        tool_step = calls[0] if calls and node in ("act", "recover", "wait") else None
        failure = "worker_lost"
        call_id, tool = (tool_step["id"], tool_step["name"]) if tool_step else (None, None)
    return Attribution(
        thread_id, cause, agent, node, call_id, tool, failure, _checkpoint_id(snapshot)
    )


def thread_health(
    thread_id: str, snapshot: StateSnapshot, *, agent: str, now: float
) -> ThreadHealth:
    """The health of a thread nobody holds the lease of (pure; the scan checks the lease)."""
    checkpoint_id = _checkpoint_id(snapshot)
    if snapshot.interrupts:
        return ThreadHealth(thread_id, HealthStatus.TAKEOVER, checkpoint_id)
    if not has_work(snapshot):
        return ThreadHealth(thread_id, HealthStatus.IDLE, checkpoint_id)
    retry_at, _ = _waiting(snapshot)
    if retry_at is not None:
        status = HealthStatus.DUE if retry_at <= now else HealthStatus.WAITING
        why = _attribute(thread_id, snapshot, agent, "retry_due")
        return ThreadHealth(thread_id, status, checkpoint_id, retry_at=retry_at, attribution=why)
    why = _attribute(thread_id, snapshot, agent, "worker_lost")
    return ThreadHealth(thread_id, HealthStatus.ORPHANED, checkpoint_id, attribution=why)


def with_effect_in_flight(health: ThreadHealth, entries: Sequence[LedgerEntry]) -> ThreadHealth:
    """``health`` naming the effect the lost worker was in, when its checkpoint cannot.

    With a durability other than "sync", the checkpoint that shows the pending tool call may
    not be on disk when the worker dies, while the ledger intent of the call always is: the
    latest entry still ``intended`` names the tool and the step.
    """
    why = health.attribution
    if why is None or why.cause != "worker_lost" or why.tool is not None:
        return health
    in_flight = [e for e in entries if e.status is LedgerStatus.INTENDED]
    if not in_flight:
        return health
    entry = max(in_flight, key=lambda e: e.updated_at)
    return replace(health, attribution=replace(why, step=entry.tool_call_id, tool=entry.tool))


def unreadable_health(thread_id: str, checkpoint_id: str, exc: Exception) -> ThreadHealth:
    _log.error("cannot read thread %r: %s", thread_id, exc)
    error = f"unreadable: {type(exc).__name__}: {exc}"[:2000]
    return ThreadHealth(thread_id, HealthStatus.FAILING, checkpoint_id, error=error)


def resumed_payload(snapshot: StateSnapshot, attribution: Attribution | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"next": list(snapshot.next), "by": "supervisor"}
    if attribution is not None:
        payload["attribution"] = attribution.payload()
    return payload
