"""The tools of a graph, found where its nodes look them up (one way, for every caller).

The drills swap tools in these tables, the takeover inbox describes a pending call's tool,
and settling unfinished work asks an orphan intent's tool for its pre-check.
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import BaseTool

__all__ = ["graph_tools", "tool_tables"]


def tool_tables(graph: Any) -> list[dict[str, BaseTool]]:
    """The name → tool tables the graph's nodes look tools up in at call time (the live
    dicts: a drill swaps tools in them and restores them after)."""
    from langgraph.prebuilt import ToolNode

    from taskpilots_graph.agent import find_executor

    tables: list[dict[str, BaseTool]] = []
    executor = find_executor(graph)
    if executor is not None:
        tables.append(executor.tools)
    for spec in getattr(getattr(graph, "builder", None), "nodes", {}).values():
        if isinstance(spec.runnable, ToolNode):
            tables.append(spec.runnable.tools_by_name)
    return tables


def graph_tools(graph: Any) -> dict[str, BaseTool]:
    """Every tool of ``graph`` by name: the recovery executor's, and those of its LangGraph
    ``ToolNode`` nodes (``tp.ToolNode``, ``create_agent``'s tools node)."""
    return {name: tool for table in tool_tables(graph) for name, tool in table.items()}
