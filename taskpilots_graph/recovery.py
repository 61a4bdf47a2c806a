"""The recovery decision: (failure kind, policy, attempts, elapsed) → what happens next.

I/O free and deterministic given its inputs (the jitter comes from the ``rng`` passed in),
so the same function drives the router node and the property tests.

=====================  =======================================================================
failure kind           decision
=====================  =======================================================================
TRANSIENT              retry this step after a backoff, up to ``max_attempts``
RATE_LIMITED           retry after the service's ``Retry-After`` (or the backoff)
EXTERNAL_OUTAGE        retry while within ``wait_window``; then degrade to the next fallback
CONTRACT               degrade to a fallback; without one, report the error to the model,
                       which can change the call
AUTH, DATA_UNCERTAIN,  a person decides (takeover)
SIDE_EFFECT_UNCERTAIN
MODEL                  a person decides (model errors of the think node use ModelPolicy)
FATAL                  the run fails
any, repeated          the same failure signature ``stuck_after`` times: STUCK, a person
=====================  =======================================================================

When retries, window and fallbacks are used up the policy's ``on_exhausted`` applies. A wait
longer than ``max_in_process_wait`` ends the run in ``waiting_tool``; it never busy-loops.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum

from taskpilots_graph.failures import FailureKind
from taskpilots_graph.policy import ToolPolicy

__all__ = ["Action", "RecoveryDecision", "decide_recovery"]


class Action(StrEnum):
    """What the router does with a failed step."""

    RETRY = "retry"  # call the same tool again at ``retry_at``
    DEGRADE = "degrade"  # switch to ``fallback``
    REPORT = "report"  # hand the error to the model as the tool's answer
    TAKEOVER = "takeover"  # stop and ask a person
    COMPENSATE = "compensate"  # undo committed effects, then fail the run
    FAIL = "fail"  # fail the run


@dataclass(frozen=True, slots=True)
class RecoveryDecision:
    """The router's decision for one failed step.

    Attributes:
        action: What happens.
        reason: Why, in words for the event log and the person taking over.
        retry_at: For ``RETRY``: when (epoch seconds).
        fallback: For ``DEGRADE``: the tool to use.
        stuck: The decision was forced by stuck detection.
    """

    action: Action
    reason: str
    retry_at: float | None = None
    fallback: str | None = None
    stuck: bool = False


_PERSON = {
    FailureKind.AUTH: "the service refused the credentials",
    FailureKind.DATA_UNCERTAIN: "the data cannot be trusted without a person",
    FailureKind.SIDE_EFFECT_UNCERTAIN: "a side effect may or may not have happened",
    FailureKind.MODEL: "the model failed",
}


def _exhausted(policy: ToolPolicy, next_fallback: str | None, why: str) -> RecoveryDecision:
    if next_fallback is not None:
        return RecoveryDecision(Action.DEGRADE, f"{why}; degrading", fallback=next_fallback)
    action = {
        "takeover": Action.TAKEOVER,
        "fail": Action.FAIL,
        "compensate": Action.COMPENSATE,
    }[policy.on_exhausted]
    return RecoveryDecision(action, f"{why}; no fallback left")


def decide_recovery(
    *,
    kind: FailureKind,
    policy: ToolPolicy,
    attempts: int,
    first_failed_at: float,
    now: float,
    retry_after: float | None = None,
    next_fallback: str | None = None,
    signature_count: int = 1,
    rng: random.Random | None = None,
) -> RecoveryDecision:
    """Decide what happens to a step whose tool just failed.

    Args:
        kind: The failure's class.
        policy: The policy of the tool that failed.
        attempts: Calls of that tool for this step so far (the failed one included).
        first_failed_at: When this tool first failed for this step (epoch seconds).
        now: The current time (epoch seconds).
        retry_after: The service's hint, if any.
        next_fallback: The next fallback tool not yet tried, if any.
        signature_count: How often this exact failure happened in the thread.
        rng: Source of the jitter.
    """
    if signature_count >= policy.stuck_after and kind is not FailureKind.FATAL:
        return RecoveryDecision(
            Action.TAKEOVER,
            f"stuck: the same {kind} failure happened {signature_count} times",
            stuck=True,
        )
    if kind is FailureKind.FATAL:
        return RecoveryDecision(Action.FAIL, "fatal failure: retrying cannot help")
    if kind in _PERSON:
        return RecoveryDecision(Action.TAKEOVER, _PERSON[kind])
    if kind is FailureKind.CONTRACT:
        if next_fallback is not None:
            return RecoveryDecision(
                Action.DEGRADE, "the tool's contract changed; degrading", fallback=next_fallback
            )
        return RecoveryDecision(Action.REPORT, "the call does not fit the tool's contract")
    if kind is FailureKind.STUCK:
        return RecoveryDecision(Action.TAKEOVER, "stuck", stuck=True)
    if attempts >= policy.max_attempts:
        return _exhausted(
            policy, next_fallback, f"{attempts} of {policy.max_attempts} attempts failed"
        )
    delay = policy.backoff.delay(attempts, rng)
    if kind is FailureKind.RATE_LIMITED and retry_after is not None:
        delay = retry_after
    elif retry_after is not None:
        delay = max(delay, retry_after)
    if kind is FailureKind.EXTERNAL_OUTAGE and now + delay - first_failed_at > policy.wait_window:
        waited = now - first_failed_at
        return _exhausted(
            policy,
            next_fallback,
            f"outage outlasted the {policy.wait_window:g}s window ({waited:.0f}s)",
        )
    return RecoveryDecision(
        Action.RETRY,
        f"{kind} failure, attempt {attempts} of {policy.max_attempts}",
        retry_at=now + delay,
    )
