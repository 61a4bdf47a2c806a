"""``create_recovery_agent``, ``side_effect`` and ``resume`` end to end, on real databases.

A scripted chat model (deciding from the conversation, with a fresh random tool-call id per
decision, like a real model) drives the compiled agent against a real SQLite file or
PostgreSQL database; an in-process service records every effect so a repeat shows up.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from _slow_puts import slow_puts
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool, StructuredTool, tool
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Command, interrupt
from pydantic import Field

from taskpilots_graph import (
    AsyncRecoveryCheckpointer,
    ConfigurationError,
    Done,
    Event,
    EventKind,
    LedgerEntry,
    LedgerStatus,
    NotDone,
    PendingTakeover,
    RecoveryCheckpointer,
    aresume,
    create_recovery_agent,
    current_invocation,
    resume,
    side_effect,
)
from taskpilots_graph.errors import ThreadNotFound
from taskpilots_graph.ledger import PrecheckOutcome, args_digest, default_key
from taskpilots_graph.nodes._context import messages_digest
from taskpilots_graph.policy import ModelPolicy
from taskpilots_graph.tools import SideEffectTool, spec_of

GOAL = "look up customer c-7, then charge order o-1"
LOOKUP = ("lookup", {"customer": "c-7"})
CHARGE = ("charge", {"order": "o-1", "amount": 40})

Graph = CompiledStateGraph[Any, Any, Any, Any]


class SimulatedCrash(BaseException):
    """Stands in for the process dying: no ``except Exception`` on the way catches it."""


# --- backends ---------------------------------------------------------------------------------


# The backend fixtures (conn_string, cp) are in conftest.py.


# --- the scripted model and the simulated service ---------------------------------------------


class ScriptedModel(BaseChatModel):
    """Runs ``script`` (one list of tool calls per step), then answers.

    The step is the number of tool-calling decisions already in the conversation, so a
    resumed run continues where the conversation stands. ``fail_at`` maps the n-th question
    (1-based) to an exception to raise instead of answering.
    """

    script: list[list[tuple[str, dict[str, Any]]]]
    fail_at: dict[int, Any] = Field(default_factory=dict)
    asked: list[list[BaseMessage]] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "scripted-agent-test"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.asked.append(list(messages))
        if (error := self.fail_at.get(len(self.asked))) is not None:
            raise error
        step = sum(1 for m in messages if isinstance(m, AIMessage) and m.tool_calls)
        if step < len(self.script):
            calls = [
                {"name": name, "args": dict(args), "id": f"call_{uuid.uuid4().hex[:12]}"}
                for name, args in self.script[step]
            ]
            message = AIMessage("", tool_calls=calls)
        else:
            message = AIMessage(f"finished after {step} steps")
        return ChatResult(generations=[ChatGeneration(message=message)])

    def asked_with_goal_only(self) -> int:
        """How many times the model was asked to make its first decision."""
        return sum(1 for messages in self.asked if len(messages) == 1)


@dataclass
class Service:
    """In-process CRM and payment service; ``charges`` lists every charge performed."""

    charges: list[tuple[str, int]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    def tools(self) -> list[BaseTool]:
        @tool
        def lookup(customer: str) -> str:
            """Look up a customer."""
            return f"{customer}: gold"

        @side_effect(precheck=self.find)
        @tool
        def charge(order: str, amount: int) -> str:
            """Charge a customer's order."""
            self.keys.append(current_invocation().key)
            self.charges.append((order, amount))
            return f"receipt-{order}"

        return [lookup, charge]

    def find(self, key: str, args: dict[str, Any]) -> PrecheckOutcome:
        return Done(f"receipt-{args['order']}") if key in self.keys else NotDone()


def config(thread_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id}}


def goal() -> dict[str, Any]:
    return {"messages": [HumanMessage(GOAL)]}


def kinds(events: Sequence[Event]) -> list[str]:
    return [e.kind.value for e in events]


# --- (a) end to end ---------------------------------------------------------------------------


