"""The four recovery metrics, computed from the event log and the ledger.

* **Local recovery success rate**: of the tool steps that failed (a ``tool_failed`` or an
  ``effect_uncertain`` event), the share that later produced a result *in the same run*: a
  retry of that step, a fallback tool, a pre-check that found the effect done, or a person's
  ``retry`` / ``edit_args`` / ``provide_result``. This library never restarts a run from its
  entry; a workflow restarted by hand is a new thread, and the old run's failure stays
  unrecovered. A step skipped, reported to the model as an error, abandoned, or whose run
  failed is *not* recovered. Steps of runs still open are ``pending`` and left out of the
  rate.
* **Duplicate side-effect rate**: of the side effects (ledger keys) executed, the share
  executed more than once. Per key, the events are replayed: ``tool_succeeded`` is a
  confirmed execution; a ``tool_failed`` that may have reached the service, or a call cut
  off by a crash, is a *possible* one, cleared by a pre-check (``effect_reconciled``:
  ``not_done``; ``unknown_idempotent``, where the service deduplicates by key) or turned into
  a confirmed one (``done``). ``rate`` counts keys with two confirmed executions;
  ``upper_rate`` also counts keys that may have run twice (e.g. a person chose ``retry`` on
  an uncertain effect).
* **Mean time to close after a tool failure**: per turn of a run (the events up to its
  ``agent_finished``), from the first failure to the run closing (abandoned runs close too).
  Turns that ended ``failed`` or have not ended are counted, not timed.
* **Human takeover cost**: takeovers per 100 runs, seconds waited for a person (answered and,
  until ``now``, still pending), and decisions by action. Consecutive
  ``takeover_requested`` events before one decision are one takeover.

Plus per-tool calls, failures by kind, retries, degradations and compensations, and run
counts by status. Nothing unsettled is hidden: ``uncertain_effects`` counts entries a person
must settle and ``unreconciled_intents`` entries left ``intended`` by a run that stopped
(``resume``, or new input on the thread, reconciles them); a run with either never counts as
``closed``. Superseded events (a ``rewind`` went back before them) are left out.

:func:`compute_metrics` is I/O free; :func:`recovery_metrics` / :func:`arecovery_metrics`
read the store and call it. A run is a thread.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver

from taskpilots_graph import _thread_index
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.exposition import Gauge, gauge, prometheus_text
from taskpilots_graph.ledger import PAUSED, LedgerEntry, LedgerStatus
from taskpilots_graph.metric_figures import (
    DuplicateEffects,
    LocalRecovery,
    RunCounts,
    TakeoverCost,
    TimeToClose,
    ToolStats,
    duplicate_effects,
    frozen_counts,
    local_recovery,
    plain,
    takeover_cost,
    time_to_close,
    tool_tallies,
)
from taskpilots_graph.reprs import html_view
from taskpilots_graph.thread_listing import aevents_for_listing, events_for_listing
from taskpilots_graph.threads import (
    THREAD_STATUSES,
    ThreadStatus,
    listed_thread_info,
    recovery_api,
    root_config,
    status_from_events,
)

__all__ = [
    "DuplicateEffects",
    "LocalRecovery",
    "RecoveryMetrics",
    "RunCounts",
    "TakeoverCost",
    "TimeToClose",
    "ToolStats",
    "arecovery_metrics",
    "compute_metrics",
    "recovery_metrics",
]


@dataclass(frozen=True, slots=True)
class RecoveryMetrics:
    """The four recovery metrics and the figures behind them (see the module docstring)."""

    local_recovery: LocalRecovery
    duplicates: DuplicateEffects
    time_to_close: TimeToClose
    takeover: TakeoverCost
    runs: RunCounts
    tools: tuple[ToolStats, ...] = ()
    retries: int = 0
    degradations: int = 0
    compensations: int = 0
    compensations_missing: int = 0
    model_failures: int = 0
    resumes: int = 0
    uncertain_effects: int = 0
    repeats_caught: int = 0  # committed effects asked for again, answered without executing
    unreconciled_intents: int = 0  # ledger entries left ``intended`` (not paused on a person)
    corrupt_events: tuple[str, ...] = ()  # event rows skipped as undecodable (``thread#seq``)
    since: datetime | None = None
    computed_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def local_recovery_rate(self) -> float | None:
        """The local recovery success rate (``None``: no failed step settled)."""
        return self.local_recovery.rate

    @property
    def duplicate_side_effect_rate(self) -> float | None:
        """The duplicate side-effect rate (confirmed duplicates)."""
        return self.duplicates.rate

    @property
    def mean_time_to_close_seconds(self) -> float | None:
        """Mean time from a tool failure to the run closing."""
        return self.time_to_close.mean_seconds

    @property
    def takeovers_per_100_runs(self) -> float | None:
        """Human takeovers per 100 runs."""
        return self.takeover.per_100_runs

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable form; undefined ratios are ``None``, times ISO 8601.

        ``corrupt_events`` (the keys of event rows skipped as undecodable) is present only
        when there are some.
        """
        tools = {t.tool: {k: v for k, v in plain(t).items() if k != "tool"} for t in self.tools}
        return {
            # The four headline figures first, flat, for dashboards and tables.
            "local_recovery_rate": self.local_recovery.rate,
            "duplicate_side_effect_rate": self.duplicates.rate,
            "mean_time_to_close_seconds": self.time_to_close.mean_seconds,
            "takeovers_per_100_runs": self.takeover.per_100_runs,
            "local_recovery": plain(self.local_recovery),
            "duplicate_side_effects": plain(self.duplicates),
            "time_to_close": plain(self.time_to_close),
            "human_takeover": plain(self.takeover),
            "runs": {**plain(self.runs), "open": self.runs.open},
            "tools": tools,
            "totals": {
                "retries": self.retries,
                "degradations": self.degradations,
                "compensations": self.compensations,
                "compensations_missing": self.compensations_missing,
                "model_failures": self.model_failures,
                "resumes": self.resumes,
                "uncertain_effects": self.uncertain_effects,
                "repeats_caught": self.repeats_caught,
                "unreconciled_intents": self.unreconciled_intents,
            },
            "since": self.since.isoformat() if self.since else None,
            "computed_at": self.computed_at.isoformat(),
            # Only when event rows were skipped as undecodable: a warning, not a figure.
            **({"corrupt_events": list(self.corrupt_events)} if self.corrupt_events else {}),
        }

    def to_prometheus(self) -> str:
        """The metrics in Prometheus text exposition format (all gauges, ``taskpilots_``).

        Built with ``prometheus_client`` when it is installed (the ``metrics`` extra),
        otherwise written by hand in the same format. Undefined ratios are ``NaN``.
        """
        return prometheus_text(_gauges(self))

    def record_opentelemetry(self, meter: Any) -> list[Any]:
        """Publish the metrics as OpenTelemetry observable gauges on ``meter``.

        The same gauges as :meth:`to_prometheus` (names, help, labels as attributes); each
        reports this snapshot when the meter's reader collects. Needs ``opentelemetry-api``
        (the ``metrics`` extra). Returns the instruments.
        """
        from opentelemetry.metrics import CallbackOptions, Observation

        instruments = []
        for each in _gauges(self):

            def observe(options: CallbackOptions, each: Gauge = each) -> list[Observation]:
                return [
                    Observation(value, dict(zip(each.labels, labels, strict=True)))
                    for labels, value in each.samples
                    if not math.isnan(value)
                ]

            instruments.append(
                meter.create_observable_gauge(each.name, callbacks=[observe], description=each.help)
            )
        return instruments

    def _repr_html_(self) -> str | None:
        # Drawn by the notebook package once imported (see taskpilots_graph.reprs).
        return html_view(self)


