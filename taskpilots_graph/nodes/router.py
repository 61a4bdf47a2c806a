"""The recovery router and the nodes it routes to: wait and fail.

After the act node, every call that failed has a step record with its classified failure
and no answer yet. The router applies :func:`~taskpilots_graph.recovery.decide_recovery` to
each one and moves the flow: retry that step only (through **wait**, which sleeps a short
backoff in-process and ends the run in ``waiting_tool`` for a long one), degrade to a
fallback, report the error to the model, ask a person (**takeover**), undo committed effects
(**compensate**) or **fail** the run. Every transition is an event.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.types import Command

from taskpilots_graph import _clock
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.engine._records import error_message
from taskpilots_graph.engine._recovery import decide_next, failure_signature, transition_events
from taskpilots_graph.engine._run import run_finished
from taskpilots_graph.errors import ToolWaiting
from taskpilots_graph.events import EventKind, EventRecord
from taskpilots_graph.failures import FailureKind
from taskpilots_graph.nodes._context import run_context
from taskpilots_graph.nodes.executor import RecoveryExecutor, pending_calls
from taskpilots_graph.recovery import Action, RecoveryDecision
from taskpilots_graph.state import StepRecord

__all__ = ["RecoveryRouter", "WaitNode", "describe", "fail_run"]


def describe(failure: Mapping[str, Any]) -> str:
    """A failure as the model reads it: ``Error: <Type>: <message>``."""
    error_type = str(failure.get("error_type") or "Error").rsplit(".", 1)[-1]
    return f"Error: {error_type}: {failure.get('message', '')}"


def _signature_count(record: StepRecord, signatures: Mapping[str, int]) -> int:
    failure = record.get("failure") or {}
    signature = failure_signature(
        record.get("using"), failure.get("kind"), failure.get("error_type")
    )
    prefix = signature + "|"  # the executor counts it per argument digest
    return max((n for sig, n in signatures.items() if sig.startswith(prefix)), default=1)


class RecoveryRouter:
    """Decides, per failed step, what happens next (see :mod:`taskpilots_graph.recovery`).

    Args:
        executor: The act node, whose tools and policies the router uses.
        checkpointer: The recovery checkpointer (for transition events).
        rng: Source of backoff jitter (tests pass a seeded one).
    """

    def __init__(
        self,
        executor: RecoveryExecutor,
        *,
        checkpointer: RecoveryAPI,
        rng: random.Random | None = None,
    ) -> None:
        self.executor = executor
        self.checkpointer = checkpointer
        self.rng = rng or random.Random()

    def _decide(
        self, state: Mapping[str, Any], config: RunnableConfig
    ) -> tuple[Command[str], list[EventRecord]]:
        ctx = run_context(config)
        now = _clock.now()
        steps: Mapping[str, StepRecord] = state.get("steps") or {}
        signatures = (state.get("flow") or {}).get("signatures", {})
        _, calls = pending_calls(state["messages"])
        updates: dict[str, StepRecord] = {}
        messages: list[ToolMessage] = []
        events: list[EventRecord] = []
        actions: set[Action] = set()
        reasons: list[str] = []
        for call in calls:
            record = steps.get(call["id"] or "")
            if record is None or record.get("status") != "waiting_tool":
                continue
            if record.get("retry_at") is not None:
                actions.add(Action.RETRY)  # already scheduled by an earlier pass
                continue
            failure = record.get("failure") or {}
            using = record.get("using") or call["name"]
            decision, tried = decide_next(
                self.executor.policy,
                tool=call["name"],
                using=using,
                tried=record.get("tried", []),
                kind=FailureKind(failure.get("kind", FailureKind.TRANSIENT)),
                attempts=record.get("attempts", 1),
                first_failed_at=record.get("first_failed_at") or now,
                now=now,
                retry_after=failure.get("retry_after"),
                signature_count=_signature_count(record, signatures),
                rng=self.rng,
            )
            actions.add(decision.action)
            update, message = self._apply(tried, decision, failure)
            updates[call["id"] or ""] = update
            if decision.action is not Action.RETRY:
                reasons.append(f"{using}: {decision.reason}")
            if message is not None:
                messages.append(error_message(call, message))
            base = {
                "tool": call["name"],
                "using": using,
                "reason": decision.reason,
                "failure_kind": failure.get("kind"),
            }
            events += transition_events(ctx.thread_id, ctx.graph_ns, decision, **base)
            if decision.action is Action.TAKEOVER:
                events.append(ctx.event(EventKind.TAKEOVER_REQUESTED, **base))
        return self._route(state, updates, messages, actions, reasons, now), events

    @staticmethod
    def _apply(
        tried: list[str], decision: RecoveryDecision, failure: Mapping[str, Any]
    ) -> tuple[StepRecord, str | None]:
        action = decision.action
        if action is Action.RETRY:
            return {"status": "waiting_tool", "retry_at": decision.retry_at}, None
        if action is Action.DEGRADE:
            assert decision.fallback is not None
            return {
                "status": "degraded",
                "using": decision.fallback,
                "tried": tried,
                "attempts": 0,
                "first_failed_at": None,
                "retry_at": None,
            }, None
        if action is Action.REPORT:
            return {"status": "closed"}, f"{describe(failure)} ({decision.reason})"
        return {"status": "awaiting_human" if action is Action.TAKEOVER else "closed"}, None

    def _route(
        self,
        state: Mapping[str, Any],
        updates: dict[str, StepRecord],
        messages: list[ToolMessage],
        actions: set[Action],
        reasons: list[str],
        now: float,
    ) -> Command[str]:
        update: dict[str, Any] = {"steps": updates, "messages": messages}
        reason = "; ".join(reasons) or None
        # Strongest first: one step that must fail the run wins over one that could be retried.
        for action, node, stage in (
            (Action.FAIL, "fail", "failed"),
            (Action.COMPENSATE, "compensate", "compensating"),
            (Action.TAKEOVER, "takeover", "awaiting_human"),
        ):
            if action in actions:
                update["flow"] = {"stage": stage, "reason": reason, "takeover": node == "takeover"}
                return Command(goto=node, update=update)
        if Action.RETRY in actions:
            merged = {**(state.get("steps") or {}), **updates}
            due = min(
                (
                    r["retry_at"]
                    for r in merged.values()
                    if r.get("status") == "waiting_tool" and r.get("retry_at")
                ),
                default=now,
            )
            update["flow"] = {"stage": "waiting_tool", "retry_at": due, "reason": reason}
            return Command(goto="wait", update=update)
        update["flow"] = {"stage": "running", "retry_at": None}
        return Command(goto="act" if Action.DEGRADE in actions else "think", update=update)

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Route synchronously."""
        command, events = self._decide(state, config)
        self.checkpointer.append_records(events)
        return command

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Route asynchronously."""
        command, events = self._decide(state, config)
        await self.checkpointer.aappend_records(events)
        return command


class WaitNode:
    """Waits until the earliest retry is due, then goes back to the act node.

    A wait up to the policy's ``max_in_process_wait`` sleeps here (with the library clock,
    which tests replace). A longer one ends the run with :class:`ToolWaiting`; the state
    already says ``waiting_tool`` and ``retry_at``, and ``resume`` after that time continues
    here. It never busy-loops.
    """

    def __init__(self, executor: RecoveryExecutor) -> None:
        self.executor = executor

    def _plan(self, state: Mapping[str, Any], config: RunnableConfig) -> tuple[float, Command[str]]:
        ctx = run_context(config)
        steps: Mapping[str, StepRecord] = state.get("steps") or {}
        waiting = [
            r for r in steps.values() if r.get("status") == "waiting_tool" and r.get("retry_at")
        ]
        now = _clock.now()
        if not waiting:
            return 0.0, Command(goto="act", update={"flow": {"stage": "running", "retry_at": None}})
        due = min(float(r["retry_at"] or now) for r in waiting)
        limit = min(
            self.executor.policy(r.get("using") or r.get("tool", "")).max_in_process_wait
            for r in waiting
        )
        remaining = due - now
        if remaining > limit:
            self.executor.checkpointer.append_records([], flush=ctx.thread_id)
            raise ToolWaiting(ctx.thread_id, due)
        # Clear the schedule of every step that is due by then, so act runs them.
        cleared = {
            r["tool_call_id"]: {"retry_at": None}
            for r in waiting
            if float(r["retry_at"] or 0) <= due
        }
        return remaining, Command(
            goto="act", update={"steps": cleared, "flow": {"stage": "running", "retry_at": None}}
        )

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Wait synchronously."""
        remaining, command = self._plan(state, config)
        _clock.sleep(remaining)
        return command

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Wait asynchronously."""
        remaining, command = self._plan(state, config)
        await _clock.asleep(remaining)
        return command


def fail_run(checkpointer: RecoveryAPI) -> Any:
    """The fail node: answers open calls with errors and ends the run.

    The run ends ``failed``, or ``closed`` when compensation already closed it (a person
    abandoned it).
    """

    def build(
        state: Mapping[str, Any], config: RunnableConfig
    ) -> tuple[dict[str, Any], list[EventRecord]]:
        ctx = run_context(config)
        flow = state.get("flow") or {}
        reason = flow.get("reason") or "failed"
        stage = "closed" if flow.get("stage") == "closed" else "failed"
        steps: Mapping[str, StepRecord] = state.get("steps") or {}
        _, calls = pending_calls(state["messages"])
        messages = [
            error_message(
                c,
                f"{describe((steps.get(c['id'] or '') or {}).get('failure') or {})}; "
                f"the run {'was closed' if stage == 'closed' else 'failed'}: {reason}",
            )
            for c in calls
        ]
        events = [run_finished(ctx.thread_id, ctx.graph_ns, stage, reason=reason)]
        return {"messages": messages, "flow": {"stage": stage, "reason": reason}}, events

    def invoke(state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        update, events = build(state, config)
        checkpointer.append_records(events)
        return update

    async def ainvoke(state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        update, events = build(state, config)
        await checkpointer.aappend_records(events)
        return update

    return invoke, ainvoke
