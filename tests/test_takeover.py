"""Human takeover: the request a person sees, each decision's outcome, and invalid decisions.

Every test drives ``create_recovery_agent`` on a real SQLite file or PostgreSQL database (the
``cp`` fixture) with a scripted chat model through the same plan: ``reserve`` A and
``notify`` B commit, then ``charge`` C performs its effect and times out. ``charge`` is a
non-idempotent ``@side_effect`` without a pre-check, so nobody can tell whether it happened:
the run stops on a takeover naming the effect's ledger key, and a person answers it with
``tp.decide`` (here, or from another process). An in-process service records every
execution and every compensation, so a repeat or a missing undo shows up.
"""

from __future__ import annotations

import getpass
import multiprocessing
import os
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import pytest
from _models import PlanModel
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph import testing
from taskpilots_graph.errors import InvalidDecision, NoPendingTakeover, ThreadNotFound
from taskpilots_graph.nodes.compensate import ABANDONED
from taskpilots_graph.takeover import DECISION_ACTIONS

GOAL = "reserve A, notify B, then charge C"
PLAN: list[tuple[str, dict[str, Any]]] = [
    ("reserve", {"ref": "A"}),
    ("notify", {"ref": "B"}),
    ("charge", {"ref": "C"}),
]
THREAD = "t"
CHILD_TIMEOUT_S = 60.0


# --- the scripted model and the simulated service ---------------------------------------------


@dataclass
class Service:
    """Records each execution ``(tool, ref, key, attempt)`` and each undo ``(tool, key)``."""

    calls: list[tuple[str, str, str, int]] = field(default_factory=list)
    undone: list[tuple[str, str]] = field(default_factory=list)

    def tool(self, name: str) -> BaseTool:
        def perform(ref: str) -> str:
            inv = tp.current_invocation()
            self.calls.append((name, ref, inv.key, inv.attempt))
            return f"{name} {ref} ok"

        def undo(key: str, args: dict[str, Any], result: Any) -> None:
            self.undone.append((name, key))

        base = StructuredTool.from_function(perform, name=name, description=f"perform {name}")
        return tp.side_effect(base, compensate=undo)

    def executed(self, tool: str) -> list[tuple[str, str, int]]:
        return [(ref, key, attempt) for name, ref, key, attempt in self.calls if name == tool]


@dataclass
class Stopped:
    """A run stopped on the takeover of ``charge`` C."""

    graph: Any
    model: PlanModel
    service: Service
    charge: testing.FaultyTool
    result: dict[str, Any]


def build(
    cp: tp.RecoveryCheckpointer, service: Service, plan: list[tuple[str, dict[str, Any]]] = PLAN
) -> tuple[Any, PlanModel, testing.FaultyTool]:
    """The graph of every test (and of the child process): charge times out once after acting."""
    charge = testing.fail_after_effect(service.tool("charge"), times=1)
    model = PlanModel(plan=plan)
    graph = tp.create_recovery_agent(
        model, [service.tool("reserve"), service.tool("notify"), charge.tool], checkpointer=cp
    )
    return graph, model, charge


@pytest.fixture
def stopped(cp: tp.RecoveryCheckpointer) -> Stopped:
    """The scenario of every test, stopped on the takeover."""
    service = Service()
    graph, model, charge = build(cp, service)
    result = graph.invoke(
        {"messages": [HumanMessage(GOAL)]}, {"configurable": {"thread_id": THREAD}}
    )
    assert "__interrupt__" in result
    return Stopped(graph, model, service, charge, result)


def entry_of(cp: tp.RecoveryCheckpointer, tool: str) -> tp.LedgerEntry:
    (found,) = [e for e in cp.ledger(THREAD) if e.tool == tool]
    return found


def entries(cp: tp.RecoveryCheckpointer, tool: str) -> list[tp.LedgerEntry]:
    return [e for e in cp.ledger(THREAD) if e.tool == tool]


def events(cp: tp.RecoveryCheckpointer, kind: tp.EventKind) -> list[dict[str, Any]]:
    return [dict(e.payload) for e in cp.events(THREAD) if e.kind is kind]


def last_tool_message(model: PlanModel) -> ToolMessage:
    return [m for m in model.inputs[-1] if isinstance(m, ToolMessage)][-1]


def resume_prompt(model: PlanModel) -> str:
    (prompt,) = [
        m for m in model.inputs[-1] if isinstance(m, HumanMessage) and m.name == "taskpilots_resume"
    ]
    return str(prompt.content)


