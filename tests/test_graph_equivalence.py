"""A graph compiled with a recovery checkpointer runs exactly as with LangGraph's own saver.

The same small graph (a reducer channel, a conditional loop, a node that calls ``interrupt()``
and is resumed with ``Command(resume=...)``) runs once on the plain saver and once on the
wrapped one, each on a database of its own; final state, ``next`` and the whole state history
must match. Checkpoint ids and timestamps differ between the runs by nature and are not compared.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, contextmanager
from contextlib import asynccontextmanager as acm
from pathlib import Path
from typing import Annotated, Any, Literal, TypedDict

import pytest
from _services import create_database, drop_database
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Command, Durability, StateSnapshot, interrupt

from taskpilots_graph import AsyncRecoveryCheckpointer, RecoveryCheckpointer

# (first invoke's output, state when paused, final state, histories by query name)
Run = tuple[dict[str, Any], StateSnapshot, StateSnapshot, dict[str, list[StateSnapshot]]]

THREAD: RunnableConfig = {"configurable": {"thread_id": "equivalence-1"}}
START_INPUT = {"log": ["start"], "count": 0, "approved": None}
FINAL_VALUES = {
    "log": ["start", "plan", "work-0", "work-1", "review-yes", "finish"],
    "count": 2,
    "approved": True,
}


class State(TypedDict):
    log: Annotated[list[str], operator.add]
    count: int
    approved: bool | None


def plan(state: State) -> dict[str, Any]:
    return {"log": ["plan"], "count": 0}


def work(state: State) -> dict[str, Any]:
    return {"log": [f"work-{state['count']}"], "count": state["count"] + 1}


def after_work(state: State) -> Literal["work", "review"]:
    return "work" if state["count"] < 2 else "review"


def review(state: State) -> dict[str, Any]:
    answer = interrupt({"question": "approve?", "count": state["count"]})
    return {"log": [f"review-{answer}"], "approved": answer == "yes"}


def after_review(state: State) -> Literal["finish", "__end__"]:
    return "finish" if state["approved"] else END


def finish(state: State) -> dict[str, Any]:
    return {"log": ["finish"]}


def build(checkpointer: BaseCheckpointSaver[Any]) -> CompiledStateGraph[Any]:
    graph = StateGraph(State)
    graph.add_node("plan", plan)
    graph.add_node("work", work)
    graph.add_node("review", review)
    graph.add_node("finish", finish)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "work")
    graph.add_conditional_edges("work", after_work)
    graph.add_conditional_edges("review", after_review)
    graph.add_edge("finish", END)
    return graph.compile(checkpointer=checkpointer)


def _shape(snapshot: StateSnapshot) -> dict[str, Any]:
    """What two equivalent runs must agree on (ids and timestamps excluded)."""
    return {
        "values": snapshot.values,
        "next": snapshot.next,
        "step": snapshot.metadata["step"] if snapshot.metadata else None,
        "source": snapshot.metadata["source"] if snapshot.metadata else None,
        "has_parent": snapshot.parent_config is not None,
        "tasks": [(t.name, [i.value for i in t.interrupts]) for t in snapshot.tasks],
        "interrupts": [i.value for i in snapshot.interrupts],
    }


def _history_queries(paused: StateSnapshot) -> dict[str, dict[str, Any]]:
    """get_state_history calls to compare: everything, and with limit / before / filter."""
    return {
        "all": {},
        "limit=2": {"limit": 2},
        "before=paused": {"before": paused.config},
        "source=loop": {"filter": {"source": "loop"}},
    }


def _paused_shape(result: dict[str, Any]) -> dict[str, Any]:
    return {**result, "__interrupt__": [i.value for i in result["__interrupt__"]]}


@pytest.fixture
def other_postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A second fresh database, so the plain saver and the wrapped one share nothing."""
    name = f"t_{uuid.uuid4().hex}"
    url = create_database(postgres_admin_url, name)
    yield url
    drop_database(postgres_admin_url, name)


# -- sync -------------------------------------------------------------------------------------

SyncPair = tuple[
    Callable[[], AbstractContextManager[BaseCheckpointSaver[Any]]],
    Callable[[], AbstractContextManager[BaseCheckpointSaver[Any]]],
]


def _sync_pair(backend: str, request: pytest.FixtureRequest) -> SyncPair:
    if backend == "memory":

        @contextmanager
        def plain_memory() -> Iterator[BaseCheckpointSaver[Any]]:
            yield InMemorySaver()

        return plain_memory, lambda: RecoveryCheckpointer.from_conn_string(":memory:")

    if backend == "sqlite":
        tmp_path: Path = request.getfixturevalue("tmp_path")

        @contextmanager
        def plain_sqlite() -> Iterator[BaseCheckpointSaver[Any]]:
            with SqliteSaver.from_conn_string(str(tmp_path / "plain.db")) as saver:
                yield saver

        @contextmanager
        def wrapped_sqlite() -> Iterator[BaseCheckpointSaver[Any]]:
            with RecoveryCheckpointer.from_conn_string(
                f"sqlite:///{tmp_path / 'wrapped.db'}"
            ) as cp:
                cp.setup()
                yield cp

        return plain_sqlite, wrapped_sqlite

    from langgraph.checkpoint.postgres import PostgresSaver

    wrapped_url: str = request.getfixturevalue("postgres_url")
    plain_url: str = request.getfixturevalue("other_postgres_url")

    @contextmanager
    def plain_postgres() -> Iterator[BaseCheckpointSaver[Any]]:
        with PostgresSaver.from_conn_string(plain_url) as saver:
            saver.setup()
            yield saver

    @contextmanager
    def wrapped_postgres() -> Iterator[BaseCheckpointSaver[Any]]:
        with RecoveryCheckpointer.from_conn_string(wrapped_url) as cp:
            cp.setup()
            yield cp

    return plain_postgres, wrapped_postgres


