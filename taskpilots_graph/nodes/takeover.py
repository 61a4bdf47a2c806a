"""The takeover node: stop, show a person the whole picture, and act on their decision.

It calls LangGraph's ``interrupt()`` with a :class:`~taskpilots_graph.takeover.TakeoverRequest`
(goal, done steps, committed and uncertain effects, the failure, and what each option would
trigger) and applies the validated :class:`~taskpilots_graph.takeover.Decision`:

* ``retry``: the step runs again under the same ledger key (an uncertain entry is released
  for exactly one more execution);
* ``skip``: the step is answered "skipped" and the model continues without it;
* ``provide_result``: the person's result is committed in the ledger with a manual proof;
* ``edit_args``: the step runs with the new arguments, hence under a new key;
* ``abandon``: committed effects are compensated in reverse order and the run is closed.
* ``accept`` (a drifted result only): the new result the tool returned is the step's result.

Everything before ``interrupt()`` only reads, so LangGraph re-running the node on resume is
harmless; ledger changes are compare-and-set and skipped when already applied, so a crash
after them cannot apply a decision twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.types import Command, interrupt

from taskpilots_graph._twins import Steps, arun_steps, io, run_steps
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.engine._records import error_message, tool_content
from taskpilots_graph.engine._takeover import decided_by, decision_recorded, ledger_move
from taskpilots_graph.errors import InvalidDecision
from taskpilots_graph.events import EventRecord
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus
from taskpilots_graph.nodes._context import RunContext, run_context
from taskpilots_graph.nodes.executor import pending_calls
from taskpilots_graph.state import StepRecord
from taskpilots_graph.takeover import Decision, TakeoverRequest, parse_decision
from taskpilots_graph.window import decisions_this_turn

__all__ = ["ABANDONED", "TakeoverNode", "build_request", "run_goal", "waiting_steps"]

ABANDONED = "abandoned by a person"
"""The flow reason of a run a person abandoned: compensated, then closed (not failed)."""

_SUMMARY = 300


def waiting_steps(state: Mapping[str, Any]) -> list[StepRecord]:
    """The open steps that wait on a person, in call order."""
    steps: Mapping[str, StepRecord] = state.get("steps") or {}
    _, calls = pending_calls(state["messages"])
    return [
        steps[c["id"] or ""]
        for c in calls
        if (steps.get(c["id"] or "") or {}).get("status") == "awaiting_human"
    ]


def run_goal(messages: Sequence[Any]) -> str:
    """The run's goal as a person is shown it: the last user message, cut."""
    human = next((m for m in reversed(messages) if isinstance(m, HumanMessage)), None)
    return str(human.content)[:_SUMMARY] if human is not None else ""


