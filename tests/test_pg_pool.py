"""Over a pool, one sync checkpointer serves several threads at once.

LangGraph's sync ``PostgresSaver`` serialises every call on a per-instance lock, which a
worker running several threads on one checkpointer (``--concurrency > 1``) would feel as a
single connection. Here a write is held up inside PostgreSQL while other threads read and
write other threads' checkpoints through the same checkpointer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from langgraph.graph import END, START, StateGraph
from psycopg.rows import dict_row
from typing_extensions import TypedDict

import taskpilots_graph as tp

pytestmark = pytest.mark.postgres


class Count(TypedDict):
    n: int


def _graph(cp: tp.RecoveryCheckpointer) -> Any:
    builder = StateGraph(Count)
    builder.add_node("step", lambda s: {"n": s["n"] + 1})
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    return builder.compile(checkpointer=cp)


def _cfg(thread_id: str) -> Any:
    return {"configurable": {"thread_id": thread_id}}


@pytest.fixture
def cp(postgres_url: str) -> Iterator[tp.RecoveryCheckpointer]:
    with tp.RecoveryCheckpointer.from_conn_string(postgres_url, pool_size=4) as saver:
        saver.setup()
        yield saver


def test_a_blocked_write_does_not_hold_up_other_threads(
    cp: tp.RecoveryCheckpointer, postgres_url: str
) -> None:
    graph = _graph(cp)
    for thread_id in ("reader", "writer-2"):
        graph.invoke({"n": 0}, _cfg(thread_id))
    blocked_done = threading.Event()
    with psycopg.connect(postgres_url, autocommit=True) as blocker:
        # Writes to the checkpoint tables wait until this transaction ends; reads do not.
        blocker.execute("BEGIN")
        blocker.execute("LOCK TABLE checkpoints IN EXCLUSIVE MODE")

        def blocked_write() -> None:
            graph.invoke({"n": 0}, _cfg("writer-1"))
            blocked_done.set()

        writer = threading.Thread(target=blocked_write, daemon=True)
        writer.start()
        time.sleep(0.3)  # the write is now waiting inside PostgreSQL
        assert not blocked_done.is_set()

        seen: list[Any] = []

        def read() -> None:
            seen.append(graph.get_state(_cfg("reader")).values)
            seen.append(len(cp.events("reader")) >= 0)

        reader = threading.Thread(target=read, daemon=True)
        try:
            reader.start()
            # With the per-instance lock the read would wait for the blocked write, which
            # waits for this transaction: it would never finish.
            reader.join(timeout=10)
            assert seen == [{"n": 1}, True]
            assert not blocked_done.is_set()
        finally:
            blocker.execute("COMMIT")
    writer.join(timeout=30)
    assert blocked_done.is_set()
    assert graph.get_state(_cfg("writer-1")).values == {"n": 1}


def test_a_single_connection_still_serialises(postgres_url: str) -> None:
    """The lock is dropped only over a pool: a shared ``Connection`` still needs it."""
    from langgraph.checkpoint.postgres import PostgresSaver

    with psycopg.connect(
        postgres_url, autocommit=True, prepare_threshold=0, row_factory=dict_row
    ) as conn:
        saver = PostgresSaver(conn)
        cp = tp.RecoveryCheckpointer(saver)
        cp.setup()
        assert isinstance(saver.lock, type(threading.Lock()))
        graph = _graph(cp)
        assert graph.invoke({"n": 0}, _cfg("single"))["n"] == 1
