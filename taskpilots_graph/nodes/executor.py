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

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolCall, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool

from taskpilots_graph import _clock
from taskpilots_graph._twins import Steps, arun_steps, io, run_steps
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.compression import CompressedObservation
from taskpilots_graph.engine import CallOutcome, call_context, run_call
from taskpilots_graph.engine._drive import LeaseOwner
from taskpilots_graph.engine._requests import RunTool
from taskpilots_graph.engine._run import decided
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.failures import classify
from taskpilots_graph.leases import LeaseBackend
from taskpilots_graph.ledger import SideEffectUncertain
from taskpilots_graph.nodes._context import awaits_input, decision_record, run_context, stored_input
from taskpilots_graph.nodes._step import Step, StepCall, finish
from taskpilots_graph.nodes.think import resume_marker
from taskpilots_graph.policy import ToolPolicy, validate_policies
from taskpilots_graph.state import StepRecord
from taskpilots_graph.tools import SideEffectTool, check_args, spec_of
from taskpilots_graph.window import ObservationPolicy

__all__ = ["RecoveryExecutor", "pending_calls"]


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

    # -- the step: its calls, and what is decided before they run ----------------------------

    def _prepare(self, state: Mapping[str, Any], config: RunnableConfig) -> Step | None:
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
            prepared.append(StepCall(call, tool, call_ctx, record))
        if not prepared:
            return None
        first_time = not any(c["id"] in steps for c in ai.tool_calls)
        seen = (state.get("flow") or {}).get("signatures", {})
        step = Step(ctx, ai, prepared, first_time, dict(seen))
        # A call may have run before when its step ran before (a retry), or when this run
        # continues one that stopped before the model was asked again (a replayed step).
        step.replayed = resume_marker(state, config) is not None or any(
            c.record.get("calls", 0) > 0 for c in prepared
        )
        if first_time:
            step.pending.append(decided(ctx.thread_id, ctx.graph_ns, ai))
        return step

    def _awaits_input(self, step: Step) -> bool:
        """Whether the step should wait for its input checkpoint before acting: it has a
        side effect, and that checkpoint is being written in the background (not held back
        by a density, where the decision is recorded anyway)."""
        return not self.record_all_decisions and awaits_input(step.ctx) and step.has_side_effect

    def _decision_record(
        self, state: Mapping[str, Any], step: Step
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
        if not self.record_all_decisions and (step.ctx.input_stored or not step.has_side_effect):
            return None
        return decision_record(step.ctx, state["messages"], step.ai.tool_calls[0]["id"])

    # -- the drivers: one body for both forms ----------------------------------------------

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Run the pending calls synchronously."""
        return run_steps(self._invoke(state, config))

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Run the pending calls asynchronously."""
        return await arun_steps(self._invoke(state, config))

    def _invoke(self, state: dict[str, Any], config: RunnableConfig) -> Steps[dict[str, Any]]:
        if (step := self._prepare(state, config)) is None:
            return {}
        cp = self.checkpointer
        if self._awaits_input(step):
            step.stored((yield from stored_input(step.ctx, cp)))
        if (decision := self._decision_record(state, step)) is not None:
            if step.has_side_effect:
                cp.defer_decision(*decision)
            else:
                yield io(cp, "record_decision", *decision)
        if step.replayed:
            step.attach_previous((yield io(cp, "events", step.ctx.thread_id)))
        # Pure-tool and step events ride along with the thread's next durable write.
        return (yield from self._settled(step.ctx.thread_id, step.pending, self._act(step, config)))

    def _act(self, step: Step, config: RunnableConfig) -> Steps[dict[str, Any]]:
        outcomes = []
        for item in step.calls:
            outcomes.append((item, (yield from self._drive(step, item, config))))
        artifacts: list[CompressedObservation] = []
        update = finish(step, outcomes, self.observations, artifacts)
        for done in artifacts:
            payload, media_type = done.payload or b"", done.observation["media_type"]
            thread_id = step.ctx.thread_id
            yield io(self.checkpointer, "put_artifact", thread_id, payload, media_type=media_type)
        return update

    def _drive(self, step: Step, item: StepCall, config: RunnableConfig) -> Steps[CallOutcome]:
        if item.tool is None:
            return CallOutcome()  # answered "unknown tool" by finish
        # Call the wrapped tool itself, so callbacks see one tool run, not two nested ones.
        tool = item.tool.tool if isinstance(item.tool, SideEffectTool) else item.tool

        def run_tool(request: RunTool) -> Steps[Any]:
            return (yield io(tool, "invoke", dict(item.ctx.args), config))

        gen, check = run_call(item.ctx), partial(check_args, tool)
        try:
            return (yield from self._driven(item.ctx.thread_id, gen, run_tool, step.pending, check))
        except SideEffectUncertain as exc:
            # Not a crash of the run: a step whose effect nobody can confirm. The router
            # hands it to a person; the other calls of the step still run.
            return CallOutcome(error=exc, failure=classify(exc))