def closed(graph: Any) -> bool:
    snapshot = graph.get_state({"configurable": {"thread_id": THREAD}})
    return snapshot.values["flow"]["stage"] == "closed" and not snapshot.next


# --- the request ------------------------------------------------------------------------------


def test_uncertain_effect_yields_one_pending_takeover_with_the_whole_picture(
    cp: tp.RecoveryCheckpointer, stopped: Stopped
) -> None:
    """One pending takeover names the uncertain key, goal, failure, commits and each option."""
    other_graph, _, _ = build(cp, Service(), plan=[])
    other_graph.invoke(  # a finished thread on the same store is not listed
        {"messages": [HumanMessage("nothing to do")]}, {"configurable": {"thread_id": "other"}}
    )

    (request,) = tp.pending_takeovers(cp)
    assert tp.pending_takeovers(cp, thread_ids=[THREAD, "other", "unknown"]) == [request]
    uncertain = entry_of(cp, "charge")
    reserve, notify = entry_of(cp, "reserve"), entry_of(cp, "notify")
    assert uncertain.status is tp.LedgerStatus.UNCERTAIN
    assert stopped.service.executed("charge") == [("C", uncertain.key, 1)]  # acted once

    assert request.thread_id == THREAD
    assert request.interrupt_id == stopped.result["__interrupt__"][0].id
    assert request.goal == GOAL
    assert request.uncertain_effects == [
        {"key": uncertain.key, "tool": "charge", "args": {"ref": "C"}}
    ]
    assert request.failure is not None
    assert request.failure["kind"] == "side_effect_uncertain"
    assert request.failure["attempts"] == 1
    assert request.committed_effects == [
        {"key": reserve.key, "tool": "reserve"},
        {"key": notify.key, "tool": "notify"},
    ]
    assert [(s["tool"], s["result"]) for s in request.done_steps] == [
        ("reserve", "reserve A ok"),
        ("notify", "notify B ok"),
    ]
    (pending,) = request.pending
    call_id = stopped.result["messages"][-1].tool_calls[0]["id"]
    assert (pending["tool_call_id"], pending["tool"], pending["key"]) == (
        call_id,
        "charge",
        uncertain.key,
    )
    options = request.options
    assert tuple(options) == DECISION_ACTIONS
    assert uncertain.key in options["retry"]
    assert "same key" in options["retry"]
    assert "attempt 2" in options["retry"]
    assert "skipped" in options["skip"]
    assert "manual proof" in options["provide_result"]
    assert "new key" in options["edit_args"]
    # abandon undoes the committed effects, newest first
    undo = options["abandon"]
    assert undo.index(notify.key) < undo.index(reserve.key)
    assert uncertain.key in str(request)


# --- each decision ----------------------------------------------------------------------------


def test_retry_executes_once_more_with_the_same_key(
    cp: tp.RecoveryCheckpointer, stopped: Stopped
) -> None:
    """retry: the effect runs exactly once more under the same key (attempt 2), then commits."""
    key = entry_of(cp, "charge").key

    result = tp.decide(stopped.graph, THREAD, "retry")

    assert stopped.service.executed("charge") == [("C", key, 1), ("C", key, 2)]
    assert stopped.charge.calls == 2
    assert len(stopped.service.executed("reserve")) == len(stopped.service.executed("notify")) == 1
    done = entry_of(cp, "charge")
    assert (done.key, done.status, done.attempt) == (key, tp.LedgerStatus.COMMITTED, 2)
    assert done.result == "charge C ok"
    answer = last_tool_message(stopped.model)
    assert (answer.content, answer.status) == ("charge C ok", "success")
    assert result["messages"][-1].content == "done"
    assert closed(stopped.graph)
    assert tp.pending_takeovers(cp) == []


def test_skip_continues_without_the_effect(cp: tp.RecoveryCheckpointer, stopped: Stopped) -> None:
    """skip: no further call; the model sees a "Skipped" error answer; the run closes."""
    result = tp.decide(stopped.graph, THREAD, {"action": "skip"})

    assert stopped.charge.calls == 1
    assert len(stopped.service.executed("charge")) == 1
    answer = last_tool_message(stopped.model)
    assert answer.status == "error"
    assert str(answer.content).startswith("Skipped")
    assert answer.tool_call_id == stopped.result["messages"][-1].tool_calls[0]["id"]
    skipped = entry_of(cp, "charge")
    assert skipped.status is tp.LedgerStatus.FAILED  # no longer uncertain: closed for good
    assert (skipped.error or {}).get("type") == "skipped_by_person"
    assert result["messages"][-1].content == "done"
    assert closed(stopped.graph)
    assert events(cp, tp.EventKind.AGENT_FINISHED)[-1]["status"] == "closed"


