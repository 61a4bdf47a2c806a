"""The tools of a graph, found where its nodes look them up (one way, for every caller).

The drills swap tools in these tables, the takeover inbox describes a pending call's tool,
and settling unfinished work asks an orphan intent's tool for its pre-check. The recovery
executor holding a graph's tools is found here too, from the objects its nodes run.
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import BaseTool

from taskpilots_graph.nodes.executor import RecoveryExecutor

__all__ = ["find_executor", "graph_tools", "node_owner", "tool_tables"]


def node_owner(runnable: Any) -> Any:
    """The object whose bound method a graph node runs (our node classes), or ``None``."""
    func = getattr(runnable, "func", None) or getattr(runnable, "afunc", None) or runnable
    return getattr(func, "__self__", None)


def find_executor(graph: Any) -> RecoveryExecutor | None:
    """The recovery executor of a graph (compiled or builder), if it has one."""
    builder = getattr(graph, "builder", graph)
    for spec in getattr(builder, "nodes", {}).values():
        if isinstance(owner := node_owner(spec.runnable), RecoveryExecutor):
            return owner
    return None


def tool_tables(graph: Any) -> list[dict[str, BaseTool]]:
    """The name → tool tables the graph's nodes look tools up in at call time (the live
    dicts: a drill swaps tools in them and restores them after)."""
    from langgraph.prebuilt import ToolNode

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
