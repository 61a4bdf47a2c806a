"""Drifted results: the same tool call answers differently when its step runs again.

The act step runs a price lookup and a second call that kills the run (a ``BaseException``
escaping the graph, as a dying process would leave it: the lookup's ``tool_succeeded``
event is on disk, the checkpoint after the step is not). Meanwhile the simulated price
service, whose state lives in a JSON file outside the agent, changes the price. ``tp.resume``
replays the step with the same tool-call ids, so the lookup runs again and returns the new
price: a high-risk lookup stops for a person, a low-risk one takes the new price and records
a ``result_drifted`` event.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from _models import ScriptedChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph.drift import detect_drift, difference, result_digest
from taskpilots_graph.errors import InvalidDecision, ResultDrifted
from taskpilots_graph.failures import classify
from taskpilots_graph.nodes.takeover import targets
from taskpilots_graph.takeover import DRIFT_ACTIONS

THREAD = "drift"


class Crash(BaseException):
    """The process dies here (not an ``Exception``: nothing in the agent may handle it)."""


class PriceService:
    """A price list and call counters in a JSON file, outside the agent."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._save({"price": 100, "as_of": 1, "lookups": 0, "confirmations": 0})

    def _load(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.path.read_text())
        return data

    def _save(self, data: dict[str, Any]) -> None:
        self.path.write_text(json.dumps(data))

    def set_price(self, price: int, as_of: int = 2) -> None:
        data = self._load()
        data.update(price=price, as_of=as_of)
        self._save(data)

    def count(self, name: str) -> int:
        return int(self._load()[name])

    def lookup(self, sku: str) -> dict[str, Any]:
        data = self._load()
        data["lookups"] += 1
        self._save(data)
        return {"sku": sku, "price": data["price"], "as_of": data["as_of"]}

    def confirm(self) -> str:
        data = self._load()
        data["confirmations"] += 1
        self._save(data)
        if data["confirmations"] == 1:
            raise Crash
        return "confirmed"


class TwoCallModel(ScriptedChatModel):
    """Asks for the price and a confirmation in one message, then reports what it saw."""

    def decide(self, messages: list[BaseMessage]) -> AIMessage:
        answers = [m for m in messages if isinstance(m, ToolMessage)]
        if not answers:
            return AIMessage(
                "",
                tool_calls=[
                    {"name": "get_price", "args": {"sku": "A"}, "id": "call_price"},
                    {"name": "confirm", "args": {}, "id": "call_confirm"},
                ],
            )
        price = next(m for m in answers if m.name == "get_price")
        return AIMessage(f"price seen: {price.content}")


def tools(service: PriceService) -> list[BaseTool]:
    def get_price(sku: str) -> dict[str, Any]:
        return service.lookup(sku)

    def confirm() -> str:
        return service.confirm()

    return [
        StructuredTool.from_function(get_price, name="get_price", description="price of a sku"),
        StructuredTool.from_function(confirm, name="confirm", description="confirm the order"),
    ]


def crash_then_resume(
    cp: tp.RecoveryCheckpointer, tmp_path: Path, policy: tp.ToolPolicy
) -> tuple[Any, TwoCallModel, PriceService, Any]:
    """Run until the crash, change the price, resume: the lookup runs again."""
    service = PriceService(tmp_path / "prices.json")
    model = TwoCallModel()
    graph = tp.create_recovery_agent(
        model, tools(service), checkpointer=cp, policies={"get_price": policy}
    )
    with pytest.raises(Crash):
        graph.invoke(
            {"messages": [HumanMessage("price of A")]}, {"configurable": {"thread_id": THREAD}}
        )
    assert service.count("lookups") == 1
    service.set_price(120)
    return graph, model, service, tp.resume(graph, THREAD)


def drift_events(cp: tp.RecoveryCheckpointer) -> list[dict[str, Any]]:
    return [dict(e.payload) for e in cp.events(THREAD) if e.kind is tp.EventKind.RESULT_DRIFTED]