def test_provide_result_commits_it_with_a_manual_proof(
    cp: tp.RecoveryCheckpointer, stopped: Stopped
) -> None:
    """provide_result: committed with proof["manual"] True; the model sees the given result."""
    decision = tp.Decision(action="provide_result", result="receipt R-42", decided_by="alice")
    result = tp.decide(stopped.graph, THREAD, decision)

    assert stopped.charge.calls == 1
    provided = entry_of(cp, "charge")
    assert provided.status is tp.LedgerStatus.COMMITTED
    assert provided.result == "receipt R-42"
    assert provided.proof["manual"] is True
    assert provided.proof["decided_by"] == "alice"
    answer = last_tool_message(stopped.model)
    assert (answer.content, answer.status) == ("receipt R-42", "success")
    assert result["messages"][-1].content == "done"
    assert closed(stopped.graph)


def test_provided_result_counts_as_a_done_step(
    cp: tp.RecoveryCheckpointer, stopped: Stopped
) -> None:
    """After provide_result the resume prompt counts the step as done, with its result."""
    tp.decide(stopped.graph, THREAD, {"action": "provide_result", "result": "receipt R-42"})

    prompt = resume_prompt(stopped.model)
    assert "Progress: 3 step(s) done." in prompt
    assert '- step 3: charge({"ref": "C"}) → receipt R-42' in prompt


def test_provided_structured_result_reaches_the_model_as_json(
    cp: tp.RecoveryCheckpointer, stopped: Stopped
) -> None:
    """A dict provided by a person reaches the model as the JSON a tool result would be."""
    tp.decide(stopped.graph, THREAD, {"action": "provide_result", "result": {"receipt": "R-42"}})

    assert entry_of(cp, "charge").result == {"receipt": "R-42"}
    assert last_tool_message(stopped.model).content == '{"receipt": "R-42"}'


def test_edit_args_calls_with_new_args_under_a_new_key(
    cp: tp.RecoveryCheckpointer, stopped: Stopped
) -> None:
    """edit_args: one call with the new args under a new key; the old entry is not uncertain."""
    old_key = entry_of(cp, "charge").key

    result = tp.decide(stopped.graph, THREAD, {"action": "edit_args", "args": {"ref": "D"}})

    (first, second) = stopped.service.executed("charge")
    assert first == ("C", old_key, 1)
    new_ref, new_key, new_attempt = second
    assert (new_ref, new_attempt) == ("D", 1)
    assert new_key != old_key
    by_key = {e.key: e for e in entries(cp, "charge")}
    assert set(by_key) == {old_key, new_key}
    assert by_key[old_key].status is tp.LedgerStatus.FAILED
    assert (by_key[old_key].error or {}).get("type") == "superseded"
    assert by_key[new_key].status is tp.LedgerStatus.COMMITTED
    assert dict(by_key[new_key].args) == {"ref": "D"}
    assert last_tool_message(stopped.model).content == "charge D ok"
    assert result["messages"][-1].content == "done"
    assert closed(stopped.graph)


def test_edit_args_that_do_not_fit_the_tool_are_invalid(
    cp: tp.RecoveryCheckpointer, stopped: Stopped
) -> None:
    """edit_args whose args the tool rejects raise InvalidDecision and change nothing."""
    ledger = cp.ledger()
    with pytest.raises(InvalidDecision):
        tp.decide(stopped.graph, THREAD, {"action": "edit_args", "args": {"bogus": 1}})
    assert cp.ledger() == ledger


def test_abandon_compensates_committed_effects_once_in_reverse_order(
    cp: tp.RecoveryCheckpointer, stopped: Stopped
) -> None:
    """abandon: every committed effect is undone once, newest first, and the run is closed."""
    reserve, notify = entry_of(cp, "reserve"), entry_of(cp, "notify")

    result = tp.decide(stopped.graph, THREAD, tp.Decision(action="abandon", decided_by="bob"))

    expected = [("notify", notify.key), ("reserve", reserve.key)]
    assert stopped.service.undone == expected
    assert [(p["tool"], p["key"]) for p in events(cp, tp.EventKind.COMPENSATED)] == expected
    assert entry_of(cp, "reserve").status is tp.LedgerStatus.COMPENSATED
    assert entry_of(cp, "notify").status is tp.LedgerStatus.COMPENSATED
    assert stopped.charge.calls == 1  # the uncertain effect is not executed again
    assert result["flow"]["stage"] == "closed"
    assert result["flow"]["reason"] == ABANDONED
    assert closed(stopped.graph)
    log = cp.events(THREAD)
    assert log[-1].kind is tp.EventKind.AGENT_FINISHED
    assert log[-1].payload["status"] == "closed"
    # Closed for good: resuming changes nothing, nothing is undone twice.
    tp.resume(stopped.graph, THREAD)
    assert stopped.service.undone == expected
    assert tp.pending_takeovers(cp) == []