def test_run_logs_lifecycle_events_in_order(cp: RecoveryCheckpointer) -> None:
    """A two-step run logs started/decided/invoked/succeeded/step/.../finished, gapless."""
    service = Service()
    model = ScriptedModel(script=[[LOOKUP], [CHARGE]])
    create_recovery_agent(model, service.tools(), checkpointer=cp).invoke(goal(), config("t"))

    events = cp.events("t")
    assert kinds(events) == [
        "agent_started",
        "llm_decided",
        "tool_invoked",
        "tool_succeeded",
        "step_completed",
        "llm_decided",
        "tool_invoked",
        "tool_succeeded",
        "step_completed",
        "llm_decided",
        "agent_finished",
    ]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[0].payload["goal"] == GOAL
    assert events[-1].payload["answer"] == "finished after 2 steps"


def test_run_commits_ledger_entry_with_digest_and_timestamps(cp: RecoveryCheckpointer) -> None:
    """Only the side effect gets a ledger entry: committed, args digest, key, call id, times."""
    service = Service()
    model = ScriptedModel(script=[[LOOKUP], [CHARGE]])
    started = datetime.now(UTC)
    result = create_recovery_agent(model, service.tools(), checkpointer=cp).invoke(
        goal(), config("t")
    )
    finished = datetime.now(UTC)

    (entry,) = cp.ledger("t")
    call = result["messages"][3].tool_calls[0]
    assert entry.status is LedgerStatus.COMMITTED
    assert (entry.tool, dict(entry.args), entry.attempt) == ("charge", CHARGE[1], 1)
    assert entry.args_digest == args_digest(CHARGE[1])
    assert (entry.thread_id, entry.checkpoint_ns, entry.tool_call_id) == ("t", "", call["id"])
    assert entry.key == default_key(
        thread_id="t", checkpoint_ns="", tool_call_id=call["id"], tool="charge", args=CHARGE[1]
    )
    assert service.keys == [entry.key]
    assert entry.result == "receipt-o-1"
    slack = timedelta(milliseconds=1)  # times are stored as float epoch seconds
    assert started - slack <= entry.created_at <= entry.updated_at <= finished + slack
    (invoked,) = [e for e in cp.events("t") if e.kind is EventKind.TOOL_INVOKED][1:]
    assert (invoked.payload["key"], invoked.payload["attempt"]) == (entry.key, 1)


# --- (b) side_effect --------------------------------------------------------------------------


def _refund(order: str, amount: float, reason: str = "") -> str:
    """Refund an order through the payment provider."""
    return f"refunded {order}"


def test_side_effect_keeps_name_description_and_args_schema() -> None:
    """The wrapped tool looks exactly like the original to a model."""
    original = StructuredTool.from_function(_refund)
    wrapped = side_effect(original, idempotent=True)

    assert (wrapped.name, wrapped.description) == (original.name, original.description)
    assert (
        wrapped.tool_call_schema.model_json_schema()  # type: ignore[union-attr]
        == original.tool_call_schema.model_json_schema()  # type: ignore[union-attr]
    )
    assert wrapped.args == original.args


def test_side_effect_as_decorator_above_tool() -> None:
    """@side_effect(...) above @tool yields a SideEffectTool carrying the declaration."""

    def ticket_exists(key: str, args: dict[str, Any]) -> PrecheckOutcome:
        return NotDone()

    @side_effect(precheck=ticket_exists, key=lambda a: f"ticket:{a['subject']}")
    @tool
    def create_ticket(subject: str) -> str:
        """Open a help-desk ticket."""
        return f"ticket {subject}"

    assert isinstance(create_ticket, SideEffectTool)
    spec = spec_of(create_ticket)
    assert spec is not None
    assert spec.precheck is ticket_exists
    assert spec.key is not None
    assert spec.key({"subject": "late"}) == "ticket:late"
    # A direct call would perform the effect with nothing recording it: refused, with the fix.
    with pytest.raises(ConfigurationError, match=r"tp\.ToolNode\(tools\)"):
        create_ticket.invoke({"subject": "late"})


