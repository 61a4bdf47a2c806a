"""The executor ("act") node: runs the model's tool calls, side effects through the ledger.

For every pending tool call of the last ``AIMessage`` it runs the ledger protocol of
:mod:`taskpilots_graph.engine._protocol`: a side-effecting tool is intended durably before it
runs and committed after; on a re-run (retry, resume after a crash) the ledger decides
whether to return the recorded result, ask the pre-check, execute again, or stop with
:class:`~taskpilots_graph.ledger.SideEffectUncertain`.

It also *observes*: a successful call becomes a ``ToolMessage``; a failed one is classified
and recorded in its step record only (no message yet), for the recovery router to decide.
Calls already answered are never run again, so a retry re-runs that step only. The
checkpoint LangGraph writes after this node is the recovery anchor.

Durable writes: a side effect costs at most two (intent, commit), each carrying its events;
an idempotent one under a stored step writes no intent, and the commit of an idempotent or
pre-checked one rides its task's writes (:func:`~taskpilots_graph.engine._protocol.writes_intent`).
The events of pure tools and of the step wait for the thread's next durable write.

Every side effect is guarded, as in ``RecoveryMiddleware``, by the run's thread lease and a
``lock=`` tool's business lock (:mod:`taskpilots_graph.engine._locks`), with the lease
backend named (``leases=``) or else the checkpointer's own database; a live intent found
under a new call's key is waited for, never reconciled (:mod:`taskpilots_graph.engine._await`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolCall, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool

from taskpilots_graph import _clock
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.compression import CompressedObservation, Observation, compress_observation
from taskpilots_graph.drift import placeholder, unserialisable
from taskpilots_graph.engine import AsyncDriver, CallContext, CallOutcome, Driver, call_context
from taskpilots_graph.engine._drive import LeaseOwner
from taskpilots_graph.engine._protocol import run_call
from taskpilots_graph.engine._records import SUMMARY_CHARS
from taskpilots_graph.engine._recovery import failure_signature
from taskpilots_graph.engine._requests import RunTool, latest_successes
from taskpilots_graph.errors import ConfigurationError, ResultDrifted
from taskpilots_graph.events import Event, EventKind, EventRecord
from taskpilots_graph.failures import classify, failure_payload
from taskpilots_graph.leases import LeaseBackend
from taskpilots_graph.ledger import SideEffectUncertain, args_digest
from taskpilots_graph.nodes._context import (
    RunContext,
    astored_input,
    awaits_input,
    dump_message,
    messages_digest,
    run_context,
    stored_input,
)
from taskpilots_graph.nodes.think import resume_marker
from taskpilots_graph.policy import ToolPolicy, validate_policies
from taskpilots_graph.state import StepRecord
from taskpilots_graph.tools import SideEffectTool, check_args, spec_of
from taskpilots_graph.window import ObservationPolicy

__all__ = [
    "RecoveryExecutor",
    "error_message",
    "pending_calls",
    "tool_content",
]


STEP_RESULT_CHARS = 120
"""Bound on the result kept in a step record and in its ``step_completed`` event: the
model saw the whole (or summarized) result, and ``tool_succeeded`` keeps a longer excerpt."""


def pending_calls(messages: Sequence[BaseMessage]) -> tuple[AIMessage | None, list[ToolCall]]:
    """The last model message with tool calls, and those of its calls not answered yet."""
    answered: set[str] = set()
    for message in reversed(messages):
        if isinstance(message, ToolMessage):
            answered.add(message.tool_call_id)
        elif isinstance(message, AIMessage):
            if not message.tool_calls:
                return None, []
            return message, [c for c in message.tool_calls if c["id"] not in answered]
    return None, []


@dataclass
class _Call:
    call: ToolCall
    tool: BaseTool | None
    ctx: CallContext
    record: StepRecord


@dataclass
class _Step:
    """One execution of the node: its calls and the events waiting for the next write."""

    ctx: RunContext
    ai: AIMessage
    calls: list[_Call]
    first_time: bool
    signatures_seen: Mapping[str, int]
    pending: list[EventRecord] = field(default_factory=list)
    replayed: bool = False  # some call may have run before: compare results (drift)

    def stored(self, ctx: RunContext) -> None:
        """Continue with ``ctx``: once its input checkpoint is on disk, the step acts as
        under ``durability="sync"``."""
        self.ctx = ctx
        if ctx.input_stored:
            for item in self.calls:
                item.ctx = replace(item.ctx, step_durable=True)

    def take_pending(self) -> list[EventRecord]:
        pending, self.pending = self.pending, []
        return pending


def tool_content(result: Any) -> str:
    """A tool result as ``ToolMessage`` content: text as is, anything else as JSON."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, default=str, ensure_ascii=False)
    except Exception:  # cyclic, or a str() that raises: say so rather than fail the step
        why = unserialisable(result)
        return placeholder(result, why or "it cannot be encoded as JSON")


