"""The call context (what the ledger protocol knows about one tool call) and its builder:
both agent forms, an undo and an orphan intent derive key, rules and drift settings here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from taskpilots_graph.drift import Comparator
from taskpilots_graph.failures import Rule
from taskpilots_graph.ledger import SideEffectSpec, default_key
from taskpilots_graph.policy import ToolPolicy

__all__ = ["CallContext", "call_context"]


@dataclass(frozen=True, slots=True)
class CallContext:
    """Everything the protocol needs to know about one tool call."""

    thread_id: str
    checkpoint_ns: str
    tool: str
    args: Mapping[str, Any]
    tool_call_id: str | None
    spec: SideEffectSpec | None
    key: str
    rules: tuple[Rule, ...] = ()
    confirm_drift: bool = False  # a different result on a repeated call stops for a person
    drift_comparator: Comparator | None = None
    previous: Mapping[str, Any] | None = None  # the call's earlier ``tool_succeeded`` payload
    attempt: int = 1  # of a pure tool in its step (side effects count theirs in the ledger)
    extra: Mapping[str, Any] | None = None  # written into the ``extra`` of a new entry
    step_durable: bool = False  # the checkpoint naming the call is on disk before it runs

    @property
    def keeps_value(self) -> bool:
        """Whether the result's value goes into its event (a comparator will need it)."""
        return self.confirm_drift or self.drift_comparator is not None


def call_context(
    *,
    thread_id: str,
    checkpoint_ns: str,
    tool: str,
    args: Mapping[str, Any],
    tool_call_id: str | None,
    spec: SideEffectSpec | None,
    policy: ToolPolicy | None = None,
    key: str | None = None,
    attempt: int = 1,
    extra: Mapping[str, Any] | None = None,
    step_durable: bool = False,
) -> CallContext:
    """The context of one call of ``tool`` with ``args``: ``key`` when already known (an
    undo, an orphan intent), else the tool's ``key=`` or the default key; ``policy``'s
    user rules and drift settings; ``extra`` for the call's new ledger entry;
    ``step_durable`` when the checkpoint holding the model's call is on disk before the call
    runs (``durability="sync"`` with every such checkpoint stored)."""
    args = dict(args)
    if key is None and spec is not None and spec.key is not None:
        key = spec.key(args)
    elif key is None:
        key = default_key(
            thread_id=thread_id,
            checkpoint_ns=checkpoint_ns,
            tool_call_id=tool_call_id,
            tool=tool,
            args=args,
        )
    context = CallContext(
        thread_id,
        checkpoint_ns,
        tool,
        args,
        tool_call_id,
        spec,
        key,
        attempt=attempt,
        extra=extra,
        step_durable=step_durable,
    )
    if policy is None:  # an undo or an orphan intent: no rules, no drift settings
        return context
    comparator = spec.drift_comparator if spec is not None else None
    return replace(
        context,
        rules=tuple(policy.rules),
        confirm_drift=policy.confirm_drift or (spec is not None and spec.confirm_drift),
        drift_comparator=comparator or policy.drift_comparator,
    )
