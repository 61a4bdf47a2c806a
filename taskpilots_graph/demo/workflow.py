"""The ticket-batch workflow: its tools, the recovery agent, and plain LangGraph for contrast."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from taskpilots_graph.agent import create_recovery_agent
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.checkpointers.density import Density
from taskpilots_graph.demo.services import Services
from taskpilots_graph.ledger import Done, NotDone, PrecheckOutcome
from taskpilots_graph.tools import invocation_key, side_effect

__all__ = ["build_plain_graph", "build_recovery_agent", "build_tools", "plain_react_graph"]

PROMPT = "You handle support tickets: look up the customer, tag, open a ticket, reply, refund."


def build_tools(services: Services) -> dict[str, BaseTool]:
    """The six tools of the workflow, undecorated (plain LangGraph uses them as they are)."""
    # Under the recovery executor every side effect has an invocation key, which the
    # services take as their idempotency / search key. Plain LangGraph has none.

    def crm_lookup(customer_id: str) -> dict[str, str]:
        """Look up a customer in the CRM."""
        return services.crm_lookup(customer_id)

    def crm_tag(customer_id: str, tag: str) -> str:
        """Tag a customer record in the CRM."""
        return services.crm_tag(customer_id, tag, invocation_key())

    def create_ticket(customer_id: str, order_id: str, subject: str) -> str:
        """Open a help-desk ticket for an order."""
        return services.create_ticket(f"{order_id}:ticket", subject, invocation_key())

    def send_email(to: str, order_id: str, subject: str) -> str:
        """Email the customer about their order."""
        return services.send_email(f"{order_id}:email", to, subject, invocation_key())

    def request_approval(order_id: str, amount: float) -> str:
        """Ask a manager to approve a refund."""
        return services.request_approval(f"{order_id}:approval", amount, invocation_key())

    def issue_refund(order_id: str, amount: float) -> str:
        """Refund an order through the payment provider."""
        return services.issue_refund(f"{order_id}:refund", amount, invocation_key())

    fns: list[Callable[..., Any]] = [
        crm_lookup,
        crm_tag,
        create_ticket,
        send_email,
        request_approval,
        issue_refund,
    ]
    return {fn.__name__: StructuredTool.from_function(fn) for fn in fns}


def _found(record: dict[str, Any] | None) -> PrecheckOutcome:
    """A pre-check's answer from the effect a service found (``None``: none)."""
    return Done(record["id"], proof=record) if record is not None else NotDone()


def recovery_tools(services: Services) -> list[BaseTool]:
    """The same tools, each side effect declared with the guarantee its service allows."""
    t = build_tools(services)
    return [
        t["crm_lookup"],
        side_effect(t["crm_tag"], idempotent=True),
        side_effect(
            t["create_ticket"], precheck=lambda key, _args: _found(services.find_ticket(key))
        ),
        side_effect(t["send_email"], precheck=lambda key, _args: _found(services.find_email(key))),
        # Approvals cannot be searched: an interrupted request becomes a human decision.
        side_effect(t["request_approval"]),
        side_effect(
            t["issue_refund"], idempotent=True, key=lambda args: f"refund:{args['order_id']}"
        ),
    ]


def build_recovery_agent(
    model: BaseChatModel,
    services: Services,
    checkpointer: RecoveryAPI,
    *,
    checkpoint_density: Density = "every_step",
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The workflow on :func:`~taskpilots_graph.create_recovery_agent`."""
    return create_recovery_agent(
        model,
        recovery_tools(services),
        checkpointer=checkpointer,
        prompt=PROMPT,
        checkpoint_density=checkpoint_density,
    )


def build_plain_graph(
    model: BaseChatModel, services: Services, checkpointer: BaseCheckpointSaver[Any]
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The same workflow as a textbook LangGraph ReAct loop (model node + ``ToolNode``)."""
    return plain_react_graph(model, list(build_tools(services).values()), checkpointer)


def plain_react_graph(
    model: BaseChatModel, tools: list[BaseTool], checkpointer: BaseCheckpointSaver[Any]
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The textbook LangGraph ReAct loop (model node + ``ToolNode``): the plain baseline of
    the drills and benchmarks."""
    bound = model.bind_tools(tools)

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [bound.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode(tools, handle_tool_errors=True))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer)
