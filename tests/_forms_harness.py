"""The two agent forms, built alike for one scenario, and what a run of them left behind.

Shared by ``test_agent_forms_diff.py`` and its crash worker ``_forms_worker.py``: both build
the agent of a form from a :class:`Scenario` the same way, and read the same
:class:`Outcome` (service-side call counts, the ledger, the thread's event kinds).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from _forms_world import World, world_tools
from _models import ScriptedChatModel
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, BaseMessage

import taskpilots_graph as tp
from taskpilots_graph.events import Event
from taskpilots_graph.ledger import LedgerEntry
from taskpilots_graph.middleware import RecoveryMiddleware
from taskpilots_graph.testing import answered_calls

__all__ = [
    "FORMS",
    "KILLED",
    "BatchPlanModel",
    "Outcome",
    "Scenario",
    "aoutcome",
    "build",
    "outcome",
]

FORMS = ("recovery agent", "middleware")

Call = tuple[str, dict[str, Any]]


class BatchPlanModel(ScriptedChatModel):
    """Calls the planned batches of tools (one model message per batch), then answers.

    Like ``_models.PlanModel`` it decides from the conversation alone: it counts the tool
    calls answered since the user's message and asks for the batch that comes next, every
    call with a fresh random id.
    """

    plan: list[list[Call]]

    def decide(self, messages: list[BaseMessage]) -> AIMessage:
        answered = answered_calls(messages)
        for batch in self.plan:
            if answered < len(batch):
                calls = [
                    {"name": name, "args": dict(args), "id": f"call_{uuid.uuid4().hex[:12]}"}
                    for name, args in batch
                ]
                return AIMessage("", tool_calls=calls)
            answered -= len(batch)
        return AIMessage("done")


@dataclass(frozen=True)
class Scenario:
    """The model's plan, the tools it gets, how the service behaves, what a person answers."""

    plan: list[list[Call]]
    tools: tuple[str, ...]
    script: dict[str, tuple[str, ...]] = field(default_factory=dict)
    policies: dict[str, tp.ToolPolicy] = field(default_factory=dict)
    decisions: tuple[tp.Decision, ...] = ()
    """A person's answers, in order, to the takeovers the run stops on."""
    after_crash: Callable[[World], None] | None = None
    """What changes in the service while the crashed run is down (before it is resumed)."""


KILLED = Scenario(
    plan=[
        [("book_courier", {"order": "K-1"})],
        [("checked_refund", {"order": "K-1", "amount": 9})],
    ],
    tools=("book_courier", "checked_refund"),
    script={"checked_refund": ("kill",)},
)
"""The crash drill: the process is SIGKILLed right after the refund reached the payment
service, before it heard the answer; a fresh process resumes the thread (the service can be
searched by request key, so the refund is settled without running again)."""


def build(
    form: str, scenario: Scenario, cp: Any, world: World, model: BatchPlanModel | None = None
) -> Any:
    """The agent of ``form``: same model, tools, policies and checkpointer in both.

    ``model`` (default: a fresh one for the scenario's plan) lets a test read the inputs
    the model received.
    """
    every = world_tools(world)
    tools = [every[name] for name in scenario.tools]
    model = model or BatchPlanModel(plan=scenario.plan)
    if form == "recovery agent":
        return tp.create_recovery_agent(model, tools, checkpointer=cp, policies=scenario.policies)
    middleware = RecoveryMiddleware(cp, policies=scenario.policies)
    return create_agent(model, tools, checkpointer=cp, middleware=[middleware])


@dataclass(frozen=True)
class Outcome:
    """What a run left behind, with nothing that is random per run (keys, ids, times)."""

    calls: dict[str, int]
    ledger: list[dict[str, Any]]
    events: list[Event]


def _ledger(entries: list[LedgerEntry]) -> list[dict[str, Any]]:
    # Keys and tool-call ids are random per run (the model's ids are): entries are compared
    # by what they are about and where they stand, in a stable order.
    rows = [
        {
            "tool": e.tool,
            "args": dict(e.args),
            "status": e.status.value,
            "attempt": e.attempt,
            "result": e.result,
            "error": None if e.error is None else e.error.get("type"),
        }
        for e in entries
    ]
    return sorted(rows, key=lambda e: json.dumps(e, sort_keys=True, default=str))


def outcome(cp: tp.RecoveryCheckpointer, thread_id: str, world: World) -> Outcome:
    """What the run of ``thread_id`` left in the service and the checkpointer."""
    return Outcome(world.counts(), _ledger(cp.ledger(thread_id)), cp.events(thread_id))


async def aoutcome(cp: tp.AsyncRecoveryCheckpointer, thread_id: str, world: World) -> Outcome:
    """:func:`outcome`, read through the async checkpointer."""
    ledger = _ledger(await cp.aledger(thread_id))
    return Outcome(world.counts(), ledger, await cp.aevents(thread_id))
