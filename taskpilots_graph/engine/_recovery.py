"""Applying a recovery decision to a failed call, the same way in both agent forms: around
:func:`~taskpilots_graph.recovery.decide_recovery`, the next fallback, the failure's stuck
signature and the transition events the decision is recorded with."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from taskpilots_graph.engine._records import step_event
from taskpilots_graph.events import EventKind, EventRecord
from taskpilots_graph.failures import FailureKind
from taskpilots_graph.policy import ToolPolicy
from taskpilots_graph.recovery import Action, RecoveryDecision, decide_recovery

__all__ = ["decide_next", "failure_signature", "transition_events"]


def failure_signature(using: Any, kind: Any, error_type: Any) -> str:
    """What makes two failures "the same" for stuck detection: tool, kind and error type."""
    return f"{using}|{kind}|{error_type}"


def decide_next(
    policy_of: Callable[[str], ToolPolicy],
    *,
    tool: str,
    using: str,
    tried: Sequence[str],
    kind: FailureKind,
    attempts: int,
    first_failed_at: float,
    now: float,
    retry_after: float | None,
    signature_count: int,
    rng: random.Random,
) -> tuple[RecoveryDecision, list[str]]:
    """The decision for a failed call of ``using`` (for the model's call of ``tool``), and
    the tools tried once it is applied (``using`` included)."""
    tried_now = [*tried, using]
    chain = policy_of(tool).fallback
    decision = decide_recovery(
        kind=kind,
        policy=policy_of(using),
        attempts=attempts,
        first_failed_at=first_failed_at,
        now=now,
        retry_after=retry_after,
        next_fallback=next((t for t in chain if t not in tried_now), None),
        signature_count=signature_count,
        rng=rng,
    )
    return decision, tried_now


def transition_events(
    thread_id: str, checkpoint_ns: str, decision: RecoveryDecision, **base: Any
) -> list[EventRecord]:
    """The events a decision is recorded with: stuck detection, a scheduled retry, a switch
    to a fallback (a takeover, a report or the end of the run are recorded where they
    happen)."""
    kinds: list[tuple[EventKind, dict[str, Any]]] = []
    if decision.stuck:
        kinds.append((EventKind.STUCK_DETECTED, {}))
    if decision.action is Action.RETRY:
        kinds.append((EventKind.RETRY_SCHEDULED, {"retry_at": decision.retry_at}))
    elif decision.action is Action.DEGRADE:
        kinds.append((EventKind.DEGRADED, {"fallback": decision.fallback}))
    return [
        step_event(thread_id, checkpoint_ns, kind, **{**extra, **base}) for kind, extra in kinds
    ]
