"""``create_recovery_agent``: a ReAct loop whose tool calls survive failures and crashes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.runnables import Runnable, RunnableLambda
from langchain_core.tools import BaseTool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.nodes.executor import RecoveryExecutor
from taskpilots_graph.nodes.think import ThinkNode
from taskpilots_graph.state import RecoveryState

__all__ = ["create_recovery_agent"]


def _route(state: dict[str, Any]) -> str:
    last = state["messages"][-1] if state["messages"] else None
    return "act" if isinstance(last, AIMessage) and last.tool_calls else END


def create_recovery_agent(
    model: BaseChatModel,
    tools: Sequence[BaseTool],
    *,
    checkpointer: RecoveryAPI,
    prompt: str | None = None,
    name: str = "recovery_agent",
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """Build a think → act loop that continues from the right place after any failure.

    The think node asks the model; the act node runs its tool calls, ``@side_effect`` tools
    through the ledger, and records the observations, so the checkpoint after it is the
    recovery anchor. The loop ends when the model answers without tool calls.

    Example:
        >>> with tp.RecoveryCheckpointer.from_conn_string("sqlite:///runs.db") as cp:
        ...     graph = tp.create_recovery_agent(model, [lookup, create_ticket], checkpointer=cp)
        ...     graph.invoke({"messages": [("user", goal)]}, {"configurable": {"thread_id": "t-1"}})
        ... # doctest: +SKIP

    Args:
        model: A chat model supporting ``bind_tools``.
        tools: The tools the model may call.
        checkpointer: A :class:`RecoveryCheckpointer` or :class:`AsyncRecoveryCheckpointer`.
        prompt: Optional system prompt.
        name: The graph's name.

    Raises:
        ConfigurationError: If the checkpointer is not a recovery checkpointer, or tool
            names repeat.
    """
    if not isinstance(checkpointer, RecoveryAPI):
        raise ConfigurationError(
            "create_recovery_agent needs checkpointer=RecoveryCheckpointer(...) or "
            f"AsyncRecoveryCheckpointer(...), got {type(checkpointer).__name__}"
        )
    think = ThinkNode(model, tools, checkpointer=checkpointer, prompt=prompt)
    act = RecoveryExecutor(tools, checkpointer=checkpointer)
    builder = StateGraph(RecoveryState)
    think_node: Runnable[Any, Any] = RunnableLambda(think.invoke, afunc=think.ainvoke, name="think")
    act_node: Runnable[Any, Any] = RunnableLambda(act.invoke, afunc=act.ainvoke, name="act")
    builder.add_node("think", think_node)
    builder.add_node("act", act_node)
    builder.add_edge(START, "think")
    builder.add_conditional_edges("think", _route, ["act", END])
    builder.add_edge("act", "think")
    return builder.compile(checkpointer=checkpointer, name=name)
