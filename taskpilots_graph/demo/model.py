"""A scripted chat model that handles a support ticket like an LLM agent would, offline.

It decides from the conversation alone (which tool results are already in the messages), not
from a call counter, so it behaves the same after a resume in a fresh process. Like a real
model it gives every tool call a new random id: asking it again for the same step yields a
new id, which is exactly what makes naive re-execution create duplicate side effects.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from taskpilots_graph.testing import _ConversationModel

__all__ = ["MAX_TOOL_ERRORS", "ScriptedTicketModel", "next_action"]

_EARLIER = re.compile(r"^- (\w+)\(.*\) -> (ok|failed): (.*)$", re.MULTILINE)

MAX_TOOL_ERRORS = 3
"""After this many failed calls of one step, the model gives up on the ticket."""


def _plan(ticket: dict[str, Any]) -> list[str]:
    steps = ["crm_lookup", "crm_tag", "create_ticket", "send_email"]
    if ticket.get("refund", 0) > 0:
        steps += ["request_approval", "issue_refund"]
    return steps


def _args(step: str, ticket: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    order, customer = ticket["order_id"], ticket["customer_id"]
    if step == "crm_lookup":
        return {"customer_id": customer}
    if step == "crm_tag":
        return {"customer_id": customer, "tag": "support-case"}
    if step == "create_ticket":
        return {"customer_id": customer, "order_id": order, "subject": ticket["subject"]}
    if step == "send_email":
        email = json.loads(results["crm_lookup"])["email"]
        return {"to": email, "order_id": order, "subject": f"Re: {ticket['subject']}"}
    return {"order_id": order, "amount": ticket["refund"]}


def next_action(messages: Sequence[BaseMessage]) -> AIMessage:
    """The next message of the scripted agent for this conversation."""
    first = next(m for m in messages if isinstance(m, HumanMessage))
    ticket = json.loads(str(first.content))
    results: dict[str, Any] = {}
    errors: dict[str, int] = {}
    for m in messages:
        if isinstance(m, SystemMessage):
            # Steps that left the agent's memory window are listed in the system prompt.
            for tool, status, result in _EARLIER.findall(str(m.content)):
                if status == "failed":
                    errors[tool] = errors.get(tool, 0) + 1
                else:
                    results[tool] = result
        elif isinstance(m, ToolMessage) and m.name:
            if m.status == "error":
                errors[m.name] = errors.get(m.name, 0) + 1
            else:
                results[m.name] = m.content
    for step in _plan(ticket):
        if step in results:
            continue
        if errors.get(step, 0) >= MAX_TOOL_ERRORS:
            return AIMessage(f"Ticket {ticket['ticket_id']} not closed: {step} kept failing.")
        call_id = f"call_{uuid.uuid4().hex[:16]}"
        return AIMessage(
            "",
            tool_calls=[{"name": step, "args": _args(step, ticket, results), "id": call_id}],
        )
    return AIMessage(f"Ticket {ticket['ticket_id']} closed.")


class ScriptedTicketModel(_ConversationModel):
    """Offline, deterministic-by-conversation stand-in for a tool-calling chat model."""

    @property
    def _llm_type(self) -> str:
        return "scripted-ticket-agent"

    def _next(self, messages: list[BaseMessage]) -> AIMessage:
        return next_action(messages)