def build_request(
    state: Mapping[str, Any], thread_id: str, ledger: Sequence[LedgerEntry]
) -> TakeoverRequest:
    """The takeover request for a thread's current state (pure: state + ledger in)."""
    flow = state.get("flow") or {}
    waiting = waiting_steps(state)
    steps: Mapping[str, StepRecord] = state.get("steps") or {}
    done = [
        {"tool": r.get("using"), "args": r.get("args"), "result": r.get("result")}
        for r in steps.values()
        if r.get("status") == "closed" and not r.get("failure")
    ]
    committed = [
        {"key": e.key, "tool": e.tool} for e in ledger if e.status is LedgerStatus.COMMITTED
    ]
    uncertain = [
        {"key": e.key, "tool": e.tool, "args": dict(e.args)}
        for e in ledger
        if e.status is LedgerStatus.UNCERTAIN
    ]
    first = waiting[0] if waiting else {}
    tool = first.get("using") or first.get("tool") or "the step"
    key = first.get("key")
    undo = ", ".join(f"{c['tool']} ({c['key']})" for c in reversed(committed)) or "nothing"
    options = {
        "retry": f"calls {tool} again"
        + (f" with the same key {key}" if key else "")
        + f" (attempt {int(first.get('attempts', 0)) + 1})",
        "skip": f"continues without {tool}; the model is told it was skipped",
        "provide_result": f"records your result as {tool}'s result"
        + (" (committed in the ledger with a manual proof)" if key else "")
        + " and continues",
        "edit_args": f"calls {tool} with your arguments, under a new key",
        "abandon": f"undoes committed effects in reverse order ({undo}) and closes the run",
    }
    failure = dict(first.get("failure") or {}) or None
    if failure is not None:
        failure["attempts"] = first.get("attempts")
    drift = failure.pop("drift", None) if failure is not None else None
    if isinstance(drift, Mapping):  # what each answer to a drifted result triggers
        options = {
            "accept": f"keeps the new result of {tool} and continues with it",
            "retry": f"calls {tool} again and compares its answer with the new result",
            "skip": options["skip"],
            "provide_result": f"records your result as {tool}'s result and continues",
            "abandon": options["abandon"],
        }
        drift = {"tool": tool, "tool_call_id": first.get("tool_call_id"), **drift}
    return TakeoverRequest(
        thread_id=thread_id,
        goal=run_goal(state["messages"]),
        reason=flow.get("reason"),
        failure=failure,
        done_steps=done,
        committed_effects=committed,
        uncertain_effects=uncertain,
        pending=[
            {
                "tool_call_id": r.get("tool_call_id"),
                "tool": r.get("using") or r.get("tool"),
                "args": r.get("args"),
                "attempts": r.get("attempts"),
                "key": r.get("key"),
            }
            for r in waiting
        ],
        options=options,
        drift=dict(drift) if isinstance(drift, Mapping) else None,
    )


def _drifted(record: StepRecord) -> Mapping[str, Any] | None:
    drift = (record.get("failure") or {}).get("drift")
    return drift if isinstance(drift, Mapping) else None


def targets(state: Mapping[str, Any], decision: Decision) -> list[StepRecord]:
    """The waiting steps a decision applies to.

    Raises:
        InvalidDecision: For an unknown ``tool_call_id``, or a decision that names a single
            result or argument set while several steps wait.
    """
    waiting = waiting_steps(state)
    if decision.tool_call_id is not None:
        chosen = [r for r in waiting if r.get("tool_call_id") == decision.tool_call_id]
        if not chosen:
            ids = [r.get("tool_call_id") for r in waiting]
            raise InvalidDecision(
                f"no step {decision.tool_call_id!r} waits on a person; waiting: {ids}"
            )
        return _accept_fits(decision, chosen)
    if decision.action in ("provide_result", "edit_args") and len(waiting) > 1:
        raise InvalidDecision(f"{len(waiting)} steps wait; say which one with tool_call_id=...")
    return _accept_fits(decision, waiting)


def _accept_fits(decision: Decision, chosen: list[StepRecord]) -> list[StepRecord]:
    if decision.action == "accept" and not all(_drifted(r) for r in chosen):
        raise InvalidDecision(
            "accept keeps a drifted result; no waiting step has one (retry, skip, "
            "provide_result, edit_args or abandon)"
        )
    return chosen


