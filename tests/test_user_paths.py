"""The paths users and models take, end to end, in both agent forms.

A model that decides only from its conversation (``_pharmacy.ConversationModel``) runs a
four-step pharmacy workflow with the default settings, on SQLite and PostgreSQL, through
``create_recovery_agent`` and through langchain's ``create_agent`` + ``RecoveryMiddleware``.
Whatever the model re-plans after earlier turns leave its view, the pharmacy (its own
SQLite file) performs each effect once.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langgraph.errors import GraphRecursionError

import taskpilots_graph as tp
from taskpilots_graph.middleware import RecoveryMiddleware

sys.path.insert(0, str(Path(__file__).parent))
from _pharmacy import PLAN, ConversationModel, Pharmacy, pharmacy_tools, tool_answers

FORMS = ["recovery_agent", "create_agent"]


@pytest.fixture
def pharmacy(tmp_path: Path) -> Pharmacy:
    return Pharmacy(str(tmp_path / "pharmacy.db"))


def build(form: str, model: ConversationModel, cp: Any, pharmacy: Pharmacy) -> Any:
    tools = pharmacy_tools(pharmacy)
    if form == "recovery_agent":
        return tp.create_recovery_agent(model, tools, checkpointer=cp)
    return create_agent(model, tools, checkpointer=cp, middleware=[RecoveryMiddleware(cp)])


def run(entry: str, agent: Any, thread_id: str, text: str) -> None:
    """One user message, through ``tp.run`` or LangGraph's own ``invoke`` / ``stream``."""
    config: Any = {"recursion_limit": 60}
    message = {"messages": [("user", text)]}
    if entry == "tp.run":
        tp.run(agent, thread_id, message, config=config)
        return
    config["configurable"] = {"thread_id": thread_id}
    if entry == "stream":
        for _ in agent.stream(message, config):
            pass
        return
    agent.invoke(message, config)


@pytest.mark.parametrize("entry", ["invoke", "stream", "tp.run"])
@pytest.mark.parametrize("form", FORMS)
def test_a_model_reading_only_its_conversation_performs_each_effect_once(
    form: str, entry: str, cp: Any, pharmacy: Pharmacy
) -> None:
    model = ConversationModel(plan=PLAN)
    agent = build(form, model, cp, pharmacy)
    # A run that stops (stuck, a person asked) is fine here; a repeated effect is not. The
    # same command twice: the second meets the first's committed effects.
    for _ in range(2):
        with contextlib.suppress(tp.TaskPilotsError, GraphRecursionError):
            run(entry, agent, f"rx-{form}", "fill the prescription of p-7")
    counts = {s: pharmacy.count(s) for s in ("dispense", "charge", "message")}
    # A model that re-plans a step it already took meets the ledger, which answers the
    # repeat instead of the pharmacy.
    assert counts["dispense"] == 1
    assert max(counts.values()) == 1, counts
    # No entry is left unsettled.
    assert all(str(e.status) == "committed" for e in cp.ledger(f"rx-{form}"))
    # Every repeat the model asked for was answered with what happened the first time.
    for conversation in model.inputs:
        for text in tool_answers(conversation).get("dispense", []):
            assert "label #1" in text
