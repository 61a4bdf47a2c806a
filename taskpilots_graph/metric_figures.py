"""The figures the recovery metrics are made of, and how each is counted from the event log.

Each figure is a frozen dataclass (:class:`LocalRecovery`, :class:`DuplicateEffects`,
:class:`TimeToClose`, :class:`TakeoverCost`, :class:`ToolStats`, :class:`RunCounts`) and
each is counted by a pure function of the runs' events (and, for duplicates, the ledger).
:func:`taskpilots_graph.metrics.compute_metrics` puts them together; what each figure means
is told in :mod:`taskpilots_graph.metrics`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any

from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus
from taskpilots_graph.threads import ThreadStatus

__all__ = [
    "DuplicateEffects",
    "LocalRecovery",
    "RunCounts",
    "TakeoverCost",
    "TimeToClose",
    "ToolStats",
    "ToolTally",
    "duplicate_effects",
    "frozen_counts",
    "local_recovery",
    "plain",
    "ratio",
    "takeover_cost",
    "time_to_close",
    "tool_tallies",
    "turn_closes",
]


def plain(value: Any) -> dict[str, Any]:
    """A flat dataclass as a JSON-ready dict (mappings and tuples become dicts and lists)."""
    return {name: _plain_item(getattr(value, name)) for name in value.__dataclass_fields__}


def _plain_item(item: Any) -> Any:
    if isinstance(item, Mapping):
        return dict(item)
    return list(item) if isinstance(item, tuple) else item


def ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def frozen_counts(mapping: Mapping[str, int]) -> Mapping[str, int]:
    return MappingProxyType(dict(sorted(mapping.items())))


@dataclass(frozen=True, slots=True)
class LocalRecovery:
    """Failed tool steps and how they ended.

    Attributes:
        failures: Steps that failed at least once.
        recovered: Failed steps that later produced a result in the same run.
        recovered_automatically: Of those, recovered without a person's decision.
        unrecovered: Failed steps settled otherwise (skipped, reported, abandoned, failed).
        pending: Failed steps of runs still open.
        rate: ``recovered / (recovered + unrecovered)``; ``None`` when nothing settled.
    """

    failures: int = 0
    recovered: int = 0
    recovered_automatically: int = 0
    unrecovered: int = 0
    pending: int = 0
    rate: float | None = None


@dataclass(frozen=True, slots=True)
class DuplicateEffects:
    """Side effects executed more than once under one ledger key.

    Attributes:
        effects: Keys executed at least once (confirmed or possibly).
        duplicates: Keys with two or more confirmed executions.
        possible_duplicates: Other keys that may have been executed twice.
        keys: The keys of ``duplicates`` and ``possible_duplicates``, sorted.
        rate: ``duplicates / effects``; ``None`` without effects.
        upper_rate: ``(duplicates + possible_duplicates) / effects``.
    """

    effects: int = 0
    duplicates: int = 0
    possible_duplicates: int = 0
    keys: tuple[str, ...] = ()
    rate: float | None = None
    upper_rate: float | None = None


@dataclass(frozen=True, slots=True)
class TimeToClose:
    """From the first tool failure of a turn to the run closing.

    Attributes:
        samples: Turns with a failure that closed.
        mean_seconds: Their mean time to close; ``None`` without samples.
        max_seconds: The longest one.
        failed: Turns with a failure that ended ``failed``.
        open: Turns with a failure that have not ended.
    """

    samples: int = 0
    mean_seconds: float | None = None
    max_seconds: float | None = None
    failed: int = 0
    open: int = 0


@dataclass(frozen=True, slots=True)
class TakeoverCost:
    """What human takeovers cost.

    Attributes:
        runs: Runs looked at.
        takeovers: Times a person was asked.
        per_100_runs: ``100 * takeovers / runs``; ``None`` without runs.
        answered: Takeovers a person answered.
        pending: Takeovers still waiting.
        wait_seconds: Total time answered takeovers waited.
        mean_wait_seconds: ``wait_seconds / answered``; ``None`` when none was answered.
        pending_wait_seconds: Total time pending takeovers have waited so far.
        decisions: Decisions recorded, by action.
    """

    runs: int = 0
    takeovers: int = 0
    per_100_runs: float | None = None
    answered: int = 0
    pending: int = 0
    wait_seconds: float = 0.0
    mean_wait_seconds: float | None = None
    pending_wait_seconds: float = 0.0
    decisions: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class ToolStats:
    """Per-tool figures.

    Attributes:
        tool: Tool name.
        calls: ``tool_invoked`` events (every attempt).
        failures: Failed attempts by failure kind (``side_effect_uncertain`` counts effects
            that became uncertain).
        retries: Retries scheduled for the tool.
        degradations: Times the run gave up on the tool for a fallback.
        compensations: Committed effects of the tool undone.
    """

    tool: str
    calls: int = 0
    failures: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    retries: int = 0
    degradations: int = 0
    compensations: int = 0


@dataclass(frozen=True, slots=True)
class RunCounts:
    """Runs (threads) by status; ``open`` is ``running + waiting_tool``."""

    total: int = 0
    running: int = 0
    waiting_tool: int = 0
    awaiting_human: int = 0
    closed: int = 0
    failed: int = 0

    @property
    def open(self) -> int:
        return self.running + self.waiting_tool


def _step_id(event: Event) -> str:
    p = event.payload
    return str(p.get("tool_call_id") or p.get("key") or f"{p.get('tool')}#{event.seq}")


@dataclass
class _Failure:
    human: bool = False
    outcome: str | None = None  # "recovered" / "unrecovered" once settled


def _settle(settled: list[_Failure], failures: Iterable[_Failure], outcome: str) -> None:
    for failure in failures:
        failure.outcome = outcome
        settled.append(failure)


def local_recovery(
    events_by_thread: Mapping[str, Sequence[Event]], statuses: Mapping[str, ThreadStatus]
) -> LocalRecovery:
    settled: list[_Failure] = []
    pending = 0
    for thread_id, events in events_by_thread.items():
        open_: dict[str, _Failure] = {}
        for event in events:
            kind, p = event.kind, event.payload
            if kind in (EventKind.TOOL_FAILED, EventKind.EFFECT_UNCERTAIN):
                open_.setdefault(_step_id(event), _Failure())
            elif kind is EventKind.TOOL_SUCCEEDED or (
                kind is EventKind.EFFECT_RECONCILED and p.get("outcome") == "done"
            ):
                if (failure := open_.pop(_step_id(event), None)) is not None:
                    _settle(settled, [failure], "recovered")
            elif kind is EventKind.DECISION_RECORDED:
                action = (p.get("decision") or {}).get("action")
                for step in p.get("steps") or []:
                    if (failure := open_.get(str(step))) is None:
                        continue
                    failure.human = True
                    if action in ("provide_result", "skip", "abandon"):
                        del open_[str(step)]
                        outcome = "recovered" if action == "provide_result" else "unrecovered"
                        _settle(settled, [failure], outcome)
            elif kind is EventKind.AGENT_FINISHED:
                _settle(settled, open_.values(), "unrecovered")
                open_.clear()
        if statuses.get(thread_id) in ("closed", "failed"):
            _settle(settled, open_.values(), "unrecovered")
        else:
            pending += len(open_)
    recovered = [f for f in settled if f.outcome == "recovered"]
    unrecovered = len(settled) - len(recovered)
    return LocalRecovery(
        failures=len(settled) + pending,
        recovered=len(recovered),
        recovered_automatically=sum(1 for f in recovered if not f.human),
        unrecovered=unrecovered,
        pending=pending,
        rate=ratio(len(recovered), len(settled)),
    )


@dataclass
class _Executions:
    confirmed: int = 0
    possible: int = 0
    inflight: bool = False

    def cut_off(self) -> None:
        # A call that started and never reported back may have reached the service.
        if self.inflight:
            self.possible += 1
            self.inflight = False


def _executions(events: Iterable[Event]) -> _Executions:
    ex = _Executions()
    for event in events:
        kind, p = event.kind, event.payload
        if kind is EventKind.TOOL_INVOKED:
            ex.cut_off()
            ex.inflight = True
        elif kind is EventKind.TOOL_PAUSED:
            ex.inflight = False  # paused on interrupt(): the same call continues later
        elif kind is EventKind.TOOL_SUCCEEDED:
            ex.inflight = False
            ex.confirmed += 1
        elif kind is EventKind.TOOL_FAILED:
            ex.inflight = False
            ex.possible += 1 if p.get("maybe_sent", True) is not False else 0
        elif kind is EventKind.EFFECT_UNCERTAIN:
            ex.cut_off()
        elif kind is EventKind.EFFECT_RECONCILED:
            ex.cut_off()
            outcome = p.get("outcome")
            if outcome in ("done", "not_done", "unknown_idempotent") and ex.possible:
                ex.possible -= 1
                ex.confirmed += outcome == "done"
    ex.cut_off()
    return ex


def duplicate_effects(
    events_by_thread: Mapping[str, Sequence[Event]], ledger: Sequence[LedgerEntry]
) -> DuplicateEffects:
    keys = {e.key for e in ledger}
    by_key: dict[str, list[Event]] = {}
    for events in events_by_thread.values():
        for event in events:
            key = event.payload.get("key")
            if key in keys:
                by_key.setdefault(str(key), []).append(event)
    executed = {
        e.key for e in ledger if e.status in (LedgerStatus.COMMITTED, LedgerStatus.COMPENSATED)
    }
    duplicates, possible = [], []
    for key, events in by_key.items():
        # Several threads can use one business key: order their events by time.
        ex = _executions(sorted(events, key=lambda e: (e.ts, e.thread_id, e.seq)))
        if ex.confirmed + ex.possible:
            executed.add(key)
        if ex.confirmed >= 2:
            duplicates.append(key)
        elif ex.confirmed + ex.possible >= 2:
            possible.append(key)
    return DuplicateEffects(
        effects=len(executed),
        duplicates=len(duplicates),
        possible_duplicates=len(possible),
        keys=tuple(sorted(duplicates + possible)),
        rate=ratio(len(duplicates), len(executed)),
        upper_rate=ratio(len(duplicates) + len(possible), len(executed)),
    )


def turn_closes(events: Iterable[Event]) -> tuple[list[float], int, bool]:
    """The turns of one run with a tool failure: seconds from the first failure to the run
    closing (turns that closed), how many ended ``failed``, whether the last is still open."""
    samples: list[float] = []
    failed = 0
    first: datetime | None = None
    for event in events:
        if event.kind in (EventKind.TOOL_FAILED, EventKind.EFFECT_UNCERTAIN):
            first = first or event.ts
        elif event.kind is EventKind.AGENT_FINISHED and first is not None:
            if event.payload.get("status") == "failed":
                failed += 1
            else:
                samples.append(max(0.0, (event.ts - first).total_seconds()))
            first = None
    return samples, failed, first is not None


def time_to_close(events_by_thread: Mapping[str, Sequence[Event]]) -> TimeToClose:
    turns = [turn_closes(events) for events in events_by_thread.values()]
    samples = [s for closed, _, _ in turns for s in closed]
    return TimeToClose(
        samples=len(samples),
        mean_seconds=sum(samples) / len(samples) if samples else None,
        max_seconds=max(samples, default=None),
        failed=sum(failed for _, failed, _ in turns),
        open=sum(still_open for _, _, still_open in turns),
    )


def takeover_cost(events_by_thread: Mapping[str, Sequence[Event]], now: datetime) -> TakeoverCost:
    waits: list[float] = []
    pending_since: list[datetime] = []
    decisions: Counter[str] = Counter()
    for events in events_by_thread.values():
        asked: datetime | None = None
        for event in events:
            kind, p = event.kind, event.payload
            if kind is EventKind.TAKEOVER_REQUESTED:
                asked = asked or event.ts
            elif kind is EventKind.DECISION_RECORDED or (
                kind is EventKind.RUN_RESUMED and "decision" in p
            ):
                if kind is EventKind.DECISION_RECORDED:
                    decisions[str((p.get("decision") or {}).get("action", "unknown"))] += 1
                if asked is not None:
                    waits.append(max(0.0, (event.ts - asked).total_seconds()))
                    asked = None
        if asked is not None:
            pending_since.append(asked)
    runs = len(events_by_thread)
    takeovers = len(waits) + len(pending_since)
    return TakeoverCost(
        runs=runs,
        takeovers=takeovers,
        per_100_runs=ratio(100.0 * takeovers, runs),
        answered=len(waits),
        pending=len(pending_since),
        wait_seconds=float(sum(waits)),
        mean_wait_seconds=ratio(sum(waits), len(waits)),
        pending_wait_seconds=float(sum(max(0.0, (now - t).total_seconds()) for t in pending_since)),
        decisions=frozen_counts(decisions),
    )


@dataclass
class ToolTally:
    calls: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    degradations: int = 0
    compensations: int = 0


def tool_tallies(events: Iterable[Event]) -> tuple[dict[str, ToolTally], int]:
    tools: dict[str, ToolTally] = {}
    missing = 0
    for event in events:
        kind, p = event.kind, event.payload
        name = str(p.get("using") or p.get("tool") or "")
        if kind is EventKind.COMPENSATED and "without_compensator" in p:
            missing += len(p.get("without_compensator") or [])
            continue
        if not name:
            continue
        if kind is EventKind.TOOL_INVOKED:
            tools.setdefault(name, ToolTally()).calls += 1
        elif kind is EventKind.TOOL_FAILED:
            failure_kind = str((p.get("failure") or {}).get("kind") or "unknown")
            tools.setdefault(name, ToolTally()).failures[failure_kind] += 1
        elif kind is EventKind.EFFECT_UNCERTAIN:
            tools.setdefault(name, ToolTally()).failures["side_effect_uncertain"] += 1
        elif kind is EventKind.RETRY_SCHEDULED:
            tools.setdefault(name, ToolTally()).retries += 1
        elif kind is EventKind.DEGRADED:
            tools.setdefault(name, ToolTally()).degradations += 1
        elif kind is EventKind.COMPENSATED:
            tools.setdefault(name, ToolTally()).compensations += 1
    return tools, missing