class TakeoverNode:
    """Pauses the run on ``interrupt()`` until a person decides, then applies the decision."""

    def __init__(self, *, checkpointer: RecoveryAPI) -> None:
        self.checkpointer = checkpointer

    def _plan(
        self,
        state: Mapping[str, Any],
        ctx: RunContext,
        ledger: Sequence[LedgerEntry],
    ) -> tuple[Command[str], list[tuple[LedgerEntry, LedgerEntry]], list[EventRecord]]:
        """Ask a person (``interrupt()``); the command, ledger moves and event of the answer."""
        request = build_request(state, ctx.thread_id, ledger).model_dump(mode="json")
        decision = parse_decision(interrupt(request))
        chosen = targets(state, decision)
        by_key = {e.key: e for e in ledger}
        now = datetime.now(UTC)
        who = decided_by(decision)
        writes: list[tuple[LedgerEntry, LedgerEntry]] = []
        for record in chosen:
            entry = by_key.get(record.get("key") or "")
            moved = ledger_move(entry, decision, who, now) if entry is not None else None
            if entry is not None and moved is not None:
                writes.append((entry, moved))
        steps = [r.get("tool_call_id") for r in chosen]
        event = decision_recorded(ctx.thread_id, ctx.graph_ns, decision, who, steps)
        return _command(state, decision, chosen), writes, [event]

    def _answered(self, state: Mapping[str, Any], config: RunnableConfig) -> Steps[Command[str]]:
        """Ask, then apply the answer (the body of :meth:`invoke` and :meth:`ainvoke`)."""
        ctx = run_context(config)
        cp = self.checkpointer
        # The thread's entries, plus those of waiting steps recorded under a business key by
        # another thread (keys are global): the person must see the effect in question.
        ledger: list[LedgerEntry] = list((yield io(cp, "ledger", ctx.thread_id)))
        known = {e.key for e in ledger}
        for key in [k for r in waiting_steps(state) if (k := r.get("key")) and k not in known]:
            if entry := (yield io(cp, "ledger_entry", key)):
                ledger.append(entry)
        command, writes, events = self._plan(state, ctx, ledger)
        for before, after in writes:
            yield io(
                cp, "write_ledger", after, expect=(before.status, before.attempt), events=events
            )
            events = []  # the decision is logged with its first ledger change
        yield io(cp, "append_records", events)
        return command

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Ask, then apply the answer."""
        return run_steps(self._answered(state, config))

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Async form of :meth:`invoke`."""
        return await arun_steps(self._answered(state, config))


def _command(
    state: Mapping[str, Any], decision: Decision, chosen: list[StepRecord]
) -> Command[str]:
    # A decision buys a fresh step budget: what this user turn spent so far is set aside.
    user, used = decisions_this_turn(state["messages"], state.get("memory"))
    flow: dict[str, Any] = {
        "stage": "running",
        "takeover": False,
        "reason": None,
        "signatures": {},
        "budget_turn": user,
        "budget_from": used,
    }
    ids = [r.get("tool_call_id") or "" for r in chosen]
    action = decision.action
    if action == "abandon":
        closed_steps: dict[str, StepRecord] = {i: {"status": "closed"} for i in ids}
        return Command(
            goto="compensate",
            update={
                "steps": closed_steps,
                "flow": {"stage": "compensating", "reason": ABANDONED, "takeover": False},
            },
        )
    if action in ("retry", "edit_args"):
        reset: dict[str, StepRecord] = {}
        for call_id in ids:
            update: StepRecord = {
                "status": "running",
                "attempts": 0,
                "first_failed_at": None,
                "retry_at": None,
                "failure": None,
            }
            if action == "edit_args":
                update["args"] = dict(decision.args or {})
            reset[call_id] = update
        return Command(goto="act", update={"steps": reset, "flow": flow})
    _, calls = pending_calls(state["messages"])
    by_id = {c["id"]: c for c in calls}
    messages: list[ToolMessage] = []
    closed: dict[str, StepRecord] = {}
    committed: list[str] = []
    for call_id, record in zip(ids, chosen, strict=True):
        call = by_id[call_id]
        if action == "skip":
            messages.append(error_message(call, "Skipped by a person; do not call it again."))
            closed[call_id] = {"status": "closed", "result": "skipped by a person"}
            continue
        drift = _drifted(record) or {}
        # accept: the new result the tool returned, kept in the step until now.
        content = tool_content(drift.get("current") if action == "accept" else decision.result)
        messages.append(ToolMessage(content=content, tool_call_id=call_id, name=call["name"]))
        # A provided result is the step's result: the step counts as done.
        closed[call_id] = {"status": "closed", "failure": None, "result": content[:_SUMMARY]}
        if record.get("key"):
            committed.append(str(record["key"]))
    if committed:
        flow["committed"] = committed
    return Command(goto="think", update={"steps": closed, "messages": messages, "flow": flow})