def error_message(call: ToolCall, text: str) -> ToolMessage:
    """The error answer to a tool call, as the model will see it."""
    return ToolMessage(
        content=text, tool_call_id=call["id"] or "", name=call["name"], status="error"
    )


class RecoveryExecutor(LeaseOwner):
    """The act node: use it in a ``StateGraph`` with the channels of ``RecoveryState``.

    Args:
        tools: The tools the model may call (and their fallbacks); ``@side_effect`` tools go
            through the ledger.
        checkpointer: The recovery checkpointer the graph is compiled with.
        policies: Recovery policies by tool name; others use ``default_policy``.
        default_policy: The policy of tools without one of their own.
        leases: Lease backend for thread leases (held by ``tp.run`` / ``tp.resume`` / ...,
            checked here before every side effect) and business locks (``lock=`` tools);
            the checkpointer's own database when omitted.
        lease_ttl: TTL in seconds of the business locks taken here and of the thread
            leases the runner takes for this graph; also the longest a call waits for a
            business lock held elsewhere, or for another runner's live intent.
        observations: How results enter the state: large ones become an artifact plus a
            summary (``None``: always whole).
        memory_window: Removed: the state keeps every message, and the context budget is
            the think node's (``ThinkNode(memory_window=...)``); anything but ``None``
            raises ``ConfigurationError``.
        record_all_decisions: Record every model decision before acting on it, not only
            those that drive side effects while the checkpoint may not be durable. Needed
            when checkpoints are skipped (the ``milestones`` density): a replayed step then
            repeats the same decision.
    """

    def __init__(
        self,
        tools: Sequence[BaseTool],
        *,
        checkpointer: RecoveryAPI,
        policies: Mapping[str, ToolPolicy] | None = None,
        default_policy: ToolPolicy | None = None,
        leases: LeaseBackend | None = None,
        lease_ttl: float = 30.0,
        observations: ObservationPolicy | None = None,
        memory_window: None = None,
        record_all_decisions: bool = False,
    ) -> None:
        if not isinstance(checkpointer, RecoveryAPI):
            raise ConfigurationError(
                "the recovery executor needs a RecoveryCheckpointer or "
                f"AsyncRecoveryCheckpointer, got {type(checkpointer).__name__}"
            )
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ConfigurationError("tool names must be unique")
        self.checkpointer = checkpointer
        self.policies = validate_policies(policies, self.tools)
        self.default_policy = default_policy or ToolPolicy()
        self._set_leases(leases, lease_ttl)
        if observations is not None and not isinstance(observations, ObservationPolicy):
            raise ConfigurationError("observations must be an ObservationPolicy or None")
        if memory_window is not None:
            raise ConfigurationError(
                "RecoveryExecutor(memory_window=...) was removed: the state keeps every "
                "message; give the context budget to the model's node instead, "
                "ThinkNode(memory_window=MemoryWindow(max_tokens=N))"
            )
        self.observations = observations
        self.record_all_decisions = bool(record_all_decisions)

    def policy(self, tool: str) -> ToolPolicy:
        """The policy that applies to ``tool``."""
        return self.policies.get(tool, self.default_policy)

    # -- shared preparation and completion --------------------------------------------------

    def _prepare(self, state: Mapping[str, Any], config: RunnableConfig) -> _Step | None:
        ai, calls = pending_calls(state["messages"])
        if ai is None or not calls:
            return None
        ctx = run_context(config)
        steps: Mapping[str, StepRecord] = state.get("steps") or {}
        now = _clock.now()
        prepared = []
        for call in calls:
            record: StepRecord = dict(steps.get(call["id"] or "", {}))  # type: ignore[assignment]
            retry_at = record.get("retry_at")
            if record.get("status") == "awaiting_human" or (retry_at and retry_at > now):
                continue  # not due: the router or a person decides when it runs
            using = record.get("using") or call["name"]
            tool = self.tools.get(using)
            spec = spec_of(tool) if tool is not None else None
            call_ctx = call_context(
                thread_id=ctx.thread_id,
                checkpoint_ns=ctx.graph_ns,
                tool=using,
                args=record.get("args") or call["args"],  # a person may have edited them
                tool_call_id=call["id"],
                spec=spec,
                policy=self.policy(using),
                attempt=int(record.get("attempts", 0)) + 1,
                # Under "milestones" the checkpoint before the step may be held, not stored.
                step_durable=ctx.input_stored and not self.record_all_decisions,
            )
            prepared.append(_Call(call, tool, call_ctx, record))
        if not prepared:
            return None
        first_time = not any(c["id"] in steps for c in ai.tool_calls)
        seen = (state.get("flow") or {}).get("signatures", {})
        step = _Step(ctx, ai, prepared, first_time, dict(seen))
        # A call may have run before when its step ran before (a retry), or when this run
        # continues one that stopped before the model was asked again (a replayed step).
        step.replayed = resume_marker(state, config) is not None or any(
            c.record.get("calls", 0) > 0 for c in prepared
        )
        if first_time:
            step.pending.append(
                ctx.event(
                    EventKind.LLM_DECIDED,
                    tool_calls=[
                        {"name": c["name"], "id": c["id"], "args": c["args"]} for c in ai.tool_calls
                    ],
                    content=str(ai.content)[:SUMMARY_CHARS],
                )
            )
        return step

    @staticmethod
    def _attach_previous(step: _Step, events: Sequence[Event]) -> None:
        """Give each call the ``tool_succeeded`` payload of its latest earlier execution;
        keep the step's ``llm_decided`` out of the log when an earlier execution logged it
        (a crash after the decision was logged: the step runs again, the model did not)."""
        if step.first_time and _decision_logged(events, step.ai):
            step.pending[:] = [e for e in step.pending if e.kind is not EventKind.LLM_DECIDED]
        latest = latest_successes(events)  # one read for the whole step
        for item in step.calls:
            if (found := latest.get((item.ctx.key, item.ctx.tool_call_id))) is not None:
                item.ctx = replace(item.ctx, previous=found)

    def _awaits_input(self, step: _Step) -> bool:
        """Whether the step should wait for its input checkpoint before acting: it has a
        side effect, and that checkpoint is being written in the background (not held back
        by a density, where the decision is recorded anyway)."""
        return not self.record_all_decisions and awaits_input(step.ctx) and _has_side_effect(step)

    def _decision_record(
        self, state: Mapping[str, Any], step: _Step
    ) -> tuple[str, str, str, str] | None:
        """(thread, namespace, input digest, message) of the decision to record, if any.

        With durability "sync" the checkpoint holding the model's message is on disk before
        this node runs. Otherwise it may not be, and a crash would make the model decide
        again with new tool-call ids (new keys): the decision is recorded so that the think
        node replays it instead. When checkpoints are skipped (``record_all_decisions``),
        every decision is recorded, so that a replayed step repeats the same calls.

        A decision that leads to a side effect need only be on disk before the effect, so
        the drivers defer it into the ledger intent's transaction; others are written at once.
        """
        if not step.first_time:
            return None
        if not self.record_all_decisions and (step.ctx.input_stored or not _has_side_effect(step)):
            return None
        digest = messages_digest(_before(state["messages"], step.ai))
        return step.ctx.thread_id, step.ctx.graph_ns, digest, dump_message(step.ai)

    def _settle(
        self, item: _Call, outcome: CallOutcome, artifacts: list[CompressedObservation]
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
            content, observation = self._observe(outcome.result, artifacts)
            base.update(
                {"status": "closed", "failure": None, "result": content[:STEP_RESULT_CHARS]}
            )
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
        self, result: Any, artifacts: list[CompressedObservation]
    ) -> tuple[str, Observation | None]:
        policy = self.observations
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

    def _finish(
        self,
        step: _Step,
        outcomes: list[tuple[_Call, CallOutcome]],
        artifacts: list[CompressedObservation],
    ) -> dict[str, Any]:
        messages: list[BaseMessage] = []
        records: dict[str, StepRecord] = {}
        committed: list[str] = []
        signatures: list[str] = []
        for item, outcome in outcomes:
            record, message = self._settle(item, outcome, artifacts)
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
        step.pending.append(
            step.ctx.event(
                EventKind.STEP_COMPLETED,
                observations=[
                    {
                        "tool": r["using"],
                        "tool_call_id": r["tool_call_id"],
                        "status": "ok"
                        if r["status"] == "closed" and not r.get("failure")
                        else "failed",
                        "replayed": o.replayed,
                        "summary": (r.get("result") or (r.get("failure") or {}).get("message", ""))[
                            :STEP_RESULT_CHARS
                        ],
                    }
                    for (_, o), r in zip(outcomes, records.values(), strict=True)
                ],
            )
        )
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

    # -- sync driver -------------------------------------------------------------------------

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Run the pending calls synchronously."""
        if (step := self._prepare(state, config)) is None:
            return {}
        cp = self.checkpointer
        if self._awaits_input(step):
            step.stored(stored_input(step.ctx, cp))
        if (decision := self._decision_record(state, step)) is not None:
            (cp.defer_decision if _has_side_effect(step) else cp.record_decision)(*decision)
        if step.replayed:
            self._attach_previous(step, cp.events(step.ctx.thread_id))
        try:
            outcomes = [(item, self._drive(step, item, config)) for item in step.calls]
            artifacts: list[CompressedObservation] = []
            update = self._finish(step, outcomes, artifacts)
            for done in artifacts:
                media_type = done.observation["media_type"]
                cp.put_artifact(step.ctx.thread_id, done.payload or b"", media_type=media_type)
        except BaseException:
            cp.append_records(step.take_pending(), flush=step.ctx.thread_id)
            raise
        # Pure-tool and step events ride along with the thread's next durable write.
        cp.defer_records(step.take_pending())
        return update

    def _drive(self, step: _Step, item: _Call, config: RunnableConfig) -> CallOutcome:
        if item.tool is None:
            return CallOutcome()  # answered "unknown tool" by _settle

        driver = Driver(
            self.checkpointer,
            item.ctx.thread_id,
            self.lease_backend,
            self.lease_ttl,
            lambda _: _target(item.tool).invoke(dict(item.ctx.args), config),
            check_args=lambda args: check_args(_target(item.tool), args),
            pending=step.pending,
        )
        try:
            return driver.drive(run_call(item.ctx))
        except SideEffectUncertain as exc:
            return _uncertain(exc)

    # -- async driver ------------------------------------------------------------------------

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Run the pending calls asynchronously."""
        if (step := self._prepare(state, config)) is None:
            return {}
        cp = self.checkpointer
        if self._awaits_input(step):
            step.stored(await astored_input(step.ctx, cp))
        if (decision := self._decision_record(state, step)) is not None:
            if _has_side_effect(step):
                cp.defer_decision(*decision)
            else:
                await cp.arecord_decision(*decision)
        if step.replayed:
            self._attach_previous(step, await cp.aevents(step.ctx.thread_id))
        try:
            outcomes = [(item, await self._adrive(step, item, config)) for item in step.calls]
            artifacts: list[CompressedObservation] = []
            update = self._finish(step, outcomes, artifacts)
            for done in artifacts:
                media_type = done.observation["media_type"]
                await cp.aput_artifact(
                    step.ctx.thread_id, done.payload or b"", media_type=media_type
                )
        except BaseException:
            await cp.aappend_records(step.take_pending(), flush=step.ctx.thread_id)
            raise
        cp.defer_records(step.take_pending())
        return update

    async def _adrive(self, step: _Step, item: _Call, config: RunnableConfig) -> CallOutcome:
        if item.tool is None:
            return CallOutcome()

        async def run_tool(request: RunTool) -> Any:
            return await _target(item.tool).ainvoke(dict(item.ctx.args), config)

        driver = AsyncDriver(
            self.checkpointer,
            item.ctx.thread_id,
            self.alease_backend,
            self.lease_ttl,
            run_tool,
            check_args=lambda args: check_args(_target(item.tool), args),
            pending=step.pending,
        )
        try:
            return await driver.drive(run_call(item.ctx))
        except SideEffectUncertain as exc:
            return _uncertain(exc)