def test_high_risk_read_that_drifts_raises_one_takeover_with_both_values(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    """A confirm_drift read answering differently on the replayed step stops for a person."""
    _graph, model, _service, result = crash_then_resume(
        cp, tmp_path, tp.ToolPolicy(confirm_drift=True)
    )

    assert "__interrupt__" in result
    (request,) = tp.pending_takeovers(cp)
    assert request.drift is not None
    assert request.drift["tool"] == "get_price"
    assert request.drift["tool_call_id"] == "call_price"
    assert request.drift["previous"] == {"sku": "A", "price": 100, "as_of": 1}
    assert request.drift["current"] == {"sku": "A", "price": 120, "as_of": 2}
    assert request.drift["difference"] == ["as_of: 1 → 2", "price: 100 → 120"]
    assert tuple(request.options) == DRIFT_ACTIONS
    assert request.failure is not None
    assert request.failure["kind"] == "data_uncertain"
    (event,) = drift_events(cp)
    assert event["confirm"] is True
    assert (event["previous"]["price"], event["current"]["price"]) == (100, 120)
    # The model has not been given either price yet.
    assert not any(isinstance(m, ToolMessage) and m.name == "get_price" for m in model.inputs[-1])
    assert "Drifted: get_price" in str(request)


def test_accept_continues_with_the_new_value(cp: tp.RecoveryCheckpointer, tmp_path: Path) -> None:
    """accept: the model gets the new price; the lookup is not called a third time."""
    graph, _model, service, _ = crash_then_resume(cp, tmp_path, tp.ToolPolicy(confirm_drift=True))

    result = tp.decide(graph, THREAD, tp.Decision(action="accept", decided_by="carol"))

    assert json.loads(result["messages"][-1].content.removeprefix("price seen: "))["price"] == 120
    assert service.count("lookups") == 2
    assert service.count("confirmations") == 2
    assert tp.pending_takeovers(cp) == []
    (decided,) = [e.payload for e in cp.events(THREAD) if e.kind is tp.EventKind.DECISION_RECORDED]
    assert (decided["decision"]["action"], decided["decided_by"]) == ("accept", "carol")
    assert (
        graph.get_state({"configurable": {"thread_id": THREAD}}).values["flow"]["stage"] == "closed"
    )


def test_skip_of_a_drifted_result_gives_the_model_no_price(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    """skip behaves as before: the lookup is answered "skipped", nothing is called again."""
    graph, model, service, _ = crash_then_resume(cp, tmp_path, tp.ToolPolicy(confirm_drift=True))

    tp.decide(graph, THREAD, "skip")

    (answer,) = [
        m for m in model.inputs[-1] if isinstance(m, ToolMessage) and m.name == "get_price"
    ]
    assert answer.status == "error"
    assert str(answer.content).startswith("Skipped")
    assert service.count("lookups") == 2


def test_low_risk_read_takes_the_new_value_and_records_a_drift_event(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    """Without confirm_drift the run goes on with the new price; a drift event says so."""
    _graph, _model, _service, result = crash_then_resume(cp, tmp_path, tp.ToolPolicy())

    assert "__interrupt__" not in result
    assert tp.pending_takeovers(cp) == []
    assert '"price": 120' in result["messages"][-1].content
    (event,) = drift_events(cp)
    assert event["confirm"] is False
    assert event["tool"] == "get_price"
    assert event["current"] == {"sku": "A", "price": 120, "as_of": 2}
    assert "100" in str(event["previous"])  # only the earlier text was kept
    assert event["previous_digest"] == result_digest({"sku": "A", "price": 100, "as_of": 1})


def test_a_comparator_decides_what_counts_as_a_change(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    """A comparator that ignores the timestamp sees no drift when only the timestamp moved."""
    service = PriceService(tmp_path / "prices.json")
    model = TwoCallModel()
    same_price = lambda old, new: old["price"] == new["price"]  # noqa: E731
    policy = tp.ToolPolicy(confirm_drift=True, drift_comparator=same_price)
    graph = tp.create_recovery_agent(
        model, tools(service), checkpointer=cp, policies={"get_price": policy}
    )
    with pytest.raises(Crash):
        graph.invoke(
            {"messages": [HumanMessage("price of A")]}, {"configurable": {"thread_id": THREAD}}
        )
    service.set_price(100, as_of=5)  # a new timestamp, the same price

    result = tp.resume(graph, THREAD)

    assert "__interrupt__" not in result
    assert drift_events(cp) == []
    assert '"as_of": 5' in result["messages"][-1].content


def test_accept_is_refused_where_nothing_drifted() -> None:
    """accept on a step waiting for another reason raises InvalidDecision."""
    state = {
        "messages": [
            HumanMessage("x"),
            AIMessage("", tool_calls=[{"name": "charge", "args": {}, "id": "c1"}]),
        ],
        "steps": {"c1": {"tool_call_id": "c1", "status": "awaiting_human", "failure": {}}},
    }

    with pytest.raises(InvalidDecision, match="accept keeps a drifted result"):
        targets(state, tp.Decision(action="accept"))


def test_difference_names_each_changed_field() -> None:
    """The difference is one line per changed path; equal digests mean no drift."""
    old = {"a": 1, "b": {"c": [1, 2]}, "gone": True}
    new = {"a": 1, "b": {"c": [1, 3]}, "new": "x"}
    assert difference(old, new) == ["b.c[1]: 2 → 3", "gone: removed (was true)", 'new: added "x"']
    assert difference("A", "B") == ['result: "A" → "B"']
    recorded = {"digest": result_digest(old), "value": old}
    assert detect_drift(recorded, dict(old)) is None
    assert detect_drift({"result": "x"}, new) is None  # nothing to compare with
    drift = detect_drift(recorded, new, comparator=lambda a, b: 1 / 0)  # raising: a change
    assert drift is not None
    assert drift["previous"] == old


def test_result_drifted_pickles_and_is_data_uncertain() -> None:
    """The error crosses processes intact and is classified for a person."""

    exc = ResultDrifted(tool="t", tool_call_id="c", drift={"difference": ["x: 1 → 2"]}, result=2)
    back = pickle.loads(pickle.dumps(exc))
    assert (back.tool, back.result, str(back)) == ("t", 2, str(exc))
    assert classify(exc).kind is tp.FailureKind.DATA_UNCERTAIN


async def test_async_driver_detects_the_drift_and_accept_continues(tmp_path: Path) -> None:
    """The async act node compares results as the sync one does; adecide accepts."""
    service = PriceService(tmp_path / "prices.json")
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(url) as acp:
        await acp.setup()
        graph = tp.create_recovery_agent(
            TwoCallModel(),
            tools(service),
            checkpointer=acp,
            policies={"get_price": tp.ToolPolicy(confirm_drift=True)},
        )
        with pytest.raises(Crash):
            await graph.ainvoke(
                {"messages": [HumanMessage("price of A")]},
                {"configurable": {"thread_id": THREAD}},
            )
        service.set_price(130)

        stopped = await tp.aresume(graph, THREAD)

        assert "__interrupt__" in stopped
        (request,) = await tp.apending_takeovers(acp)
        assert request.drift is not None
        assert request.drift["difference"] == ["as_of: 1 → 2", "price: 100 → 130"]
        done = await tp.adecide(graph, THREAD, "accept")
        assert '"price": 130' in done["messages"][-1].content
        assert service.count("lookups") == 2


def test_drift_settings_are_validated() -> None:
    """confirm_drift must be a bool and the comparator callable, on policies and tools."""
    with pytest.raises(tp.ConfigurationError, match="confirm_drift"):
        tp.ToolPolicy(confirm_drift="yes")  # type: ignore[arg-type]
    with pytest.raises(tp.ConfigurationError, match="drift_comparator"):
        tp.ToolPolicy(drift_comparator=42)  # type: ignore[arg-type]
    base = StructuredTool.from_function(lambda: "x", name="t", description="t")
    with pytest.raises(tp.ConfigurationError, match="confirm_drift"):
        tp.side_effect(base, confirm_drift=1)  # type: ignore[arg-type]
    assert tp.side_effect(base, confirm_drift=True).spec.confirm_drift is True
