"""A graph you would build yourself (model node + tool node), for the ``tp.ToolNode`` tests.

Run as ``python tests/_toolnode_worker.py MODE ACTION DB SERVICES THREAD`` where ``MODE`` is
``ours`` (``tp.ToolNode`` with the ``@tp.side_effect`` tool) or ``plain`` (LangGraph's own
``ToolNode`` with the undecorated tool), and ``ACTION`` is ``start`` or ``resume``. It prints
one JSON line: the last message of the run.

The tool opens a help-desk ticket in the simulated services (their own SQLite file); a kill
point planted in the services SIGKILLs the worker right after the ticket is written, before
the node can record it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from langchain_core.tools import BaseTool, tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import taskpilots_graph as tp
from taskpilots_graph.demo.services import Services

sys.path.insert(0, str(Path(__file__).parent))
from _models import PlanModel


def ticket_tools(services: Services) -> tuple[BaseTool, BaseTool]:
    """``open_ticket`` undecorated, and declared with a pre-check by request key."""

    @tool
    def open_ticket(subject: str) -> str:
        """Open a help-desk ticket."""
        try:
            key: str | None = tp.current_invocation().key
        except tp.ConfigurationError:
            key = None  # LangGraph's own ToolNode: no ledger, no key
        return services.create_ticket(subject, subject, key)

    def find(key: str, args: dict[str, Any]) -> tp.Done | tp.NotDone:
        found = services.find_ticket(key)
        return tp.NotDone() if found is None else tp.Done(found["id"], proof=found)

    return open_ticket, tp.side_effect(open_ticket, precheck=find)


def build_graph(tools_node: Any, cp: Any, *, tickets: int = 1) -> Any:
    """The textbook loop: the model decides, the tool node acts, back to the model.

    The model plans ``tickets`` identical ``open_ticket`` calls (more than one: a model
    that re-plans an effect it lost sight of).
    """
    model = PlanModel(plan=[("open_ticket", {"subject": "$msg"})] * tickets)
    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", tools_node)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=cp)


def main(argv: list[str]) -> int:
    mode, action, db, services_path, thread_id = argv
    services = Services(services_path, latency_s=0)
    plain, declared = ticket_tools(services)
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{db}") as cp:
        cp.setup()
        if mode == "ours":
            graph = build_graph(tp.ToolNode([declared]), cp)
        elif mode == "plain":
            graph = build_graph(ToolNode([plain]), cp)
        else:
            raise SystemExit(f"unknown mode {mode!r}; use 'ours' or 'plain'")
        if action == "start":
            config = {"configurable": {"thread_id": thread_id}}
            out = graph.invoke({"messages": [("user", thread_id)]}, config)
        else:
            out = tp.resume(graph, thread_id)
    last = out["messages"][-1]
    print(json.dumps({"type": last.type, "content": str(last.content)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