def test_side_effect_called_on_base_tool() -> None:
    """side_effect(tool, ...) wraps an existing BaseTool; the original is left undecorated."""
    original = StructuredTool.from_function(_refund)
    wrapped = side_effect(original, idempotent=True)

    assert isinstance(wrapped, SideEffectTool)
    assert spec_of(original) is None
    spec = spec_of(wrapped)
    assert spec is not None
    assert spec.idempotent is True
    assert original.invoke({"order": "o-1", "amount": 5.0}) == "refunded o-1"
    # Outside the ledger the declared tool does not run: nothing would record the effect.
    with pytest.raises(ConfigurationError, match="outside the side-effect ledger"):
        wrapped.invoke({"order": "o-1", "amount": 5.0})


def test_side_effect_rejects_non_tools() -> None:
    """A plain function (no @tool) is refused with ConfigurationError."""
    with pytest.raises(ConfigurationError, match="decorates a LangChain tool"):
        side_effect(_refund)  # type: ignore[call-overload]


def test_side_effect_rejects_double_decoration() -> None:
    """Declaring an already declared tool again is refused with ConfigurationError."""
    once = side_effect(StructuredTool.from_function(_refund))
    with pytest.raises(ConfigurationError, match="already declared"):
        side_effect(once, idempotent=True)


def test_current_invocation_outside_executor_raises() -> None:
    """current_invocation() outside a tool run by the executor raises ConfigurationError."""
    with pytest.raises(ConfigurationError, match="only available inside"):
        current_invocation()


# --- (c) results the ledger cannot keep as they are -------------------------------------------


class Report:
    """A result that is not JSON."""

    def __str__(self) -> str:
        return "Report(o-1, 3 pages)"


@pytest.mark.parametrize(
    "result",
    [
        pytest.param(Report(), id="custom-object"),
        pytest.param("x" * 300_000, id="300KB-str"),
        pytest.param("é" * 60_000, id="escaped-str"),
    ],
)
def test_unrecordable_result_still_commits_and_is_not_repeated(
    cp: RecoveryCheckpointer, result: Any
) -> None:
    """A non-JSON or >300 KB result commits (result_reduced) and a resume does not repeat it."""
    exports: list[str] = []
    crashes = [SimulatedCrash("killed after the export, before the checkpoint")]

    @side_effect
    @tool
    def export(order: str) -> Any:
        """Export an order report to the archive."""
        exports.append(order)
        return result

    @tool
    def notify(order: str) -> str:
        """Notify the team."""
        if crashes:
            raise crashes.pop()
        return "notified"

    model = ScriptedModel(script=[[("export", {"order": "o-1"}), ("notify", {"order": "o-1"})]])
    graph = create_recovery_agent(model, [export, notify], checkpointer=cp)
    with pytest.raises(SimulatedCrash):
        graph.invoke(goal(), config("t"))
    (entry,) = cp.ledger("t")
    assert entry.status is LedgerStatus.COMMITTED
    assert entry.extra["result_reduced"] is True
    assert entry.result
    assert str(result).startswith(entry.result)  # kept as (possibly cut) text

    final = resume(graph, "t")

    assert exports == ["o-1"]
    assert final["messages"][-1].content == "finished after 1 steps"
    skipped = [e for e in cp.events("t") if e.kind is EventKind.TOOL_SKIPPED]
    assert [e.payload["key"] for e in skipped] == [entry.key]


# --- (d) resume -------------------------------------------------------------------------------


def test_resume_unknown_thread_raises_thread_not_found(cp: RecoveryCheckpointer) -> None:
    """resume() on a thread id without checkpoints raises ThreadNotFound."""
    graph = create_recovery_agent(ScriptedModel(script=[]), [], checkpointer=cp)
    with pytest.raises(ThreadNotFound) as raised:
        resume(graph, "no-such-thread")
    assert raised.value.thread_id == "no-such-thread"


