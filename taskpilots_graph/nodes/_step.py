"""One execution of the act node: its calls, and the state update they settle into.

:class:`~taskpilots_graph.nodes.executor.RecoveryExecutor` prepares a :class:`Step` from the
state, drives each of its calls through the ledger protocol, then :func:`finish` turns the
outcomes into step records and answers: a success becomes a ``ToolMessage`` (a large result
a summary plus an artifact), a failure is recorded in its step record only, for the router.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolCall, ToolMessage
from langchain_core.tools import BaseTool

from taskpilots_graph import _clock
from taskpilots_graph.compression import CompressedObservation, Observation, compress_observation
from taskpilots_graph.engine import CallContext, CallOutcome
from taskpilots_graph.engine._records import error_message, tool_content
from taskpilots_graph.engine._recovery import failure_signature
from taskpilots_graph.engine._requests import latest_successes
from taskpilots_graph.errors import ResultDrifted
from taskpilots_graph.events import Event, EventKind, EventRecord
from taskpilots_graph.failures import failure_payload
from taskpilots_graph.ledger import args_digest
from taskpilots_graph.nodes._context import RunContext
from taskpilots_graph.state import StepRecord
from taskpilots_graph.window import ObservationPolicy

__all__ = ["STEP_RESULT_CHARS", "Step", "StepCall", "finish"]

STEP_RESULT_CHARS = 120
"""Bound on the result kept in a step record and in its ``step_completed`` event: the
model saw the whole (or summarized) result, and ``tool_succeeded`` keeps a longer excerpt."""


@dataclass
class StepCall:
    """One call of the step: the model's call, the tool that runs it, its protocol context
    and its step record so far."""

    call: ToolCall
    tool: BaseTool | None
    ctx: CallContext
    record: StepRecord


@dataclass
class Step:
    """One execution of the node: its calls and the events waiting for the next write."""

    ctx: RunContext
    ai: AIMessage
    calls: list[StepCall]
    first_time: bool
    signatures_seen: Mapping[str, int]
    pending: list[EventRecord] = field(default_factory=list)
    replayed: bool = False  # some call may have run before: compare results (drift)

    @property
    def has_side_effect(self) -> bool:
        return any(c.ctx.spec is not None for c in self.calls)

    def stored(self, ctx: RunContext) -> None:
        """Continue with ``ctx``: once its input checkpoint is on disk, the step acts as
        under ``durability="sync"``."""
        self.ctx = ctx
        if ctx.input_stored:
            for item in self.calls:
                item.ctx = replace(item.ctx, step_durable=True)

    def attach_previous(self, events: Sequence[Event]) -> None:
        """Give each call the ``tool_succeeded`` payload of its latest earlier execution;
        keep the step's ``llm_decided`` out of the log when an earlier execution logged it
        (a crash after the decision was logged: the step runs again, the model did not)."""
        if self.first_time and _decision_logged(events, self.ai):
            self.pending[:] = [e for e in self.pending if e.kind is not EventKind.LLM_DECIDED]
        latest = latest_successes(events)  # one read for the whole step
        for item in self.calls:
            if (found := latest.get((item.ctx.key, item.ctx.tool_call_id))) is not None:
                item.ctx = replace(item.ctx, previous=found)


def _settle(
    item: StepCall,
    outcome: CallOutcome,
    observations: ObservationPolicy | None,
    artifacts: list[CompressedObservation],
) -> tuple[StepRecord, ToolMessage | None]:
    """The step record after one execution, and the answer to the model if settled.

    A large result is appended to ``artifacts`` for the driver to store before the
    update (which refers to it) can reach a checkpoint.
    """
    record = item.record
    call = item.call
    base: StepRecord = {
        "tool_call_id": call["id"] or "",
        "tool": call["name"],
        "using": item.ctx.tool,
        "args": dict(item.ctx.args),
        "attempts": record.get("attempts", 0) + 1,
        "calls": record.get("calls", 0) + 1,
        "tried": list(record.get("tried", [])),
        "key": item.ctx.key if item.ctx.spec is not None else None,
        "retry_at": None,
    }
    if item.tool is None:
        base.update({"status": "closed", "failure": None, "result": "unknown tool"})
        return base, error_message(call, f"Error: unknown tool {item.ctx.tool!r}")
    if outcome.failure is None:
        content, observation = _observe(outcome.result, observations, artifacts)
        base.update({"status": "closed", "failure": None, "result": content[:STEP_RESULT_CHARS]})
        return base, ToolMessage(
            content=content,
            tool_call_id=call["id"] or "",
            name=call["name"],
            artifact=observation,
        )
    failure = failure_payload(outcome.failure)
    if isinstance(outcome.error, ResultDrifted):
        # Kept for the person: both values, and the new result that ``accept`` keeps.
        failure["drift"] = {**outcome.error.drift, "current": outcome.error.result}
    base.update(
        {
            "status": "waiting_tool",
            "failure": failure,
            "first_failed_at": record.get("first_failed_at") or _clock.now(),
        }
    )
    return base, None


def _observe(
    result: Any, policy: ObservationPolicy | None, artifacts: list[CompressedObservation]
) -> tuple[str, Observation | None]:
    if policy is None:
        return tool_content(result), None
    done = compress_observation(
        result,
        threshold_bytes=policy.threshold_bytes,
        summarizer=policy.summarizer,
        max_chars=policy.summary_chars,
    )
    observation = done.observation
    if not done.needs_artifact:
        return tool_content(result), None
    artifacts.append(done)
    content = (
        f"{observation['summary']}\n[full result stored as artifact "
        f"{observation['artifact_id']}: {observation['size']} bytes, "
        f"{observation['media_type']}]"
    )
    return content, observation


def finish(
    step: Step,
    outcomes: list[tuple[StepCall, CallOutcome]],
    observations: ObservationPolicy | None,
    artifacts: list[CompressedObservation],
) -> dict[str, Any]:
    """The node's state update for ``outcomes``; its ``step_completed`` event joins the
    step's pending ones, and the results to store as artifacts join ``artifacts``."""
    messages: list[BaseMessage] = []
    records: dict[str, StepRecord] = {}
    committed: list[str] = []
    signatures: list[str] = []
    for item, outcome in outcomes:
        record, message = _settle(item, outcome, observations, artifacts)
        records[record["tool_call_id"]] = record
        if message is not None:
            messages.append(message)
            if item.ctx.spec is not None and outcome.failure is None:
                # A caught repeat has no entry of its own: the effect is the earlier one.
                committed.append(outcome.repeat_of or item.ctx.key)
        elif outcome.failure is not None:
            previous = item.record.get("failure") or {}
            same_as_before = (previous.get("kind"), previous.get("error_type")) == (
                outcome.failure.kind.value,
                outcome.failure.error_type,
            ) and item.record.get("using") == item.ctx.tool
            # A signature counts once per tool call: retries of one step are bounded by
            # the policy; the same failure across *new* calls is what a stuck loop is.
            if not same_as_before:
                failure = outcome.failure
                signature = failure_signature(item.ctx.tool, failure.kind, failure.error_type)
                signatures.append(f"{signature}|{args_digest(item.ctx.args)[:16]}")
    observed = [_observed(r, o) for (_, o), r in zip(outcomes, records.values(), strict=True)]
    step.pending.append(step.ctx.event(EventKind.STEP_COMPLETED, observations=observed))
    update: dict[str, Any] = {"messages": messages, "steps": records}
    flow: dict[str, Any] = {"committed": committed} if committed else {}
    if signatures:
        # Counted per thread: the same failure again and again is a stuck loop.
        counts = Counter(step.signatures_seen)
        counts.update(signatures)
        flow["signatures"] = dict(counts)
    if flow:
        update["flow"] = flow
    return update


def _observed(record: StepRecord, outcome: CallOutcome) -> dict[str, Any]:
    """One call as its ``step_completed`` event reports it."""
    ok = record["status"] == "closed" and not record.get("failure")
    summary = record.get("result") or (record.get("failure") or {}).get("message", "")
    return {
        "tool": record["using"],
        "tool_call_id": record["tool_call_id"],
        "status": "ok" if ok else "failed",
        "replayed": outcome.replayed,
        "summary": summary[:STEP_RESULT_CHARS],
    }


def _decision_logged(events: Sequence[Event], ai: AIMessage) -> bool:
    """Whether ``events`` hold the ``llm_decided`` of ``ai``'s tool calls (by their ids)."""
    ids = [call["id"] for call in ai.tool_calls]
    for event in events:
        calls = event.payload.get("tool_calls") if event.kind is EventKind.LLM_DECIDED else None
        if isinstance(calls, list) and [c.get("id") for c in calls] == ids:
            return True
    return False