def _per_tool(m: RecoveryMetrics, name: str, help: str, attr: str) -> Gauge:
    return gauge(f"{name}{{tool}}", help, {t.tool: getattr(t, attr) for t in m.tools})


def _gauges(m: RecoveryMetrics) -> list[Gauge]:
    lr, dup, ttc, tk = m.local_recovery, m.duplicates, m.time_to_close, m.takeover
    failures = tuple(((t.tool, k), float(n)) for t in m.tools for k, n in t.failures.items())
    return [
        gauge("local_recovery_rate", "Failed steps recovered in their own run.", lr.rate),
        gauge(
            "failed_steps{outcome}",
            "Failed tool steps by outcome.",
            {"recovered": lr.recovered, "unrecovered": lr.unrecovered, "pending": lr.pending},
        ),
        gauge(
            "failed_steps_recovered_automatically",
            "Failed steps recovered without a person.",
            lr.recovered_automatically,
        ),
        gauge("duplicate_side_effect_rate", "Effects executed twice (confirmed).", dup.rate),
        gauge(
            "duplicate_side_effect_rate_upper",
            "Effects executed or possibly executed twice.",
            dup.upper_rate,
        ),
        gauge(
            "side_effects{state}",
            "Side-effect keys by state.",
            {
                "executed": dup.effects,
                "duplicate": dup.duplicates,
                "possible_duplicate": dup.possible_duplicates,
                "uncertain": m.uncertain_effects,
                "intended": m.unreconciled_intents,
            },
        ),
        gauge(
            "time_to_close_seconds_mean",
            "Mean seconds from a turn's first tool failure to the run closing.",
            ttc.mean_seconds,
        ),
        gauge(
            "time_to_close_seconds_max",
            "Longest seconds from a turn's first tool failure to the run closing.",
            ttc.max_seconds,
        ),
        gauge(
            "failure_episodes{end}",
            "Turns with a tool failure, by how they ended.",
            {"closed": ttc.samples, "failed": ttc.failed, "open": ttc.open},
        ),
        gauge("takeovers_per_100_runs", "Human takeovers per 100 runs.", tk.per_100_runs),
        gauge(
            "takeovers{state}",
            "Human takeovers by state.",
            {"answered": tk.answered, "pending": tk.pending},
        ),
        gauge(
            "takeover_wait_seconds{state}",
            "Seconds waited for a person.",
            {"answered": tk.wait_seconds, "pending": tk.pending_wait_seconds},
        ),
        gauge("takeover_decisions{action}", "Decisions by action.", dict(tk.decisions)),
        gauge(
            "runs{status}",
            "Runs by status.",
            {s: getattr(m.runs, s) for s in THREAD_STATUSES},
        ),
        _per_tool(m, "tool_calls", "Tool invocations (every attempt).", "calls"),
        Gauge(
            "taskpilots_tool_failures", "Failed tool attempts by kind.", ("tool", "kind"), failures
        ),
        _per_tool(m, "tool_retries", "Retries scheduled.", "retries"),
        _per_tool(m, "tool_degradations", "Degradations to a fallback.", "degradations"),
        _per_tool(m, "tool_compensations", "Committed effects undone.", "compensations"),
        gauge(
            "compensations_missing",
            "Effects left without a compensator when a run was abandoned.",
            m.compensations_missing,
        ),
        gauge("model_failures", "Failed model calls.", m.model_failures),
        gauge("resumes", "Runs continued by resume or decide.", m.resumes),
    ]