def test_resume_finished_thread_returns_values_without_model(cp: RecoveryCheckpointer) -> None:
    """resume() on a finished thread returns its values; the model is not asked again."""
    service = Service()
    model = ScriptedModel(script=[[CHARGE]])
    graph = create_recovery_agent(model, service.tools(), checkpointer=cp)
    done = graph.invoke(goal(), config("t"))
    asked, logged = len(model.asked), len(cp.events("t"))

    again = resume(graph, "t")

    assert [m.content for m in again["messages"]] == [m.content for m in done["messages"]]
    assert len(model.asked) == asked
    assert len(cp.events("t")) == logged  # not even a run_resumed event
    assert service.charges == [("o-1", 40)]


# --- (e) durability and recorded decisions ----------------------------------------------------


@pytest.mark.parametrize(
    ("durability", "late", "recorded"),
    [("exit", False, True), ("async", True, True), ("async", False, False), ("sync", False, False)],
)
def test_decision_recorded_unless_its_checkpoint_is_stored(
    cp: RecoveryCheckpointer,
    durability: str,
    late: bool,
    recorded: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A side-effecting decision is recorded when the checkpoint holding it is not on disk
    before the effect: always under "exit", under "async" only when that checkpoint is
    late (the step waits for it briefly), never under "sync"."""
    if late:
        slow_puts(monkeypatch, cp)
    model = ScriptedModel(script=[[CHARGE]])
    graph = create_recovery_agent(model, Service().tools(), checkpointer=cp)
    result = graph.invoke(goal(), config("t"), durability=durability)  # type: ignore[arg-type]

    messages = result["messages"]
    decision = cp.decision("t", "", messages_digest(messages[:1]))
    assert (decision is not None) is recorded
    if decision is not None:
        assert messages[1].tool_calls[0]["id"] in decision


def test_rerun_after_crash_under_exit_replays_recorded_decision(cp: RecoveryCheckpointer) -> None:
    """After a crash lost every "exit" checkpoint, a rerun replays the decision: no 2nd charge."""
    service = Service()
    model = ScriptedModel(script=[[CHARGE]], fail_at={2: SimulatedCrash("killed after the charge")})
    graph = create_recovery_agent(model, service.tools(), checkpointer=cp)
    with pytest.raises(SimulatedCrash):
        graph.invoke(goal(), config("t"), durability="exit")
    (first,) = cp.ledger("t")
    # Under "exit" a killed process leaves no checkpoint behind (LangGraph saves only on exit):
    # remove what the clean exception exit did save, keeping the recovery tables.
    cp.inner.delete_thread("t")
    assert cp.get_tuple(config("t")) is None  # type: ignore[arg-type]

    result = graph.invoke(goal(), config("t"), durability="exit")

    assert model.asked_with_goal_only() == 1
    assert service.charges == [("o-1", 40)]
    tool_message = next(m for m in result["messages"] if isinstance(m, ToolMessage))
    assert tool_message.tool_call_id == first.tool_call_id
    assert [(e.key, e.attempt) for e in cp.ledger("t")] == [(first.key, 1)]
    replayed = [e for e in cp.events("t") if e.kind is EventKind.LLM_DECIDED]
    assert any(e.payload.get("replayed") for e in replayed)
    assert "tool_skipped" in kinds(cp.events("t"))


# --- (f) async API ----------------------------------------------------------------------------


def _ledger_view(entries: Sequence[LedgerEntry]) -> list[tuple[Any, ...]]:
    """What must match across runs: everything but keys, ids, threads and times."""
    return [
        (e.tool, e.status, dict(e.args), e.args_digest, e.attempt, e.result, e.proof, e.error)
        for e in entries
    ]


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        volatile = {"id", "key", "tool_call_id"}
        return {k: _scrub(v) for k, v in value.items() if k not in volatile}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def _events_view(events: Sequence[Event]) -> list[tuple[int, str, Any]]:
    return [(e.seq, e.kind.value, _scrub(dict(e.payload))) for e in events]


# One model call per decision, so the model's failure stops the run (and resume continues).
NO_MODEL_RETRY = ModelPolicy(max_attempts=1)


def _flaky_model() -> ScriptedModel:
    # The second question fails (a provider outage), so the run stops after the lookup.
    return ScriptedModel(
        script=[[LOOKUP], [CHARGE]], fail_at={2: RuntimeError("model provider unavailable")}
    )


async def test_async_api_matches_sync_path(conn_string: str) -> None:
    """ainvoke + aresume on AsyncRecoveryCheckpointer log the same ledger/events as sync."""
    sync_service, async_service = Service(), Service()
    with RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        cp.setup()
        graph = create_recovery_agent(
            _flaky_model(), sync_service.tools(), checkpointer=cp, model_policy=NO_MODEL_RETRY
        )
        with pytest.raises(RuntimeError, match="unavailable"):
            graph.invoke(goal(), config("sync"))
        resume(graph, "sync")
        sync_ledger, sync_events = cp.ledger("sync"), cp.events("sync")

    async with AsyncRecoveryCheckpointer.from_conn_string(conn_string) as acp:
        await acp.setup()
        agraph = create_recovery_agent(
            _flaky_model(), async_service.tools(), checkpointer=acp, model_policy=NO_MODEL_RETRY
        )
        with pytest.raises(RuntimeError, match="unavailable"):
            await agraph.ainvoke(goal(), config("async"))
        await aresume(agraph, "async")
        async_ledger, async_events = await acp.aledger("async"), await acp.aevents("async")

    assert sync_service.charges == async_service.charges == [("o-1", 40)]
    assert _ledger_view(async_ledger) == _ledger_view(sync_ledger)
    assert _events_view(async_events) == _events_view(sync_events)
    assert "run_resumed" in kinds(async_events)
    assert kinds(async_events)[-1] == "agent_finished"


# --- (g) interrupts inside a side-effecting tool ----------------------------------------------


def _approval_graph(cp: RecoveryCheckpointer, calls: list[str]) -> Graph:
    @side_effect
    @tool
    def charge(order: str, amount: int) -> str:
        """Charge an order once a manager approved it."""
        calls.append(order)
        answer = interrupt({"question": f"charge {amount} on {order}?"})
        return f"charged ({answer})"

    return create_recovery_agent(ScriptedModel(script=[[CHARGE]]), [charge], checkpointer=cp)


def test_interrupt_inside_side_effect_tool_pauses_graph(cp: RecoveryCheckpointer) -> None:
    """interrupt() in a @side_effect tool pauses the graph; no error ToolMessage, entry intended."""
    calls: list[str] = []
    result = _approval_graph(cp, calls).invoke(goal(), config("t"))

    assert [i.value for i in result["__interrupt__"]] == [{"question": "charge 40 on o-1?"}]
    assert not any(isinstance(m, ToolMessage) for m in result["messages"])
    (entry,) = cp.ledger("t")
    assert (entry.status, entry.attempt, entry.error) == (LedgerStatus.INTENDED, 1, None)
    assert "tool_failed" not in kinds(cp.events("t"))
    assert calls == ["o-1"]


def test_resume_of_thread_paused_in_tool_raises_pending_takeover(cp: RecoveryCheckpointer) -> None:
    """resume() refuses a thread paused on an interrupt inside a tool (PendingTakeover)."""
    graph = _approval_graph(cp, [])
    graph.invoke(goal(), config("t"))

    with pytest.raises(PendingTakeover) as raised:
        resume(graph, "t")
    assert len(raised.value.interrupt_ids) == 1


def test_answered_interrupt_inside_side_effect_tool_completes(cp: RecoveryCheckpointer) -> None:
    """Answering an interrupt raised in a @side_effect tool runs the tool to its commit."""
    calls: list[str] = []
    graph = _approval_graph(cp, calls)
    graph.invoke(goal(), config("t"))

    result = graph.invoke(Command(resume="approved"), config("t"))

    tool_message = next(m for m in result["messages"] if isinstance(m, ToolMessage))
    assert (tool_message.status, tool_message.content) == ("success", "charged (approved)")
    (entry,) = cp.ledger("t")
    assert (entry.status, entry.result) == (LedgerStatus.COMMITTED, "charged (approved)")