def _uncertain(exc: SideEffectUncertain) -> CallOutcome:
    # Not a crash of the run: a step whose effect nobody can confirm. The router hands it to
    # a person; the other calls of the step still run.
    return CallOutcome(error=exc, failure=classify(exc))


def _decision_logged(events: Sequence[Event], ai: AIMessage) -> bool:
    """Whether ``events`` hold the ``llm_decided`` of ``ai``'s tool calls (by their ids)."""
    ids = [call["id"] for call in ai.tool_calls]
    for event in events:
        calls = event.payload.get("tool_calls") if event.kind is EventKind.LLM_DECIDED else None
        if isinstance(calls, list) and [c.get("id") for c in calls] == ids:
            return True
    return False


def _has_side_effect(step: _Step) -> bool:
    return any(c.ctx.spec is not None for c in step.calls)


def _before(messages: Sequence[BaseMessage], ai: AIMessage) -> list[BaseMessage]:
    """The conversation the model saw when it produced ``ai``."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index] is ai:
            return list(messages[:index])
    return list(messages)


def _target(tool: BaseTool | None) -> BaseTool:
    assert tool is not None, "unknown tools are answered without running"
    # Call the wrapped tool itself, so callbacks see one tool run, not two nested ones.
    return tool.tool if isinstance(tool, SideEffectTool) else tool
