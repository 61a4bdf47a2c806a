"""The verdicts of the drills (which executions repeat an effect: see
:mod:`taskpilots_graph.drills`) and their reports."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Literal

from taskpilots_graph.drill_runs import Drive

__all__ = ["Baseline", "DrillResult", "DrillsReport", "verdict"]

Outcome = Literal["passed", "failed", "skipped"]


@dataclass(frozen=True)
class DrillResult:
    """The verdict of one drill.

    Attributes:
        name: ``transient``, ``outage_after_effect``, ``long_outage`` or ``crash``.
        outcome: ``passed``, ``failed`` or ``skipped`` (the baseline gave it nothing to
            act on, e.g. no tool was called).
        detail: One line saying what happened.
        thread_id: The drill's thread (look at it with ``taskpilots show``).
        tool: The tool the fault was injected into.
        settled: Where the run ended: ``closed``, ``awaiting_human``, ``failed``,
            ``endless`` (still not settled after the allowed resumes), ``lost`` ...
        duplicates: Side-effect executions beyond the baseline's.
        keyed_reruns: Re-executions of idempotent tools under the same invocation key.
    """

    name: str
    outcome: Outcome
    detail: str
    thread_id: str
    tool: str | None = None
    settled: str | None = None
    duplicates: int = 0
    keyed_reruns: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


@dataclass(frozen=True)
class DrillsReport:
    """Every drill's verdict, and the recovery metrics of the drill threads.

    Attributes:
        graph: The ``module:attribute`` drilled.
        baseline: The tools the fault-free run executed, in order.
        results: One :class:`DrillResult` per drill.
        metrics: ``recovery_metrics(...).as_dict()`` over the drill threads.
        database: Where the drill runs are stored (kept only with ``workdir=``).
        real_effects: The graph was not marked :func:`drill_graph`: its tools may have
            reached real services (``real_effects=True`` was given).
    """

    graph: str
    baseline: tuple[str, ...]
    results: tuple[DrillResult, ...]
    metrics: dict[str, Any]
    database: str
    real_effects: bool = False

    @property
    def passed(self) -> bool:
        """No drill failed."""
        return all(r.outcome != "failed" for r in self.results)

    @property
    def duplicates(self) -> int:
        """Duplicate side effects over all drills."""
        return sum(r.duplicates for r in self.results)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "graph": self.graph,
            "passed": self.passed,
            "duplicates": self.duplicates,
            "baseline": list(self.baseline),
            "drills": [r.as_dict() for r in self.results],
            "metrics": self.metrics,
            "database": self.database,
            "real_effects": self.real_effects,
        }


@dataclass(frozen=True)
class Baseline:
    """What the fault-free run did: its tool executions ``(tool, canonical args, key)`` in
    order, and which tools count as side effects and as idempotent."""

    calls: tuple[tuple[str, str, str | None], ...]
    effects: frozenset[str]
    idempotent: frozenset[str]

    def tools(self) -> list[str]:
        """The tools executed, in order."""
        return [t for t, _, _ in self.calls]

    def count(self) -> Counter[tuple[str, str]]:
        """Executions per ``(tool, canonical args)``."""
        return Counter((t, a) for t, a, _ in self.calls)


def _repeats(base: Baseline, runs: list[tuple[str, str, str | None]]) -> tuple[int, int, str]:
    """(duplicates, keyed re-runs, description) of a drill thread's effect executions."""
    expected = base.count()
    seen: Counter[tuple[str, str]] = Counter()
    keys_seen: set[tuple[str, str | None]] = set()
    duplicates = keyed = 0
    named: list[str] = []
    for tool, args, key in runs:
        if tool not in base.effects:
            continue
        seen[(tool, args)] += 1
        if seen[(tool, args)] <= expected[(tool, args)]:
            keys_seen.add((tool, key))
            continue
        if tool in base.idempotent and key is not None and (tool, key) in keys_seen:
            keyed += 1  # the same idempotency key: the service is trusted to dedup it
            continue
        duplicates += 1
        named.append(f"{tool}{args}")
    text = f"repeated {', '.join(named)}" if named else ""
    return duplicates, keyed, text


def verdict(
    name: str,
    thread_id: str,
    tool: str | None,
    drive: Drive,
    base: Baseline,
    runs: list[tuple[str, str, str | None]],
    *,
    ok_states: tuple[str, ...],
    extra: str = "",
) -> DrillResult:
    """The verdict of drill ``name``: passed if nothing repeated and the run ended in one of
    ``ok_states`` (``extra``: a further problem found by the drill)."""
    duplicates, keyed, repeated = _repeats(base, runs)
    problems = [p for p in (repeated, extra) if p]
    if drive.settled not in ok_states:
        last = f" (last error: {drive.errors[-1]})" if drive.errors else ""
        problems.append(f"ended {drive.settled} after {drive.resumes} resume(s){last}")
    outcome: Outcome = "failed" if problems else "passed"
    detail = "; ".join(problems) or (
        f"ended {drive.settled} after {drive.resumes} resume(s), nothing repeated"
        + (f", {keyed} keyed re-run(s) left to the service" if keyed else "")
    )
    return DrillResult(name, outcome, detail, thread_id, tool, drive.settled, duplicates, keyed)
