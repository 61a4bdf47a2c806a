"""The takeover node: stop, show a person what happened, and act on their decision.

It calls LangGraph's ``interrupt()`` with the steps waiting on a person (tool, arguments,
failure, what is already committed), and continues with the answer: ``retry`` runs those
steps again, ``skip`` answers them with a note and lets the model continue, ``abandon``
compensates the committed effects and ends the run. Everything before ``interrupt()`` is
safe to run again (it only reads), since LangGraph re-runs the node when it resumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.types import Command, interrupt

from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import EventKind
from taskpilots_graph.nodes._context import run_context
from taskpilots_graph.nodes.executor import error_message, pending_calls
from taskpilots_graph.state import StepRecord

__all__ = ["TAKEOVER_ACTIONS", "TakeoverNode"]

TAKEOVER_ACTIONS = ("retry", "skip", "abandon")


class TakeoverNode:
    """Pauses the run on an interrupt until a person decides."""

    def __init__(self, *, checkpointer: RecoveryAPI) -> None:
        self.checkpointer = checkpointer

    @staticmethod
    def request(state: Mapping[str, Any], thread_id: str) -> dict[str, Any]:
        """What the person is shown."""
        steps: Mapping[str, StepRecord] = state.get("steps") or {}
        flow = state.get("flow") or {}
        waiting = [dict(r) for r in steps.values() if r.get("status") == "awaiting_human"]
        return {
            "type": "takeover",
            "thread_id": thread_id,
            "reason": flow.get("reason"),
            "steps": waiting,
            "committed": list(flow.get("committed", [])),
            "options": list(TAKEOVER_ACTIONS),
        }

    def _apply(self, state: Mapping[str, Any], answer: Any) -> Command[str]:
        action = answer.get("action") if isinstance(answer, Mapping) else answer
        if action not in TAKEOVER_ACTIONS:
            raise ConfigurationError(
                f"takeover decision must be one of {TAKEOVER_ACTIONS}, got {answer!r}"
            )
        steps: Mapping[str, StepRecord] = state.get("steps") or {}
        _, calls = pending_calls(state["messages"])
        waiting = [
            c for c in calls if (steps.get(c["id"] or "") or {}).get("status") == "awaiting_human"
        ]
        flow = {
            "stage": "running",
            "takeover": False,
            "reason": None,
            "signatures": {},
            "budget_from": len(state["messages"]),
        }
        if action == "retry":
            reset: dict[str, StepRecord] = {
                c["id"] or "": {
                    "status": "running",
                    "attempts": 0,
                    "first_failed_at": None,
                    "retry_at": None,
                }
                for c in waiting
            }
            return Command(goto="act", update={"steps": reset, "flow": flow})
        if action == "skip":
            closed: dict[str, StepRecord] = {c["id"] or "": {"status": "closed"} for c in waiting}
            messages = [
                error_message(c, "Skipped by a person; do not call it again.") for c in waiting
            ]
            return Command(
                goto="think", update={"steps": closed, "messages": messages, "flow": flow}
            )
        return Command(goto="compensate", update={"flow": {"stage": "compensating"}})

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Ask and apply the answer."""
        ctx = run_context(config)
        answer = interrupt(self.request(state, ctx.thread_id))
        self.checkpointer.append_event(
            ctx.thread_id, EventKind.DECISION_RECORDED, {"decision": answer}
        )
        return self._apply(state, answer)

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Async form of :meth:`invoke`."""
        ctx = run_context(config)
        answer = interrupt(self.request(state, ctx.thread_id))
        command = self._apply(state, answer)
        await self.checkpointer.aappend_event(
            ctx.thread_id, EventKind.DECISION_RECORDED, {"decision": answer}
        )
        return command
