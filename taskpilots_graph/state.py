"""Graph state of the recovery agent: the conversation plus two structured layers.

* **Step layer** (``steps``): one record per tool call: attempts, the last failure and its
  kind, the tool actually used (a fallback after degradation), the status. A tool failure
  updates only its own record.
* **Flow layer** (``flow``): where the run stands (running, waiting for a tool, awaiting a
  person, compensating, closed, failed), when to retry, the committed effects, and the
  failure signatures used to detect a stuck loop. The recovery router decides it.

Both layers hold ids, statuses and short summaries (never raw payloads), so checkpoints stay
small and a resumed run is anchored on facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypedDict

from langchain_core.messages import AnyMessage

from taskpilots_graph._messages import merge_messages
from taskpilots_graph.checkpointers.messages import RecordMap
from taskpilots_graph.window import MemoryState

__all__ = [
    "FlowStage",
    "FlowState",
    "RecoveryState",
    "StepRecord",
    "StepStatus",
    "merge_flow",
    "merge_steps",
]

StepStatus = Literal[
    "running", "waiting_tool", "degraded", "awaiting_human", "compensating", "closed"
]
FlowStage = Literal["running", "waiting_tool", "awaiting_human", "compensating", "closed", "failed"]


class StepRecord(TypedDict, total=False):
    """The step layer: one tool call of the model.

    Attributes:
        tool_call_id: The model's id for the call.
        tool: The tool the model asked for.
        using: The tool being called now (a fallback after degradation).
        args: The call's arguments.
        status: Where the step stands.
        attempts: Calls of ``using`` for this step.
        calls: Calls of any tool for this step.
        tried: Tools given up on for this step.
        failure: The last failure (kind, error type, message, retry-after hint).
        first_failed_at: When the current tool first failed (epoch seconds).
        retry_at: When the next attempt is due (epoch seconds).
        key: The ledger key of the last execution, for side effects.
        result: A short summary of the result, once closed.
    """

    tool_call_id: str
    tool: str
    using: str
    args: dict[str, Any]
    status: StepStatus
    attempts: int
    calls: int
    tried: list[str]
    failure: dict[str, Any] | None
    first_failed_at: float | None
    retry_at: float | None
    key: str | None
    result: str | None


class FlowState(TypedDict, total=False):
    """The flow layer: the run as a whole.

    Attributes:
        stage: Where the run stands.
        retry_at: When a run waiting for a tool should be resumed (epoch seconds).
        takeover: A person has been asked to decide.
        committed: Ledger keys of effects committed by this thread, in order.
        signatures: How often each failure signature occurred (stuck detection).
        reason: Why the run waits, escalated or failed.
        budget_turn: Id of the user message during which a person last decided.
        budget_from: Model decisions of that user turn spent before the decision (a
            decision buys a fresh ``max_steps`` budget).
        resumed_seq: The ``run_resumed`` event whose resume context was given to the model.
        milestones: Business milestones reached, in order.
    """

    stage: FlowStage
    retry_at: float | None
    takeover: bool
    committed: list[str]
    signatures: dict[str, int]
    reason: str | None
    budget_turn: str | None
    budget_from: int
    resumed_seq: int | None
    milestones: list[str]


def merge_steps(
    current: dict[str, StepRecord] | None, update: Mapping[str, StepRecord | None] | None
) -> dict[str, StepRecord]:
    """Reducer of ``steps``: records are updated field by field, keyed by tool-call id; a
    ``None`` record removes the step.

    An updated record is a new object and the others are kept as they are, so the result
    is a :class:`~taskpilots_graph.checkpointers.messages.RecordMap`: the checkpointer
    stores each record once instead of the whole step layer at every step.
    """
    merged = RecordMap(current or {})
    for call_id, record in (update or {}).items():
        if record is None:
            merged.pop(call_id, None)
        else:
            merged[call_id] = {**merged.get(call_id, {}), **record}
    return merged


def merge_flow(current: FlowState | None, update: FlowState | None) -> FlowState:
    """Reducer of ``flow``: fields are replaced, ``committed`` grows without repeats."""
    merged: FlowState = {**(current or {}), **(update or {})}
    if update and "committed" in update:
        seen = list((current or {}).get("committed", []))
        seen += [k for k in update["committed"] if k not in seen]
        merged["committed"] = seen
    return merged


class RecoveryState(TypedDict):
    """State of :func:`~taskpilots_graph.create_recovery_agent` graphs.

    Attributes:
        messages: The conversation, merged as LangGraph's ``add_messages`` merges it (by
            :func:`~taskpilots_graph._messages.merge_messages`, which appends without
            re-indexing the whole conversation at every step).
        steps: The step layer, by tool-call id.
        flow: The flow layer.
        memory: What an earlier version kept of the turns its window removed from the
            state (read, never written now: the state keeps every message).
    """

    messages: Annotated[list[AnyMessage], merge_messages]
    steps: Annotated[dict[str, StepRecord], merge_steps]
    flow: Annotated[FlowState, merge_flow]
    memory: MemoryState
