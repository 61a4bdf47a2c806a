"""The failure flow chart of a graph, derived from its declared tools and policies.

For every tool of a recovery agent, :func:`recovery_map` says what kind of side effect it
has (``read``, ``idempotent``, ``pre-checked`` or ``may become uncertain``), its policy
(attempts, backoff, fallbacks, what happens when they are used up) and, for each failure
kind, what happens: retry automatically, wait, degrade, report to the model, ask a person,
compensate or fail. The answers are computed by asking
:func:`~taskpilots_graph.recovery.decide_recovery` and the ledger's
:func:`~taskpilots_graph.ledger.step_after_precheck` the questions the running agent would
ask, so the chart cannot drift away from the code. It also lists the configuration mistakes
it can see.

Example:
    >>> from taskpilots_graph.recovery_map import recovery_map
    >>> m = recovery_map(graph)  # doctest: +SKIP
    >>> m.table()[0]["transient"]  # doctest: +SKIP
    'retry up to 5 attempts, then ask a person'
    >>> print(m.mermaid())  # doctest: +SKIP
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.failures import FailureKind
from taskpilots_graph.ledger import SideEffectSpec, Step, Unknown, step_after_precheck
from taskpilots_graph.nodes.executor import RecoveryExecutor
from taskpilots_graph.policy import Backoff, ToolPolicy
from taskpilots_graph.recovery import Action, RecoveryDecision, decide_recovery
from taskpilots_graph.tool_tables import find_executor
from taskpilots_graph.tools import spec_of

__all__ = ["MAP_KINDS", "EffectClass", "RecoveryMap", "ToolRecovery", "recovery_map"]

EffectClass = Literal["read", "idempotent", "pre-checked", "may become uncertain"]

MAP_KINDS: tuple[FailureKind, ...] = tuple(k for k in FailureKind if k is not FailureKind.MODEL)
"""The failure kinds of a tool call (model failures belong to the think node's policy)."""

_NOT_APPLICABLE = "n/a (no side effect)"


@dataclass(frozen=True, slots=True)
class ToolRecovery:
    """What happens when one tool fails.

    Attributes:
        tool: The tool's name.
        effect: ``read``, ``idempotent``, ``pre-checked`` or ``may become uncertain``.
        compensable: A compensator undoes the effect when a run is abandoned.
        confirm_drift: A drifted result asks a person (else it is recorded and taken).
        max_attempts: Calls per step before the policy is exhausted.
        backoff: The waits between attempts, in words.
        wait_window: Seconds an outage is waited out before degrading.
        fallback: The tools degraded to, in order.
        on_exhausted: ``takeover``, ``fail`` or ``compensate``.
        outcomes: For each failure kind (:data:`MAP_KINDS`), what happens, in words.
    """

    tool: str
    effect: EffectClass
    compensable: bool
    confirm_drift: bool
    max_attempts: int
    backoff: str
    wait_window: float
    fallback: tuple[str, ...]
    on_exhausted: str
    outcomes: Mapping[FailureKind, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcomes", MappingProxyType(dict(self.outcomes)))

    def row(self) -> dict[str, str]:
        """The tool as one row of :meth:`RecoveryMap.table`."""
        return {
            "tool": self.tool,
            "side effect": self.effect,
            "compensation": "yes" if self.compensable else "no",
            "drift": "a person confirms" if self.confirm_drift else "recorded, new result taken",
            "attempts": str(self.max_attempts),
            "backoff": self.backoff,
            "fallback": ", ".join(self.fallback) or "-",
            "on exhausted": self.on_exhausted,
            **{kind.value: self.outcomes[kind] for kind in MAP_KINDS},
        }


@dataclass(frozen=True, slots=True)
class RecoveryMap:
    """The failure flow chart of a graph: one :class:`ToolRecovery` per tool, and warnings.

    Attributes:
        tools: Per tool, in the graph's tool order.
        warnings: Configuration mistakes found (empty when none).
    """

    tools: tuple[ToolRecovery, ...]
    warnings: tuple[str, ...] = ()

    def table(self) -> list[dict[str, str]]:
        """One row per tool: its effect class, policy and the outcome of each failure kind."""
        return [t.row() for t in self.tools]

    def mermaid(self) -> str:
        """The chart as Mermaid ``flowchart`` text: each tool, its outcomes by failure kind,
        and dotted edges to its fallbacks."""
        lines = ["flowchart LR"]
        ids = {t.tool: f"t{i}" for i, t in enumerate(self.tools)}
        for tool in self.tools:
            node = ids[tool.tool]
            lines.append(f'  {node}["{_mermaid_text(tool.tool)}<br/>{tool.effect}"]')
            grouped: dict[str, list[str]] = {}
            for kind in MAP_KINDS:
                grouped.setdefault(tool.outcomes[kind], []).append(kind.value)
            for index, (outcome, kinds) in enumerate(grouped.items()):
                target = f"{node}o{index}"
                label = _mermaid_text(", ".join(kinds))
                lines.append(f'  {node} -->|"{label}"| {target}("{_mermaid_text(outcome)}")')
            lines += [
                f'  {node} -.->|"fallback"| {ids[name]}' for name in tool.fallback if name in ids
            ]
        return "\n".join(lines)

    def render(self) -> str:
        """The chart as plain text: one block per tool, then the warnings."""
        out: list[str] = []
        for row in self.table():
            out.append(f"{row['tool']} ({row['side effect']})")
            out += [f"  {name}: {value}" for name, value in row.items() if name != "tool"]
        out += [f"warning: {w}" for w in self.warnings]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()

    def _repr_html_(self) -> str:
        """An HTML table for Jupyter (every value escaped, no script)."""
        rows = self.table()
        head = list(rows[0]) if rows else ["tool"]
        cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(row[h])}</td>" for h in head) + "</tr>"
            for row in rows
        )
        warnings = "".join(f"<li>{html.escape(w)}</li>" for w in self.warnings)
        tail = f"<p><b>Warnings</b></p><ul>{warnings}</ul>" if warnings else ""
        return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>{tail}"