def _run_sync(checkpointer: BaseCheckpointSaver[Any], durability: Durability) -> Run:
    graph = build(checkpointer)
    paused = graph.invoke(START_INPUT, THREAD, durability=durability)
    paused_state = graph.get_state(THREAD)
    graph.invoke(Command(resume="yes"), THREAD, durability=durability)
    histories = {
        name: list(graph.get_state_history(THREAD, **kwargs))
        for name, kwargs in _history_queries(paused_state).items()
    }
    return paused, paused_state, graph.get_state(THREAD), histories


BACKENDS = [
    "memory",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
]
DURABILITIES = ["async", "sync", "exit"]


@pytest.mark.parametrize("durability", DURABILITIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sync_graph_runs_identically(
    backend: str, durability: Durability, request: pytest.FixtureRequest
) -> None:
    """invoke / interrupt / resume give the same state and history wrapped and plain."""
    open_plain, open_wrapped = _sync_pair(backend, request)
    with open_plain() as plain_saver:
        plain = _run_sync(plain_saver, durability)
    with open_wrapped() as wrapped_saver:
        assert isinstance(wrapped_saver, RecoveryCheckpointer)
        wrapped = _run_sync(wrapped_saver, durability)
    _assert_equivalent(plain, wrapped)


# -- async ------------------------------------------------------------------------------------

AsyncPair = tuple[
    Callable[[], AbstractAsyncContextManager[BaseCheckpointSaver[Any]]],
    Callable[[], AbstractAsyncContextManager[BaseCheckpointSaver[Any]]],
]


def _async_pair(backend: str, request: pytest.FixtureRequest) -> AsyncPair:
    if backend == "memory":

        @acm
        async def plain_memory() -> AsyncIterator[BaseCheckpointSaver[Any]]:
            yield InMemorySaver()

        return plain_memory, lambda: AsyncRecoveryCheckpointer.from_conn_string(":memory:")

    if backend == "sqlite":
        tmp_path: Path = request.getfixturevalue("tmp_path")

        @acm
        async def plain_sqlite() -> AsyncIterator[BaseCheckpointSaver[Any]]:
            async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "plain.db")) as saver:
                yield saver

        @acm
        async def wrapped_sqlite() -> AsyncIterator[BaseCheckpointSaver[Any]]:
            async with AsyncRecoveryCheckpointer.from_conn_string(
                f"sqlite:///{tmp_path / 'wrapped.db'}"
            ) as cp:
                await cp.setup()
                yield cp

        return plain_sqlite, wrapped_sqlite

    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    wrapped_url: str = request.getfixturevalue("postgres_url")
    plain_url: str = request.getfixturevalue("other_postgres_url")

    @acm
    async def plain_postgres() -> AsyncIterator[BaseCheckpointSaver[Any]]:
        async with AsyncPostgresSaver.from_conn_string(plain_url) as saver:
            await saver.setup()
            yield saver

    @acm
    async def wrapped_postgres() -> AsyncIterator[BaseCheckpointSaver[Any]]:
        async with AsyncRecoveryCheckpointer.from_conn_string(wrapped_url) as cp:
            await cp.setup()
            yield cp

    return plain_postgres, wrapped_postgres


async def _run_async(checkpointer: BaseCheckpointSaver[Any], durability: Durability) -> Run:
    graph = build(checkpointer)
    paused = await graph.ainvoke(START_INPUT, THREAD, durability=durability)
    paused_state = await graph.aget_state(THREAD)
    await graph.ainvoke(Command(resume="yes"), THREAD, durability=durability)
    histories = {
        name: [snapshot async for snapshot in graph.aget_state_history(THREAD, **kwargs)]
        for name, kwargs in _history_queries(paused_state).items()
    }
    return paused, paused_state, await graph.aget_state(THREAD), histories


@pytest.mark.parametrize("durability", DURABILITIES)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_async_graph_runs_identically(
    backend: str, durability: Durability, request: pytest.FixtureRequest
) -> None:
    """ainvoke / interrupt / resume give the same state and history wrapped and plain."""
    open_plain, open_wrapped = _async_pair(backend, request)
    async with open_plain() as plain_saver:
        plain = await _run_async(plain_saver, durability)
    async with open_wrapped() as wrapped_saver:
        assert isinstance(wrapped_saver, AsyncRecoveryCheckpointer)
        wrapped = await _run_async(wrapped_saver, durability)
    _assert_equivalent(plain, wrapped)


# -- comparison -------------------------------------------------------------------------------


def _assert_equivalent(
    plain: Run,
    wrapped: Run,
) -> None:
    plain_paused, plain_paused_state, plain_final, plain_histories = plain
    wrapped_paused, wrapped_paused_state, wrapped_final, wrapped_histories = wrapped

    # The run really paused in review and really finished: equal-but-broken is not a pass.
    assert plain_paused_state.next == ("review",)
    assert plain_final.values == FINAL_VALUES
    assert plain_final.next == ()

    assert _paused_shape(wrapped_paused) == _paused_shape(plain_paused)
    assert _shape(wrapped_paused_state) == _shape(plain_paused_state)
    assert wrapped_final.values == plain_final.values
    assert wrapped_final.next == plain_final.next
    assert plain_histories["all"], "no history recorded"
    assert wrapped_histories.keys() == plain_histories.keys()
    for query, plain_history in plain_histories.items():
        wrapped_history = wrapped_histories[query]
        assert len(wrapped_history) == len(plain_history), f"history({query}) length"
        for i, (w, p) in enumerate(zip(wrapped_history, plain_history, strict=True)):
            assert _shape(w) == _shape(p), f"history({query})[{i}] differs"