# --- who decided ------------------------------------------------------------------------------


@pytest.mark.parametrize("decided_by", ["alice", None], ids=["named", "default-user"])
def test_decision_recorded_event_names_action_and_decider(
    cp: tp.RecoveryCheckpointer, stopped: Stopped, decided_by: str | None
) -> None:
    """decision_recorded carries the action, who decided (default: the OS user) and the step."""
    decision = tp.Decision(action="skip", decided_by=decided_by, note="customer cancelled")
    tp.decide(stopped.graph, THREAD, decision)

    (recorded,) = events(cp, tp.EventKind.DECISION_RECORDED)
    assert recorded["decision"]["action"] == "skip"
    assert recorded["decision"]["note"] == "customer cancelled"
    assert recorded["decided_by"] == (decided_by or getpass.getuser())
    assert recorded["steps"] == [stopped.result["messages"][-1].tool_calls[0]["id"]]


# --- another process --------------------------------------------------------------------------


def decide_in_child(conn_string: str, thread_id: str, chan: Connection) -> None:
    """Child process: open its own checkpointer, build the same graph, answer the takeover."""
    try:
        with tp.RecoveryCheckpointer.from_conn_string(conn_string) as cp:
            graph, _, _ = build(cp, Service())
            decision = tp.Decision(
                action="provide_result", result="receipt R-7", decided_by=f"child-{os.getpid()}"
            )
            result = tp.decide(graph, thread_id, decision)
            chan.send(("done", {"pid": os.getpid(), "stage": result["flow"]["stage"]}))
    except BaseException:
        chan.send(("error", traceback.format_exc()))
        raise
    finally:
        chan.close()


def test_takeover_is_resolved_from_another_process(
    cp: tp.RecoveryCheckpointer, conn_string: str, stopped: Stopped
) -> None:
    """A spawned process with its own checkpointer decides; the parent then sees it closed."""
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe(duplex=False)
    child = context.Process(target=decide_in_child, args=(conn_string, THREAD, child_end))
    child.start()
    child_end.close()
    try:
        assert parent_end.poll(CHILD_TIMEOUT_S), "the child process did not answer in time"
        tag, value = parent_end.recv()
    finally:
        child.join(CHILD_TIMEOUT_S)
        if child.is_alive():
            child.kill()
    assert tag == "done", value
    assert child.exitcode == 0
    assert value["pid"] != os.getpid()
    assert value["stage"] == "closed"

    assert closed(stopped.graph)
    assert tp.pending_takeovers(cp) == []
    assert stopped.charge.calls == 1  # nothing ran here
    provided = entry_of(cp, "charge")
    assert (provided.status, provided.result) == (tp.LedgerStatus.COMMITTED, "receipt R-7")
    (recorded,) = events(cp, tp.EventKind.DECISION_RECORDED)
    assert recorded["decided_by"] == f"child-{value['pid']}"
    with pytest.raises(NoPendingTakeover):
        tp.decide(stopped.graph, THREAD, "skip")


# --- invalid decisions ------------------------------------------------------------------------


def snapshot(cp: tp.RecoveryCheckpointer, graph: Any, thread_id: str = THREAD) -> Any:
    """What an invalid decision must not change: state, next nodes, checkpoint, ledger, log."""
    state = graph.get_state({"configurable": {"thread_id": thread_id}})
    return (
        state.values,
        state.next,
        state.config["configurable"]["checkpoint_id"],
        cp.ledger(),
        [(e.seq, e.kind) for e in cp.events(thread_id)],
    )


