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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver

from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.ledger import PAUSED, LedgerEntry, LedgerStatus
from taskpilots_graph.threads import (
    THREAD_STATUSES,
    ThreadStatus,
    _listed,
    aevents_for_listing,
    ascan_thread_ids,
    events_for_listing,
    recovery_api,
    root_config,
    scan_thread_ids,
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


def _plain(value: Any) -> dict[str, Any]:
    """A flat dataclass as a JSON-ready dict (mappings and tuples become dicts and lists)."""
    data = {}
    for name in value.__dataclass_fields__:
        item = getattr(value, name)
        data[name] = (
            dict(item)
            if isinstance(item, Mapping)
            else list(item)
            if isinstance(item, tuple)
            else item
        )
    return data


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _frozen(mapping: Mapping[str, int]) -> Mapping[str, int]:
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
        tools = {t.tool: {k: v for k, v in _plain(t).items() if k != "tool"} for t in self.tools}
        return {
            # The four headline figures first, flat, for dashboards and tables.
            "local_recovery_rate": self.local_recovery.rate,
            "duplicate_side_effect_rate": self.duplicates.rate,
            "mean_time_to_close_seconds": self.time_to_close.mean_seconds,
            "takeovers_per_100_runs": self.takeover.per_100_runs,
            "local_recovery": _plain(self.local_recovery),
            "duplicate_side_effects": _plain(self.duplicates),
            "time_to_close": _plain(self.time_to_close),
            "human_takeover": _plain(self.takeover),
            "runs": {**_plain(self.runs), "open": self.runs.open},
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
        return _render(_gauges(self))

    def record_opentelemetry(self, meter: Any) -> list[Any]:
        """Publish the metrics as OpenTelemetry observable gauges on ``meter``.

        The same gauges as :meth:`to_prometheus` (names, help, labels as attributes); each
        reports this snapshot when the meter's reader collects. Needs ``opentelemetry-api``
        (the ``metrics`` extra). Returns the instruments.
        """
        from opentelemetry.metrics import CallbackOptions, Observation

        instruments = []
        for gauge in _gauges(self):

            def observe(options: CallbackOptions, gauge: _Gauge = gauge) -> list[Observation]:
                return [
                    Observation(value, dict(zip(gauge.labels, labels, strict=True)))
                    for labels, value in gauge.samples
                    if not math.isnan(value)
                ]

            instruments.append(
                meter.create_observable_gauge(
                    gauge.name, callbacks=[observe], description=gauge.help
                )
            )
        return instruments

    def _repr_html_(self) -> str:
        from taskpilots_graph.notebook.html import metrics_html

        return metrics_html(self)


@dataclass(frozen=True, slots=True)
class _Gauge:
    name: str
    help: str
    labels: tuple[str, ...]
    samples: tuple[tuple[tuple[str, ...], float], ...]


def _gauge(name: str, help: str, samples: Mapping[str, float] | float | None) -> _Gauge:
    """A gauge with one label (from ``name{label}``) or none; ``None`` becomes ``NaN``."""
    base, _, label = name.partition("{")
    if isinstance(samples, Mapping):
        values = tuple(((k,), float(v)) for k, v in samples.items())
        return _Gauge(f"taskpilots_{base}", help, (label.rstrip("}"),), values)
    value = math.nan if samples is None else float(samples)
    return _Gauge(f"taskpilots_{base}", help, (), (((), value),))


def _per_tool(m: RecoveryMetrics, name: str, help: str, attr: str) -> _Gauge:
    return _gauge(f"{name}{{tool}}", help, {t.tool: getattr(t, attr) for t in m.tools})


def _gauges(m: RecoveryMetrics) -> list[_Gauge]:
    lr, dup, ttc, tk = m.local_recovery, m.duplicates, m.time_to_close, m.takeover
    failures = tuple(((t.tool, k), float(n)) for t in m.tools for k, n in t.failures.items())
    return [
        _gauge("local_recovery_rate", "Failed steps recovered in their own run.", lr.rate),
        _gauge(
            "failed_steps{outcome}",
            "Failed tool steps by outcome.",
            {"recovered": lr.recovered, "unrecovered": lr.unrecovered, "pending": lr.pending},
        ),
        _gauge(
            "failed_steps_recovered_automatically",
            "Failed steps recovered without a person.",
            lr.recovered_automatically,
        ),
        _gauge("duplicate_side_effect_rate", "Effects executed twice (confirmed).", dup.rate),
        _gauge(
            "duplicate_side_effect_rate_upper",
            "Effects executed or possibly executed twice.",
            dup.upper_rate,
        ),
        _gauge(
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
        _gauge(
            "time_to_close_seconds_mean",
            "Mean seconds from a turn's first tool failure to the run closing.",
            ttc.mean_seconds,
        ),
        _gauge(
            "time_to_close_seconds_max",
            "Longest seconds from a turn's first tool failure to the run closing.",
            ttc.max_seconds,
        ),
        _gauge(
            "failure_episodes{end}",
            "Turns with a tool failure, by how they ended.",
            {"closed": ttc.samples, "failed": ttc.failed, "open": ttc.open},
        ),
        _gauge("takeovers_per_100_runs", "Human takeovers per 100 runs.", tk.per_100_runs),
        _gauge(
            "takeovers{state}",
            "Human takeovers by state.",
            {"answered": tk.answered, "pending": tk.pending},
        ),
        _gauge(
            "takeover_wait_seconds{state}",
            "Seconds waited for a person.",
            {"answered": tk.wait_seconds, "pending": tk.pending_wait_seconds},
        ),
        _gauge("takeover_decisions{action}", "Decisions by action.", dict(tk.decisions)),
        _gauge(
            "runs{status}",
            "Runs by status.",
            {s: getattr(m.runs, s) for s in THREAD_STATUSES},
        ),
        _per_tool(m, "tool_calls", "Tool invocations (every attempt).", "calls"),
        _Gauge(
            "taskpilots_tool_failures", "Failed tool attempts by kind.", ("tool", "kind"), failures
        ),
        _per_tool(m, "tool_retries", "Retries scheduled.", "retries"),
        _per_tool(m, "tool_degradations", "Degradations to a fallback.", "degradations"),
        _per_tool(m, "tool_compensations", "Committed effects undone.", "compensations"),
        _gauge(
            "compensations_missing",
            "Effects left without a compensator when a run was abandoned.",
            m.compensations_missing,
        ),
        _gauge("model_failures", "Failed model calls.", m.model_failures),
        _gauge("resumes", "Runs continued by resume or decide.", m.resumes),
    ]


def _render(gauges: Sequence[_Gauge]) -> str:
    try:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import GaugeMetricFamily
        from prometheus_client.registry import Collector
    except ImportError:  # the ``metrics`` extra is not installed: same format, by hand
        return _render_text(gauges)

    class _Snapshot(Collector):
        def collect(self) -> Iterator[GaugeMetricFamily]:
            for gauge in gauges:
                family = GaugeMetricFamily(gauge.name, gauge.help, labels=list(gauge.labels))
                for values, value in gauge.samples:
                    family.add_metric(list(values), value)
                yield family

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot())
    return generate_latest(registry).decode()


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(text: str, *, quote: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


def _render_text(gauges: Sequence[_Gauge]) -> str:
    """Prometheus text exposition format 0.0.4, written without the library."""
    lines = []
    for gauge in gauges:
        lines += [
            f"# HELP {gauge.name} {_escape(gauge.help, quote=False)}",
            f"# TYPE {gauge.name} gauge",
        ]
        for values, value in gauge.samples:
            pairs = ",".join(
                f'{k}="{_escape(v, quote=True)}"'
                for k, v in sorted(zip(gauge.labels, values, strict=True))
            )
            lines.append(
                f"{gauge.name}{{{pairs}}} {_number(value)}"
                if pairs
                else f"{gauge.name} {_number(value)}"
            )
    return "\n".join(lines) + "\n"


# -- the I/O-free core -------------------------------------------------------------------------


def _step_id(event: Event) -> str:
    p = event.payload
    return str(p.get("tool_call_id") or p.get("key") or f"{p.get('tool')}#{event.seq}")


@dataclass
class _Failure:
    human: bool = False
    outcome: str | None = None  # "recovered" / "unrecovered" once settled


def _local_recovery(
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
                    failure.outcome = "recovered"
                    settled.append(failure)
            elif kind is EventKind.DECISION_RECORDED:
                action = (p.get("decision") or {}).get("action")
                for step in p.get("steps") or []:
                    if (failure := open_.get(str(step))) is None:
                        continue
                    failure.human = True
                    if action in ("provide_result", "skip", "abandon"):
                        del open_[str(step)]
                        failure.outcome = (
                            "recovered" if action == "provide_result" else "unrecovered"
                        )
                        settled.append(failure)
            elif kind is EventKind.AGENT_FINISHED:
                for failure in open_.values():
                    failure.outcome = "unrecovered"
                    settled.append(failure)
                open_.clear()
        if statuses.get(thread_id) in ("closed", "failed"):
            for failure in open_.values():
                failure.outcome = "unrecovered"
                settled.append(failure)
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
        rate=_ratio(len(recovered), len(settled)),
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


def _duplicates(
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
        rate=_ratio(len(duplicates), len(executed)),
        upper_rate=_ratio(len(duplicates) + len(possible), len(executed)),
    )


def _time_to_close(events_by_thread: Mapping[str, Sequence[Event]]) -> TimeToClose:
    samples: list[float] = []
    failed = open_ = 0
    for events in events_by_thread.values():
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
        open_ += first is not None
    return TimeToClose(
        samples=len(samples),
        mean_seconds=sum(samples) / len(samples) if samples else None,
        max_seconds=max(samples, default=None),
        failed=failed,
        open=open_,
    )


def _takeover(events_by_thread: Mapping[str, Sequence[Event]], now: datetime) -> TakeoverCost:
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
        per_100_runs=_ratio(100.0 * takeovers, runs),
        answered=len(waits),
        pending=len(pending_since),
        wait_seconds=float(sum(waits)),
        mean_wait_seconds=_ratio(sum(waits), len(waits)),
        pending_wait_seconds=float(sum(max(0.0, (now - t).total_seconds()) for t in pending_since)),
        decisions=_frozen(decisions),
    )


@dataclass
class _Tool:
    calls: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    degradations: int = 0
    compensations: int = 0


def _tools(events: Iterable[Event]) -> tuple[dict[str, _Tool], int]:
    tools: dict[str, _Tool] = {}
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
            tools.setdefault(name, _Tool()).calls += 1
        elif kind is EventKind.TOOL_FAILED:
            failure_kind = str((p.get("failure") or {}).get("kind") or "unknown")
            tools.setdefault(name, _Tool()).failures[failure_kind] += 1
        elif kind is EventKind.EFFECT_UNCERTAIN:
            tools.setdefault(name, _Tool()).failures["side_effect_uncertain"] += 1
        elif kind is EventKind.RETRY_SCHEDULED:
            tools.setdefault(name, _Tool()).retries += 1
        elif kind is EventKind.DEGRADED:
            tools.setdefault(name, _Tool()).degradations += 1
        elif kind is EventKind.COMPENSATED:
            tools.setdefault(name, _Tool()).compensations += 1
    return tools, missing


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
    tools, missing = _tools(e for events in logs.values() for e in events)
    by_status = Counter(status.values())
    all_events = [e for events in logs.values() for e in events]
    return RecoveryMetrics(
        local_recovery=_local_recovery(logs, status),
        duplicates=_duplicates(logs, ledger),
        time_to_close=_time_to_close(logs),
        takeover=_takeover(logs, now),
        runs=RunCounts(total=len(logs), **{s: by_status.get(s, 0) for s in THREAD_STATUSES}),
        tools=tuple(
            ToolStats(
                tool=name,
                calls=t.calls,
                failures=_frozen(t.failures),
                retries=t.retries,
                degradations=t.degradations,
                compensations=t.compensations,
            )
            for name, t in sorted(tools.items())
        ),
        retries=sum(t.retries for t in tools.values()),
        degradations=sum(t.degradations for t in tools.values()),
        compensations=sum(t.compensations for t in tools.values()),
        compensations_missing=missing,
        model_failures=sum(1 for e in all_events if e.kind is EventKind.MODEL_FAILED),
        resumes=sum(1 for e in all_events if e.kind is EventKind.RUN_RESUMED),
        uncertain_effects=sum(1 for e in ledger if e.status is LedgerStatus.UNCERTAIN),
        repeats_caught=sum(1 for e in all_events if e.kind is EventKind.REPEAT_CAUGHT),
        unreconciled_intents=sum(
            1 for e in ledger if e.status is LedgerStatus.INTENDED and not e.extra.get(PAUSED)
        ),
        since=start,
        computed_at=now,
    )


# -- drivers -----------------------------------------------------------------------------------


def _own(ledger: Sequence[LedgerEntry], thread_id: str) -> list[LedgerEntry]:
    """The thread's entries: its status must not read ``closed`` while one is unsettled."""
    return [e for e in ledger if e.thread_id == thread_id]


def _ids(thread_ids: Sequence[str] | None) -> list[str] | None:
    if thread_ids is None:
        return None
    if isinstance(thread_ids, str):
        raise ConfigurationError("thread_ids must be a list of thread ids, not one string")
    return list(dict.fromkeys(thread_ids))


def recovery_metrics(
    checkpointer: BaseCheckpointSaver[Any],
    *,
    since: datetime | float | None = None,
    thread_ids: Sequence[str] | None = None,
) -> RecoveryMetrics:
    """The recovery metrics of the store's runs (or of the runs named).

    Without ``thread_ids`` the runs are the threads found by a scan of
    ``checkpointer.list(None)`` plus the threads with ledger entries. An event row that
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
    ledger = cp.ledger(None)
    if ids is None:
        ids = list(dict.fromkeys([*scan_thread_ids(cp), *(e.thread_id for e in ledger)]))
    logs: dict[str, list[Event]] = {}
    statuses: dict[str, ThreadStatus] = {}
    corrupt: list[str] = []
    for thread_id in ids:
        logs[thread_id], skipped = events_for_listing(cp, thread_id)
        found = cp.get_tuple(root_config(thread_id))
        statuses[thread_id] = _listed(
            thread_id, found, logs[thread_id], _own(ledger, thread_id), skipped
        ).status
        corrupt.extend(skipped)
    result = compute_metrics(logs, ledger, statuses=statuses, since=start)
    return replace(result, corrupt_events=tuple(corrupt)) if corrupt else result


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
    ledger = await cp.aledger(None)
    if ids is None:
        ids = list(dict.fromkeys([*await ascan_thread_ids(cp), *(e.thread_id for e in ledger)]))
    logs: dict[str, list[Event]] = {}
    statuses: dict[str, ThreadStatus] = {}
    corrupt: list[str] = []
    for thread_id in ids:
        logs[thread_id], skipped = await aevents_for_listing(cp, thread_id)
        found = await cp.aget_tuple(root_config(thread_id))
        statuses[thread_id] = _listed(
            thread_id, found, logs[thread_id], _own(ledger, thread_id), skipped
        ).status
        corrupt.extend(skipped)
    result = compute_metrics(logs, ledger, statuses=statuses, since=start)
    return replace(result, corrupt_events=tuple(corrupt)) if corrupt else result
