"""A decision names its takeover: once that takeover is answered, the same decision is refused.

The warehouse agent (``tests/_inbox_scenario.py``) stops on an uncertain ``ship_parcel``; a
person provides the carrier's result, the run goes on and stops again on an uncertain
``notify_customer``. The first decision, given again (a resubmitted form, a command run
twice), must not land on the mailer's takeover: ``decide`` raises ``StaleDecision`` naming
the takeover pending now, and nothing changes (ledger, log, checkpoint, service). Checked
for ``create_recovery_agent`` and for ``create_agent`` + ``RecoveryMiddleware``, sync and
async, through the API and the CLI. A decision without a takeover id still answers the one
takeover pending.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from _inbox_scenario import (
    SHIP_GOAL,
    SHIP_PLAN,
    WAREHOUSE_DB,
    FileService,
    build_warehouse,
    stop_on_shipping,
    warehouse_tools,
)
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from typer.testing import CliRunner

import taskpilots_graph as tp
from taskpilots_graph import testing
from taskpilots_graph.cli import app as cli_app
from taskpilots_graph.errors import InvalidDecision, NoPendingTakeover, StaleDecision
from taskpilots_graph.middleware import RecoveryMiddleware

THREAD = "ship-1"
CONFIG: RunnableConfig = {"configurable": {"thread_id": THREAD}}


def build_middleware(cp: Any, service: FileService) -> Any:
    """The same agent as ``langchain.agents.create_agent`` with ``RecoveryMiddleware``."""
    model = testing.ScriptedModel(plan=SHIP_PLAN, answer="shipped and notified")
    return create_agent(
        model, warehouse_tools(service), checkpointer=cp, middleware=[RecoveryMiddleware(cp)]
    )


BUILDERS = {"recovery_agent": build_warehouse, "create_agent": build_middleware}


def state_of(cp: Any, graph: Any) -> tuple[Any, ...]:
    """Everything a decision could change: ledger, log length, latest checkpoint."""
    found = cp.get_tuple(CONFIG)
    return (cp.ledger(THREAD), len(cp.events(THREAD)), found.checkpoint["id"])


def only_takeover(cp: Any) -> tp.TakeoverRequest:
    (request,) = tp.pending_takeovers(cp, thread_ids=[THREAD])
    return request


def ship_decision(request: tp.TakeoverRequest) -> tp.Decision:
    """The person's answer to the carrier's takeover, naming it."""
    assert request.pending[0]["tool"] == "ship_parcel"
    return tp.Decision(
        action="provide_result",
        result="TRK-1",
        interrupt_id=request.interrupt_id,
        tool_call_id=request.pending[0]["tool_call_id"],
        decided_by="dana",
    )


@pytest.mark.parametrize("form", sorted(BUILDERS))
def test_a_decision_given_again_is_refused_and_changes_nothing(
    cp: tp.RecoveryCheckpointer, tmp_path: Path, form: str
) -> None:
    """Applied once; given again it raises StaleDecision naming the mailer's takeover, and
    the mailer's step is neither answered with the parcel's result nor run."""
    service = FileService(tmp_path / "warehouse.db")
    graph = BUILDERS[form](cp, service)
    stop_on_shipping(graph, THREAD)
    decision = ship_decision(only_takeover(cp))

    tp.decide(graph, THREAD, decision)
    mailer = only_takeover(cp)
    assert mailer.pending[0]["tool"] == "notify_customer"
    assert mailer.interrupt_id != decision.interrupt_id
    before = state_of(cp, graph)

    with pytest.raises(StaleDecision) as refused:
        tp.decide(graph, THREAD, decision)

    assert refused.value.interrupt_id == decision.interrupt_id
    assert refused.value.current == [mailer.interrupt_id]
    assert str(mailer.interrupt_id) in str(refused.value)
    assert isinstance(refused.value, NoPendingTakeover)  # "already decided", as before
    assert state_of(cp, graph) == before
    assert only_takeover(cp) == mailer
    assert service.count("notify_customer") == 0
    notify = [e for e in cp.ledger(THREAD) if e.tool == "notify_customer"]
    assert [e.status for e in notify] == [tp.LedgerStatus.UNCERTAIN]

    # The takeover pending now is answered as usual, by its own id.
    done = tp.decide(
        graph,
        THREAD,
        tp.Decision(action="retry", interrupt_id=mailer.interrupt_id, decided_by="dana"),
    )
    assert "notified" in done["messages"][-1].content
    assert service.count("notify_customer") == 1
    assert service.count("ship_parcel") == 1
    assert tp.pending_takeovers(cp) == []
    with pytest.raises(StaleDecision) as finished:
        tp.decide(graph, THREAD, decision)
    assert finished.value.current == []


@pytest.mark.parametrize("form", sorted(BUILDERS))
async def test_async_a_decision_given_again_is_refused(
    conn_string: str, tmp_path: Path, form: str
) -> None:
    """adecide refuses the same decision the same way, with the same facts."""
    service = FileService(tmp_path / "warehouse.db")
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(conn_string) as acp:
        await acp.setup()
        graph = BUILDERS[form](acp, service)
        await graph.ainvoke({"messages": [HumanMessage(SHIP_GOAL)]}, CONFIG)
        (ship,) = await tp.apending_takeovers(acp, thread_ids=[THREAD])
        decision = ship_decision(ship)
        await tp.adecide(graph, THREAD, decision)
        (mailer,) = await tp.apending_takeovers(acp, thread_ids=[THREAD])
        ledger = await acp.aledger(THREAD)

        with pytest.raises(StaleDecision) as refused:
            await tp.adecide(graph, THREAD, decision)

        assert refused.value.current == [mailer.interrupt_id]
        assert await acp.aledger(THREAD) == ledger
        assert await tp.apending_takeovers(acp, thread_ids=[THREAD]) == [mailer]
    assert service.count("notify_customer") == 0


def test_a_decision_without_a_takeover_id_answers_the_one_pending(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    """Backwards compatible: no interrupt id, one takeover pending, it is answered."""
    service = FileService(tmp_path / "warehouse.db")
    graph = build_warehouse(cp, service)
    stop_on_shipping(graph, THREAD)

    tp.decide(graph, THREAD, tp.Decision(action="provide_result", result="TRK-1"))

    assert only_takeover(cp).pending[0]["tool"] == "notify_customer"
    with pytest.raises(InvalidDecision, match="no step"):  # a step of the old takeover
        tp.decide(
            graph,
            THREAD,
            tp.Decision(action="skip", tool_call_id="call_of_another_takeover"),
        )


def test_stale_decision_pickles_with_its_facts() -> None:
    """It crosses process boundaries (workers) with its attributes."""
    err = StaleDecision("t", "old", ["new"])
    back = pickle.loads(pickle.dumps(err))
    assert (back.thread_id, back.interrupt_id, back.current) == ("t", "old", ["new"])
    assert str(back) == str(err)


class _ShipAndNotifyAtOnce(testing.ScriptedModel):
    """Calls the carrier and the mailer in one message (parallel tool calls), then answers."""

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> Any:
        from langchain_core.outputs import ChatGeneration, ChatResult

        if any(isinstance(m, ToolMessage) for m in messages):
            message = AIMessage("done")
        else:
            calls = [
                {"name": name, "args": {"order": "o-7"}, "id": f"call_{name}"}
                for name in ("ship_parcel", "notify_customer")
            ]
            message = AIMessage("", tool_calls=calls)
        return ChatResult(generations=[ChatGeneration(message=message)])


def test_several_takeovers_need_a_decision_that_names_one(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    """Two calls of one message both wait on a person: a decision naming neither is
    refused; one naming a step (or a takeover) answers exactly that one."""
    service = FileService(tmp_path / "warehouse.db")
    graph = create_agent(
        _ShipAndNotifyAtOnce(plan=[]),
        warehouse_tools(service),
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp)],
    )
    graph.invoke({"messages": [HumanMessage("ship and notify")]}, CONFIG)
    both = tp.pending_takeovers(cp, thread_ids=[THREAD])
    assert sorted(r.pending[0]["tool"] for r in both) == ["notify_customer", "ship_parcel"]
    before = state_of(cp, graph)

    with pytest.raises(InvalidDecision, match="2 takeovers are pending"):
        tp.decide(graph, THREAD, tp.Decision(action="skip"))
    assert state_of(cp, graph) == before

    tp.decide(graph, THREAD, tp.Decision(action="skip", tool_call_id="call_notify_customer"))
    (left,) = tp.pending_takeovers(cp, thread_ids=[THREAD])
    assert left.pending[0]["tool"] == "ship_parcel"
    assert left.interrupt_id in {r.interrupt_id for r in both}
    tp.decide(graph, THREAD, tp.Decision(action="skip", interrupt_id=left.interrupt_id))
    assert tp.pending_takeovers(cp, thread_ids=[THREAD]) == []
    assert service.count("notify_customer") == 0  # skipped, never run again


def test_the_cli_refuses_a_command_run_again(
    cp: tp.RecoveryCheckpointer,
    conn_string: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``taskpilots decide --takeover ID`` twice: the second exits 1 with one line naming
    the takeover pending now, and changes nothing."""
    service_db = tmp_path / "warehouse.db"
    monkeypatch.setenv(WAREHOUSE_DB, str(service_db))
    service = FileService(service_db)
    stop_on_shipping(build_warehouse(cp, service), THREAD)
    ship = only_takeover(cp)
    assert ship.interrupt_id is not None
    assert f"Takeover: {ship.interrupt_id}" in str(ship)  # what `taskpilots show` prints
    command = [
        "decide", THREAD, "provide_result", "--result", '"TRK-1"', "--by", "dana",
        "--takeover", ship.interrupt_id, "--graph", "_inbox_scenario:make_warehouse",
        "--db", conn_string, "--json",
    ]  # fmt: skip
    runner = CliRunner()

    first = runner.invoke(cli_app, command)
    assert first.exit_code == 0, first.output
    shown = json.loads(first.stdout)["takeover"]
    assert shown["pending"][0]["tool"] == "notify_customer"
    before = state_of(cp, None)

    again = runner.invoke(cli_app, command)

    assert again.exit_code != 0
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1, again.stderr
    assert lines[0].startswith("error: ")
    assert "no longer pending" in lines[0]
    assert shown["interrupt_id"] in lines[0]
    assert f"taskpilots show {THREAD}" in lines[0]
    assert state_of(cp, None) == before
    assert service.count("notify_customer") == 0