def test_invalid_decisions_raise_typed_errors_and_change_nothing(
    cp: tp.RecoveryCheckpointer, stopped: Stopped
) -> None:
    """Malformed decisions raise InvalidDecision; state, checkpoint, ledger, log are untouched."""
    done_call = stopped.result["messages"][1].tool_calls[0]["id"]  # reserve: closed, not waiting
    cases: list[tuple[str, Any]] = [
        ("unknown action", {"action": "explode"}),
        ("unknown action name", "explode"),
        ("not a decision", 42),
        ("unknown field", {"action": "skip", "reason": "x"}),
        ("provide_result without result", {"action": "provide_result"}),
        ("edit_args without args", {"action": "edit_args"}),
        ("edit_args with empty args", {"action": "edit_args", "args": {}}),
        ("retry with a result", {"action": "retry", "result": "x"}),
        ("skip with args", {"action": "skip", "args": {"ref": "Z"}}),
        ("tool_call_id unknown", {"action": "skip", "tool_call_id": "call_nope"}),
        ("tool_call_id not waiting", {"action": "retry", "tool_call_id": done_call}),
    ]
    before = snapshot(cp, stopped.graph)
    for label, decision in cases:
        with pytest.raises(InvalidDecision):
            tp.decide(stopped.graph, THREAD, decision)
        assert snapshot(cp, stopped.graph) == before, label
    assert stopped.charge.calls == 1
    assert len(tp.pending_takeovers(cp)) == 1
    # The takeover is still there to be answered properly.
    tp.decide(stopped.graph, THREAD, "skip")
    assert closed(stopped.graph)


def test_decide_on_a_thread_without_takeover_or_unknown_raises(
    cp: tp.RecoveryCheckpointer, stopped: Stopped
) -> None:
    """A finished thread raises NoPendingTakeover, an unknown one ThreadNotFound; no change."""
    finished_graph, _, _ = build(cp, Service(), plan=[])
    finished = {"configurable": {"thread_id": "finished"}}
    finished_graph.invoke({"messages": [HumanMessage("nothing to do")]}, finished)
    before = snapshot(cp, finished_graph, "finished")
    waiting = snapshot(cp, stopped.graph)

    with pytest.raises(NoPendingTakeover):
        tp.decide(finished_graph, "finished", "skip")
    assert snapshot(cp, finished_graph, "finished") == before

    with pytest.raises(ThreadNotFound):
        tp.decide(stopped.graph, "no-such-thread", "skip")
    assert cp.get_tuple({"configurable": {"thread_id": "no-such-thread"}}) is None
    assert cp.events("no-such-thread") == []
    assert snapshot(cp, stopped.graph) == waiting


def test_the_same_decision_twice_raises_no_pending_takeover(
    cp: tp.RecoveryCheckpointer, stopped: Stopped
) -> None:
    """A decision applies once: repeating it raises NoPendingTakeover and changes nothing."""
    decision = tp.Decision(action="retry", decided_by="alice")
    tp.decide(stopped.graph, THREAD, decision)
    after_first = snapshot(cp, stopped.graph)

    with pytest.raises(NoPendingTakeover):
        tp.decide(stopped.graph, THREAD, decision)

    assert snapshot(cp, stopped.graph) == after_first
    assert stopped.charge.calls == 2  # the retry ran once
    assert len(events(cp, tp.EventKind.DECISION_RECORDED)) == 1


# --- async twins ------------------------------------------------------------------------------


async def test_async_pending_takeovers_and_adecide(conn_string: str) -> None:
    """apending_takeovers lists the takeover and adecide(retry) runs the effect once more."""
    service = Service()
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(conn_string) as acp:
        await acp.setup()
        graph, model, charge = build(acp, service)  # type: ignore[arg-type]
        result = await graph.ainvoke(
            {"messages": [HumanMessage(GOAL)]}, {"configurable": {"thread_id": THREAD}}
        )
        assert "__interrupt__" in result
        (request,) = await tp.apending_takeovers(acp)
        (uncertain,) = [e for e in await acp.aledger(THREAD) if e.tool == "charge"]
        assert [e["key"] for e in request.uncertain_effects] == [uncertain.key]

        with pytest.raises(InvalidDecision):
            await tp.adecide(graph, THREAD, {"action": "provide_result"})
        with pytest.raises(ThreadNotFound):
            await tp.adecide(graph, "no-such-thread", "retry")
        final = await tp.adecide(graph, THREAD, tp.Decision(action="retry", decided_by="carol"))

        assert service.executed("charge") == [("C", uncertain.key, 1), ("C", uncertain.key, 2)]
        assert final["flow"]["stage"] == "closed"
        assert await tp.apending_takeovers(acp) == []
        with pytest.raises(NoPendingTakeover):
            await tp.adecide(graph, THREAD, "retry")
        decided = [
            e.payload for e in await acp.aevents(THREAD) if e.kind is tp.EventKind.DECISION_RECORDED
        ]
        assert [(p["decision"]["action"], p["decided_by"]) for p in decided] == [("retry", "carol")]
    assert charge.calls == 2
    assert len(model.inputs) == 4
