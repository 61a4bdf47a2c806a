"""The framework internals ``taskpilots_graph._compat`` reads, pinned on the installed
LangGraph / langchain: a release that moves one fails here, by name, instead of silently
turning a guard off (each function degrades to a safe answer when what it reads is gone).
"""

from __future__ import annotations

import asyncio
import operator
from typing import Annotated, Any, TypedDict

import pytest
from _models import PlanModel, ScriptedChatModel
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ToolRetryMiddleware
from langchain.agents.middleware.tool_error import ToolErrorMiddleware
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.config import get_config
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from taskpilots_graph._compat import (
    answers_waiting,
    create_agent_arguments,
    middleware_chain,
    node_runnable,
    task_checkpointer,
    task_durability,
    task_id,
    tool_filter,
)


class _State(TypedDict):
    seen: Annotated[list[Any], operator.add]


def _graph(node: Any, saver: InMemorySaver) -> Any:
    builder = StateGraph(_State)
    builder.add_node("node", node)
    builder.add_edge(START, "node")
    builder.add_edge("node", END)
    return builder.compile(checkpointer=saver)


def test_answers_waiting_counts_the_answers_a_resumed_task_will_get() -> None:
    observed: list[int] = []

    def node(state: _State) -> dict[str, Any]:
        observed.append(answers_waiting(get_config()))  # at the task's start, as used
        first = interrupt("first?")
        second = interrupt("second?")
        return {"seen": [first, second]}

    graph = _graph(node, InMemorySaver())
    config: Any = {"configurable": {"thread_id": "t"}}
    graph.invoke({"seen": []}, config)
    assert observed == [0]  # a fresh task: nobody answered anything yet
    graph.invoke(Command(resume="a"), config)
    assert observed == [0, 1]  # the first question's answer waits; the second pauses
    result = graph.invoke(Command(resume="b"), config)
    assert result["seen"] == ["a", "b"]
    assert observed == [0, 1, 2]


@pytest.mark.parametrize("mode", ["sync", "async", "exit"])
def test_task_durability_and_checkpointer_are_the_runs(mode: Any) -> None:
    found: list[Any] = []
    saver = InMemorySaver()

    def node(state: _State) -> dict[str, Any]:
        config = get_config()
        found.append((task_durability(config), task_checkpointer(config)))
        return {"seen": [1]}

    _graph(node, saver).invoke({"seen": []}, {"configurable": {"thread_id": "t"}}, durability=mode)
    assert found == [(mode, saver)]


def test_task_id_is_the_id_the_tasks_writes_are_stored_under() -> None:
    # A held ledger commit rides the put_writes of the task whose id this returns.
    ids: list[str | None] = []
    saver = InMemorySaver()

    def node(state: _State) -> dict[str, Any]:
        ids.append(task_id(get_config()))
        interrupt("a question")  # the task's writes stay pending, under its id
        return {"seen": [1]}

    config: Any = {"configurable": {"thread_id": "t"}}
    _graph(node, saver).invoke({"seen": []}, config)
    saved = saver.get_tuple(config)
    assert saved is not None
    assert ids
    assert ids[0] is not None
    assert {task for task, _, _ in saved.pending_writes or []} == {ids[0]}


def test_outside_langgraph_the_answers_are_the_cautious_ones() -> None:
    assert answers_waiting({}) == 0
    assert task_durability({}) == "async"
    assert task_checkpointer({}) is None
    assert task_id({}) is None
    assert create_agent_arguments() is None


@tool
def lookup(q: str) -> str:
    """Look something up."""
    return f"found {q}"


class _Probe(AgentMiddleware[Any, Any, Any]):
    """Records what ``_compat`` recovers from inside ``create_agent`` and at a tool call."""

    def __init__(self) -> None:
        super().__init__()
        self.arguments: tuple[list[Any], list[Any]] | None = None
        self.chains: list[list[Any] | None] = []

    @property
    def tools(self) -> list[BaseTool]:  # type: ignore[override]
        self.arguments = create_agent_arguments()
        return []

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        self.chains.append(middleware_chain(handler, is_async=False))
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        self.chains.append(middleware_chain(handler, is_async=True))
        return await handler(request)


class _Outer(AgentMiddleware[Any, Any, Any]):
    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        return await handler(request)


def _agent(model: ScriptedChatModel) -> tuple[Any, list[Any], _Probe]:
    probe = _Probe()
    middleware = [
        _Outer(),
        probe,
        ToolRetryMiddleware(max_retries=1, tools=["lookup"]),
    ]
    agent = create_agent(model, [lookup], middleware=middleware, checkpointer=InMemorySaver())
    return agent, middleware, probe


def test_create_agent_arguments_are_read_while_the_agent_is_built() -> None:
    _, middleware, probe = _agent(PlanModel(plan=[]))
    assert probe.arguments is not None
    seen_middleware, seen_tools = probe.arguments
    assert seen_middleware == middleware
    assert seen_tools == [lookup]


@pytest.mark.parametrize("is_async", [False, True])
async def test_the_tool_call_chain_is_recovered_outermost_first(is_async: bool) -> None:
    agent, middleware, probe = _agent(PlanModel(plan=[("lookup", {"q": "x"})]))
    config: Any = {"configurable": {"thread_id": f"chain-{is_async}"}}
    question: list[BaseMessage] = [HumanMessage("go")]
    if is_async:
        result = await agent.ainvoke({"messages": question}, config)
    else:
        result = agent.invoke({"messages": question}, config)
    assert isinstance(result["messages"][-1], AIMessage)
    assert probe.chains == [middleware]


def test_tool_filters_of_langchains_retry_and_error_middleware() -> None:
    assert tool_filter(ToolRetryMiddleware(tools=["a", "b"])) == ["a", "b"]
    assert tool_filter(ToolRetryMiddleware(tools=[lookup])) == ["lookup"]
    assert tool_filter(ToolRetryMiddleware()) is None

    def on_error(exc: Exception, request: Any) -> str:
        return str(exc)

    assert tool_filter(ToolErrorMiddleware(on_error=on_error, tools=["a"])) == ["a"]
    assert tool_filter(ToolErrorMiddleware(on_error=on_error)) is None


def test_node_runnable_runs_each_face_once_per_call() -> None:
    calls: list[str] = []

    def invoke(state: _State) -> dict[str, Any]:
        calls.append("sync")
        return {"seen": [1]}

    async def ainvoke(state: _State) -> dict[str, Any]:
        calls.append("async")
        return {"seen": [2]}

    builder: StateGraph[_State] = StateGraph(_State)
    builder.add_node("n", node_runnable(invoke, ainvoke, "n"))
    builder.add_edge(START, "n")
    builder.add_edge("n", END)
    graph = builder.compile()
    assert graph.invoke({"seen": []})["seen"] == [1]
    assert asyncio.run(graph.ainvoke({"seen": []}))["seen"] == [2]
    assert calls == ["sync", "async"]