def _mermaid_text(text: str) -> str:
    # Mermaid labels are quoted: quotes and angle brackets become entity codes.
    return (
        text.replace("&", "#amp;").replace('"', "#quot;").replace("<", "#lt;").replace(">", "#gt;")
    )


def _backoff(b: Backoff) -> str:
    return f"{b.initial:g}s x{b.multiplier:g}, at most {b.max_delay:g}s" + (
        ", jitter" if b.jitter else ""
    )


def effect_class(spec: SideEffectSpec | None) -> EffectClass:
    """How a tool's effect can be recovered, from its ``@side_effect`` declaration."""
    if spec is None:
        return "read"
    if spec.precheck is not None:
        return "pre-checked"
    return "idempotent" if spec.idempotent else "may become uncertain"


def _words(decision: RecoveryDecision) -> str:
    action = decision.action
    if action is Action.DEGRADE:
        return f"degrade to {decision.fallback}"
    return {
        Action.REPORT: "report the error to the model",
        Action.TAKEOVER: "ask a person",
        Action.COMPENSATE: "compensate committed effects, then fail",
        Action.FAIL: "fail the run",
    }[action]


def _outcome(kind: FailureKind, policy: ToolPolicy) -> str:
    """Ask the recovery decision what the agent would do at the first failure and, while
    it retries, at each later one (waiting the longest backoff), until it stops retrying."""
    fallback = policy.fallback[0] if policy.fallback else None
    longest = replace(policy, backoff=replace(policy.backoff, jitter=False))
    attempts, now, first = 1, 0.0, None
    while True:
        decision = decide_recovery(
            kind=kind, policy=longest, attempts=attempts, first_failed_at=0.0, now=now,
            next_fallback=fallback,
        )  # fmt: skip
        first = first or decision
        if decision.action is not Action.RETRY or decision.retry_at is None:
            break
        attempts, now = attempts + 1, decision.retry_at
    if first.action is not Action.RETRY:
        return _words(first)
    if kind is FailureKind.EXTERNAL_OUTAGE:
        return (
            f"wait and retry (up to {policy.max_attempts} attempts within "
            f"{policy.wait_window:g}s), then {_words(decision)}"
        )
    return f"retry up to {policy.max_attempts} attempts, then {_words(decision)}"


def _uncertain(spec: SideEffectSpec | None, policy: ToolPolicy) -> str:
    """The ledger's path for an effect of unknown outcome, then the router's."""
    if spec is None:
        return _NOT_APPLICABLE
    person = _outcome(FailureKind.SIDE_EFFECT_UNCERTAIN, policy)
    unknown = (
        "run again with the same key"
        if step_after_precheck(Unknown(), spec) is Step.EXECUTE
        else person
    )
    if spec.precheck is None:
        return unknown
    return f"pre-check: done → keep its result; not done → run again; unknown → {unknown}"


def _tool(name: str, executor: RecoveryExecutor) -> ToolRecovery:
    spec = spec_of(executor.tools[name])
    policy = executor.policy(name)
    outcomes = {kind: _outcome(kind, policy) for kind in MAP_KINDS}
    outcomes[FailureKind.SIDE_EFFECT_UNCERTAIN] = _uncertain(spec, policy)
    return ToolRecovery(
        tool=name,
        effect=effect_class(spec),
        compensable=spec is not None and spec.compensate is not None,
        confirm_drift=policy.confirm_drift or (spec is not None and spec.confirm_drift),
        max_attempts=policy.max_attempts,
        backoff=_backoff(policy.backoff),
        wait_window=policy.wait_window,
        fallback=tuple(policy.fallback),
        on_exhausted=policy.on_exhausted,
        outcomes=outcomes,
    )


def _warnings(executor: RecoveryExecutor) -> list[str]:
    found: list[str] = []
    for name, tool in executor.tools.items():
        spec = spec_of(tool)
        unguarded = spec is not None and not spec.idempotent and spec.precheck is None
        if unguarded and spec is not None and spec.compensate is None:
            found.append(
                f"{name}: a non-idempotent side effect with neither pre-check nor "
                "compensation; an uncertain outcome always needs a person, and an "
                "abandoned run cannot undo it"
            )
        for fallback in executor.policy(name).fallback:
            fb_spec = spec_of(executor.tools[fallback])
            if fb_spec is not None and fb_spec.precheck is None:
                found.append(
                    f"{name}: falls back to {fallback}, a side effect without a pre-check; "
                    "degrading may perform an effect whose outcome nobody can check"
                )
    return found


def recovery_map(graph: Any) -> RecoveryMap:
    """The failure flow chart of a recovery agent (compiled graph, builder or executor).

    Raises:
        ConfigurationError: If the graph has no recovery executor (``act`` node).
    """
    executor = graph if isinstance(graph, RecoveryExecutor) else find_executor(graph)
    if executor is None:
        raise ConfigurationError(
            "recovery_map needs a graph built with create_recovery_agent, or one with a "
            f"RecoveryExecutor node; got {type(graph).__name__}"
        )
    return RecoveryMap(
        tools=tuple(_tool(name, executor) for name in executor.tools),
        warnings=tuple(_warnings(executor)),
    )