def _since(value: datetime | float | None) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return datetime.fromtimestamp(value, UTC)
    raise ConfigurationError(
        f"since must be a datetime or epoch seconds, got {value!r} ({type(value).__name__})"
    )


def compute_metrics(
    events_by_thread: Mapping[str, Sequence[Event]],
    ledger_entries: Iterable[LedgerEntry] = (),
    *,
    statuses: Mapping[str, ThreadStatus] | None = None,
    since: datetime | float | None = None,
    now: datetime | None = None,
) -> RecoveryMetrics:
    """Compute the metrics from event logs and ledger entries (I/O free).

    Args:
        events_by_thread: Each run's events in order (one thread is one run).
        ledger_entries: Ledger entries; those of other threads count only through keys the
            given events use (a business key shared across threads).
        statuses: Each run's status, when known from its checkpoint; others are read from
            the log (:func:`~taskpilots_graph.threads.status_from_events`).
        since: Keep only runs with an event at or after this time (a datetime or epoch
            seconds); a kept run counts as a whole.
        now: The time pending takeovers are measured to (default: now).

    Raises:
        ConfigurationError: For a ``since`` that is not a time.
    """
    start = _since(since)
    now = now or datetime.now(UTC)
    logs = {
        t: [e for e in events if not e.superseded]
        for t, events in events_by_thread.items()
        if start is None or any(e.ts >= start for e in events)
    }
    known = dict(statuses or {})
    status = {t: known.get(t) or status_from_events(events) for t, events in logs.items()}
    used = {str(e.payload["key"]) for ev in logs.values() for e in ev if "key" in e.payload}
    ledger = [e for e in ledger_entries if e.thread_id in logs or e.key in used]
    tools, missing = tool_tallies(e for events in logs.values() for e in events)
    by_status = Counter(status.values())
    kinds = Counter(e.kind for events in logs.values() for e in events)
    return RecoveryMetrics(
        local_recovery=local_recovery(logs, status),
        duplicates=duplicate_effects(logs, ledger),
        time_to_close=time_to_close(logs),
        takeover=takeover_cost(logs, now),
        runs=RunCounts(total=len(logs), **{s: by_status.get(s, 0) for s in THREAD_STATUSES}),
        tools=tuple(
            ToolStats(name, **{**vars(t), "failures": frozen_counts(t.failures)})
            for name, t in sorted(tools.items())
        ),
        retries=sum(t.retries for t in tools.values()),
        degradations=sum(t.degradations for t in tools.values()),
        compensations=sum(t.compensations for t in tools.values()),
        compensations_missing=missing,
        model_failures=kinds[EventKind.MODEL_FAILED],
        resumes=kinds[EventKind.RUN_RESUMED],
        uncertain_effects=sum(1 for e in ledger if e.status is LedgerStatus.UNCERTAIN),
        repeats_caught=kinds[EventKind.REPEAT_CAUGHT],
        unreconciled_intents=sum(
            1 for e in ledger if e.status is LedgerStatus.INTENDED and not e.extra.get(PAUSED)
        ),
        since=start,
        computed_at=now,
    )


