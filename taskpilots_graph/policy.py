"""Recovery policies: frozen, validated dataclasses, one per tool (and one for the model).

Invalid values fail when the policy is built, with the fix in the message, and the policies
of a graph are checked against its tools when the graph is built (unknown tool names,
fallbacks that do not exist or point back at the tool).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.failures import Rule

__all__ = ["Backoff", "ModelPolicy", "ToolPolicy", "validate_policies"]

OnExhausted = Literal["takeover", "fail", "compensate"]


def _positive(name: str, value: float, *, zero_ok: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        bound = "≥ 0" if zero_ok else "> 0"
        raise ConfigurationError(f"{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: attempt n waits up to ``initial * multiplier**(n-1)``.

    The defaults give 2 s, 4 s, 8 s, 16 s ... capped at ``max_delay``; with ``jitter`` the
    actual wait is drawn uniformly below that bound, so many clients do not retry in step.
    """

    initial: float = 2.0
    multiplier: float = 2.0
    max_delay: float = 60.0
    jitter: bool = True

    def __post_init__(self) -> None:
        _positive("Backoff.initial", self.initial)
        _positive("Backoff.max_delay", self.max_delay)
        _positive("Backoff.multiplier", self.multiplier)
        if self.multiplier < 1:
            raise ConfigurationError(
                f"Backoff.multiplier must be ≥ 1 (delays must not shrink), got {self.multiplier}"
            )

    def bound(self, attempt: int) -> float:
        """The upper bound of the wait after the ``attempt``-th failure (1-based)."""
        exponent = max(0, attempt - 1)
        # Cap the exponent first: a large attempt count must not overflow a float.
        if exponent > 64:
            return self.max_delay
        return min(self.max_delay, self.initial * self.multiplier**exponent)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait after the ``attempt``-th failure."""
        bound = self.bound(attempt)
        return (rng or random).uniform(0, bound) if self.jitter else bound


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """How failures of one tool are recovered.

    Attributes:
        max_attempts: Calls of the tool for one step, the first included (≥ 1).
        backoff: Waits between attempts.
        wait_window: Seconds an external outage is waited out before degrading.
        fallback: Tools to switch to, in order, when this one stays down (degradation).
        on_exhausted: What happens when attempts, window and fallbacks are used up:
            ``"takeover"`` (a person decides), ``"fail"`` (the run fails) or
            ``"compensate"`` (committed effects are undone, then the run fails).
        max_in_process_wait: Longer waits end the run in ``waiting_tool`` with a
            ``retry_at`` instead of sleeping; a later ``resume`` continues.
        stuck_after: The same failure signature this many times in one thread is STUCK.
        rules: Classification rules for this tool, tried before the defaults.
        confirm_drift: High risk for drift (meant for read tools; side-effecting ones can
            say it in ``side_effect``): a call that, run again, returns a different result
            than before stops for a person instead of silently taking the new result.
        drift_comparator: ``comparator(previous, current) -> bool``, true when two results
            mean the same; default: equal JSON.
    """

    max_attempts: int = 5
    backoff: Backoff = field(default_factory=Backoff)
    wait_window: float = 300.0
    fallback: Sequence[str] = ()
    on_exhausted: OnExhausted = "takeover"
    max_in_process_wait: float = 30.0
    stuck_after: int = 3
    rules: Sequence[Rule] = ()
    confirm_drift: bool = False
    drift_comparator: Callable[[Any, Any], bool] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.confirm_drift, bool):
            raise ConfigurationError("ToolPolicy.confirm_drift must be True or False")
        if self.drift_comparator is not None and not callable(self.drift_comparator):
            raise ConfigurationError(
                "ToolPolicy.drift_comparator must be a callable (previous, current) -> bool"
            )
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigurationError(
                f"ToolPolicy.max_attempts must be an int ≥ 1 (1 = no retry), "
                f"got {self.max_attempts!r}"
            )
        if not isinstance(self.stuck_after, int) or self.stuck_after < 2:
            raise ConfigurationError(
                f"ToolPolicy.stuck_after must be an int ≥ 2, got {self.stuck_after!r}"
            )
        if not isinstance(self.backoff, Backoff):
            raise ConfigurationError("ToolPolicy.backoff must be a tp.Backoff(...)")
        _positive("ToolPolicy.wait_window", self.wait_window, zero_ok=True)
        _positive("ToolPolicy.max_in_process_wait", self.max_in_process_wait, zero_ok=True)
        if self.on_exhausted not in ("takeover", "fail", "compensate"):
            raise ConfigurationError(
                "ToolPolicy.on_exhausted must be 'takeover', 'fail' or 'compensate', "
                f"got {self.on_exhausted!r}"
            )
        fallback = (self.fallback,) if isinstance(self.fallback, str) else tuple(self.fallback)
        if not all(isinstance(name, str) and name for name in fallback):
            raise ConfigurationError("ToolPolicy.fallback must name tools, e.g. ('kb_backup',)")
        object.__setattr__(self, "fallback", fallback)
        object.__setattr__(self, "rules", tuple(self.rules))


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """How model failures are recovered: the next model in ``fallbacks`` is tried.

    A model generation that already produced tool calls which were acted on is never
    retried; this policy only applies to calls that failed without an answer.

    Attributes:
        fallbacks: Chat models to try in order after the primary one fails.
        max_attempts: Calls of each model before moving to the next (≥ 1).
        backoff: Waits between calls of one model.
    """

    fallbacks: Sequence[Any] = ()
    max_attempts: int = 2
    backoff: Backoff = field(default_factory=lambda: Backoff(initial=1.0, max_delay=10.0))

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigurationError(
                f"ModelPolicy.max_attempts must be an int ≥ 1, got {self.max_attempts!r}"
            )
        object.__setattr__(self, "fallbacks", tuple(self.fallbacks))


def validate_policies(
    policies: Mapping[str, ToolPolicy] | None, tool_names: Iterable[str]
) -> dict[str, ToolPolicy]:
    """Check a graph's policies against its tools; return them as a plain dict.

    Raises:
        ConfigurationError: For a policy of an unknown tool, a value that is not a
            ``ToolPolicy``, or a fallback that is unknown or the tool itself.
    """
    names = set(tool_names)
    checked: dict[str, ToolPolicy] = {}
    for tool, policy in (policies or {}).items():
        if tool not in names:
            raise ConfigurationError(
                f"policies[{tool!r}]: no tool has that name; known tools: {sorted(names)}"
            )
        if not isinstance(policy, ToolPolicy):
            raise ConfigurationError(f"policies[{tool!r}] must be a tp.ToolPolicy(...)")
        for name in policy.fallback:
            if name == tool:
                raise ConfigurationError(f"policies[{tool!r}]: a tool cannot fall back to itself")
            if name not in names:
                raise ConfigurationError(
                    f"policies[{tool!r}]: fallback {name!r} is not one of the graph's tools; "
                    "pass it in tools=[...] too"
                )
        checked[tool] = policy
    return checked
