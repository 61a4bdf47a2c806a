"""One tool-call engine for both agent forms: a person's answer is applied the same way.

A read whose credentials are refused (a user rule classifies the error as ``AUTH``) stops
for a person. ``create_recovery_agent`` applies the answer in its takeover node and calls
the tool again only for ``retry``; ``create_agent`` + ``RecoveryMiddleware`` re-runs the
tool task from its first line when the answer comes, and must go straight back to the
question (from the log) instead of calling the tool again first. The service counts the
calls it receives; each form runs on its own SQLite file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _models import PlanModel
from langchain.agents import create_agent
from langchain_core.tools import StructuredTool

import taskpilots_graph as tp
from taskpilots_graph.events import EventKind
from taskpilots_graph.middleware import RecoveryMiddleware

FORMS = ["create_recovery_agent", "create_agent+RecoveryMiddleware"]


class Locked(Exception):
    """The badge service refused the credentials."""


class BadgeService:
    """Counts the reads it receives; refuses every one."""

    def __init__(self) -> None:
        self.calls = 0

    def read(self, who: str) -> str:
        self.calls += 1
        raise Locked(f"badge of {who}: credentials refused")


def _agent(form: str, cp: Any, service: BadgeService) -> Any:
    tools = [StructuredTool.from_function(service.read, name="read_badge", description="badge")]
    model = PlanModel(plan=[("read_badge", {"who": "ada"})])
    policies = {"read_badge": tp.ToolPolicy(rules=[(Locked, tp.FailureKind.AUTH)])}
    if form == "create_recovery_agent":
        return tp.create_recovery_agent(model, tools, checkpointer=cp, policies=policies)
    return create_agent(
        model, tools, checkpointer=cp, middleware=[RecoveryMiddleware(cp, policies=policies)]
    )


def _decisions(cp: Any, thread: str) -> list[str]:
    return [
        e.payload["decision"]["action"]
        for e in cp.events(thread)
        if e.kind is EventKind.DECISION_RECORDED
    ]


@pytest.fixture
def paused(form: str, tmp_path: Path) -> Iterator[tuple[Any, Any, BadgeService]]:
    """(checkpointer, agent, service) of thread "t", paused on the refused read's takeover."""
    service = BadgeService()
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{tmp_path}/runs.db") as cp:
        agent = _agent(form, cp, service)
        asked = agent.invoke(
            {"messages": [("user", "badge of ada")]}, {"configurable": {"thread_id": "t"}}
        )
        assert "__interrupt__" in asked
        assert service.calls == 1  # AUTH: a person decides at once, no retry
        yield cp, agent, service


@pytest.mark.parametrize("form", FORMS)
def test_an_answer_is_applied_without_calling_the_tool_again(
    paused: tuple[Any, Any, BadgeService],
) -> None:
    cp, agent, service = paused
    done = tp.decide(agent, "t", tp.Decision(action="skip"))
    assert done["messages"][-1].content == "done"
    assert service.calls == 1  # skipped: the service is not asked again
    assert _decisions(cp, "t") == ["skip"]


@pytest.mark.parametrize("form", FORMS)
def test_each_answer_of_a_task_is_applied_once(paused: tuple[Any, Any, BadgeService]) -> None:
    cp, agent, service = paused
    again = tp.decide(agent, "t", tp.Decision(action="retry"))
    assert "__interrupt__" in again  # the approved retry was refused too
    assert service.calls == 2  # the first call and the approved retry, nothing more
    done = tp.decide(agent, "t", tp.Decision(action="skip"))
    assert done["messages"][-1].content == "done"
    assert service.calls == 2
    assert _decisions(cp, "t") == ["retry", "skip"]