# -- drivers -----------------------------------------------------------------------------------


def _ids(thread_ids: Sequence[str] | None) -> list[str] | None:
    if thread_ids is None:
        return None
    if isinstance(thread_ids, str):
        raise ConfigurationError("thread_ids must be a list of thread ids, not one string")
    return list(dict.fromkeys(thread_ids))


@dataclass
class _Reading:
    """What the drivers read of the store, thread by thread (their shared, I/O free part)."""

    ledger: list[LedgerEntry]
    logs: dict[str, list[Event]] = field(default_factory=dict)
    statuses: dict[str, ThreadStatus] = field(default_factory=dict)
    corrupt: list[str] = field(default_factory=list)

    def ids(self, thread_ids: list[str] | None, indexed: Iterable[str]) -> list[str]:
        """The runs named, else those with a checkpoint (``indexed``) or a ledger entry."""
        if thread_ids is not None:
            return thread_ids
        return list(dict.fromkeys([*indexed, *(e.thread_id for e in self.ledger)]))

    def add(self, thread_id: str, listed: tuple[list[Event], tuple[str, ...]], found: Any) -> None:
        self.logs[thread_id], skipped = listed
        # The thread's own entries: its status must not read ``closed`` while one is unsettled.
        own = [e for e in self.ledger if e.thread_id == thread_id]
        info = listed_thread_info(thread_id, found, self.logs[thread_id], own, skipped)
        self.statuses[thread_id] = info.status
        self.corrupt.extend(skipped)

    def metrics(self, since: datetime | None) -> RecoveryMetrics:
        result = compute_metrics(self.logs, self.ledger, statuses=self.statuses, since=since)
        return replace(result, corrupt_events=tuple(self.corrupt)) if self.corrupt else result


def recovery_metrics(
    checkpointer: BaseCheckpointSaver[Any],
    *,
    since: datetime | float | None = None,
    thread_ids: Sequence[str] | None = None,
) -> RecoveryMetrics:
    """The recovery metrics of the store's runs (or of the runs named).

    Without ``thread_ids`` the runs are the threads with a checkpoint
    (:mod:`taskpilots_graph._thread_index`) or a ledger entry. An event row that
    cannot be decoded is skipped and reported in ``corrupt_events`` (and logged): one bad
    row never fails the metrics of the whole store.

    Example:
        >>> m = tp.recovery_metrics(cp)  # doctest: +SKIP
        >>> m.local_recovery_rate, m.duplicate_side_effect_rate  # doctest: +SKIP
        (1.0, 0.0)

    Raises:
        ThreadNotFound: If a named thread has neither a checkpoint nor an event.
        ConfigurationError: For a checkpointer without an event log or a bad ``since``.
    """
    cp = recovery_api(checkpointer)
    ids, start = _ids(thread_ids), _since(since)
    reading = _Reading(cp.ledger(None))
    for thread_id in reading.ids(ids, _thread_index.thread_ids(cp) if ids is None else ()):
        listed = events_for_listing(cp, thread_id)
        reading.add(thread_id, listed, cp.get_tuple(root_config(thread_id)))
    return reading.metrics(start)


async def arecovery_metrics(
    checkpointer: BaseCheckpointSaver[Any],
    *,
    since: datetime | float | None = None,
    thread_ids: Sequence[str] | None = None,
) -> RecoveryMetrics:
    """Async form of :func:`recovery_metrics`, for an ``AsyncRecoveryCheckpointer`` (or one
    wrapping ``InMemorySaver``; LangGraph's sync SQLite and PostgreSQL savers have no async
    methods)."""
    cp = recovery_api(checkpointer)
    ids, start = _ids(thread_ids), _since(since)
    reading = _Reading(await cp.aledger(None))
    for thread_id in reading.ids(ids, await _thread_index.athread_ids(cp) if ids is None else ()):
        listed = await aevents_for_listing(cp, thread_id)
        reading.add(thread_id, listed, await cp.aget_tuple(root_config(thread_id)))
    return reading.metrics(start)
