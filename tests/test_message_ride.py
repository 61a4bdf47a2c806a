"""A checkpoint's message rows commit in the checkpoint's own transaction.

The savers ``from_conn_string`` opens (SQLite sync and async, pooled PostgreSQL sync and
async) take the rows of the content-addressed message store into their ``put``: one commit
per checkpoint, a reader never sees a checkpoint without its rows, and a checkpoint write
that fails leaves no rows behind. Checked on the storage itself: SQLite's COMMIT statements,
PostgreSQL's transaction ids (``xmin``) of the rows.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Annotated, Any

import psycopg
import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from typing_extensions import TypedDict

from taskpilots_graph import AsyncRecoveryCheckpointer, RecoveryCheckpointer

_STEPS = 4
_WRITE = re.compile(r"^\s*(?:INSERT(?:\s+OR\s+\w+)?\s+INTO|UPDATE|DELETE\s+FROM)\s+(\w+)", re.I)


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def reply(state: State) -> dict[str, Any]:
    n = len(state["messages"])
    return {"messages": [AIMessage(f"reply {n}", id=f"ai-{n}")]}


def graph(saver: Any) -> Any:
    """A loop that adds one message per step: every checkpoint has new message rows."""
    builder = StateGraph(State)
    builder.add_node("reply", reply)
    builder.add_edge(START, "reply")
    builder.add_conditional_edges(
        "reply", lambda s: "reply" if len(s["messages"]) < 1 + _STEPS else END
    )
    return builder.compile(checkpointer=saver)


def config(thread_id: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id}}


def ask() -> dict[str, Any]:
    return {"messages": [HumanMessage("go", id="ask")]}


class Commits:
    """The sets of tables each COMMIT on a sqlite3 connection wrote."""

    def __init__(self) -> None:
        self.commits: list[set[str]] = []
        self._tables: set[str] = set()

    def __call__(self, statement: str) -> None:
        if match := _WRITE.match(statement):
            self._tables.add(match.group(1).lower())
        elif statement.strip().upper().startswith(("COMMIT", "END")):
            self.commits.append(self._tables)
            self._tables = set()

    def check(self) -> None:
        """Every commit writing message rows also wrote the checkpoint referring to them."""
        with_messages = [c for c in self.commits if any("message" in t for t in c)]
        assert with_messages  # the run stored messages at all
        assert all("checkpoints" in c for c in with_messages), self.commits


def _pg_rows(url: str, statement: str, params: tuple[Any, ...]) -> list[Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        return list(conn.execute(statement, params).fetchall())


def check_pg(url: str, thread_id: str) -> None:
    """Every message row of the thread was written by the transaction of a checkpoint."""
    for table in ("taskpilots_messages", "taskpilots_message_seqs", "taskpilots_message_refs"):
        total, alone = _pg_rows(
            url,
            f"SELECT count(*), count(*) FILTER (WHERE xmin::text NOT IN "
            f"(SELECT xmin::text FROM checkpoints WHERE thread_id = %s)) "
            f"FROM {table} WHERE thread_id = %s",
            (thread_id, thread_id),
        )[0]
        assert total > 0, table
        assert alone == 0, f"{alone} of {total} rows of {table} committed on their own"


def message_rows(cp: Any, url: str | None, thread_id: str) -> int:
    statement = "SELECT count(*) FROM taskpilots_message_refs WHERE thread_id = "
    if url is None:
        return int(cp.inner.conn.execute(statement + "?", (thread_id,)).fetchone()[0])
    return int(_pg_rows(url, statement + "%s", (thread_id,))[0][0])


def stored_messages(tup: CheckpointTuple | None) -> list[Any]:
    """The messages of the thread's last stored checkpoint (not the state: that applies the
    writes of tasks done since, which the refused checkpoint does not undo)."""
    assert tup is not None
    assert tup.metadata["step"] == 0
    return list(tup.checkpoint["channel_values"]["messages"])


def _url(conn_string: str) -> str | None:
    return None if conn_string.startswith("sqlite") else conn_string


# Refuses the checkpoints of thread "refused" after its first step: the first one that
# refers to messages (step 0, the question) is stored, the next one (step 1) is not.
_SQLITE_REFUSE = """
    CREATE TRIGGER refuse BEFORE INSERT ON checkpoints
    WHEN NEW.thread_id = 'refused'
        AND json_extract(CAST(NEW.metadata AS TEXT), '$.step') >= 1
    BEGIN SELECT RAISE(ABORT, 'checkpoint refused'); END
"""
_PG_REFUSE = """
    CREATE OR REPLACE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.thread_id = 'refused' AND (NEW.metadata->>'step')::int >= 1 THEN
            RAISE EXCEPTION 'checkpoint refused';
        END IF;
        RETURN NEW;
    END $$;
    CREATE OR REPLACE TRIGGER refuse BEFORE INSERT OR UPDATE ON checkpoints
        FOR EACH ROW EXECUTE FUNCTION refuse();
"""
_PG_ALLOW = "DROP TRIGGER IF EXISTS refuse ON checkpoints; DROP FUNCTION IF EXISTS refuse()"


def refuse_checkpoints(cp: Any, url: str | None) -> None:
    """From now on, the database refuses thread ``refused``'s checkpoints after step 0."""
    if url is None:
        cp.inner.conn.execute(_SQLITE_REFUSE)
        cp.inner.conn.commit()
        return
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(_PG_REFUSE)


@pytest.fixture
def allow_afterwards(conn_string: str) -> Iterator[None]:
    """The PostgreSQL database is shared by later tests: drop the trigger."""
    yield
    if (url := _url(conn_string)) is not None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(_PG_ALLOW)


def test_rows_commit_with_their_checkpoint(cp: RecoveryCheckpointer, conn_string: str) -> None:
    url = _url(conn_string)
    commits = Commits()
    if url is None:
        cp.inner.conn.set_trace_callback(commits)
    result = graph(cp).invoke(ask(), config("t-1"), durability="sync")
    assert len(result["messages"]) == 1 + _STEPS
    if url is None:
        cp.inner.conn.set_trace_callback(None)
        commits.check()
    else:
        check_pg(url, "t-1")
    assert graph(cp).get_state(config("t-1")).values["messages"] == result["messages"]


async def test_async_rows_commit_with_their_checkpoint(
    acp: AsyncRecoveryCheckpointer, conn_string: str
) -> None:
    url = _url(conn_string)
    commits = Commits()
    if url is None:
        await acp.inner.conn.set_trace_callback(commits)
    result = await graph(acp).ainvoke(ask(), config("t-2"), durability="sync")
    assert len(result["messages"]) == 1 + _STEPS
    if url is None:
        await acp.inner.conn.set_trace_callback(None)
        commits.check()
    else:
        check_pg(url, "t-2")
    state = await graph(acp).aget_state(config("t-2"))
    assert state.values["messages"] == result["messages"]


async def test_sync_calls_on_the_async_checkpointer_ride_too(
    acp: AsyncRecoveryCheckpointer, conn_string: str
) -> None:
    """``graph.invoke`` from a worker thread reaches the async saver through its loop; the
    rows still go into the checkpoint's transaction, not after it."""
    url = _url(conn_string)
    commits = Commits()
    if url is None:
        await acp.inner.conn.set_trace_callback(commits)
    result = await asyncio.to_thread(graph(acp).invoke, ask(), config("t-5"), durability="sync")
    assert len(result["messages"]) == 1 + _STEPS
    if url is None:
        await acp.inner.conn.set_trace_callback(None)
        commits.check()
    else:
        check_pg(url, "t-5")


@pytest.mark.usefixtures("allow_afterwards")
def test_a_refused_checkpoint_leaves_no_rows(cp: RecoveryCheckpointer, conn_string: str) -> None:
    """The rows roll back with the checkpoint write that failed: not even orphans remain,
    the thread's last stored checkpoint loads, and other threads carry on."""
    url = _url(conn_string)
    refuse_checkpoints(cp, url)
    with pytest.raises(Exception, match="checkpoint refused"):
        graph(cp).invoke(ask(), config("refused"), durability="sync")
    assert stored_messages(cp.get_tuple(config("refused"))) == ask()["messages"]
    assert message_rows(cp, url, "refused") == 1  # the question's: step 1's rolled back
    result = graph(cp).invoke(ask(), config("t-3"), durability="sync")
    assert len(result["messages"]) == 1 + _STEPS
    assert message_rows(cp, url, "t-3") == 1 + _STEPS


@pytest.mark.usefixtures("allow_afterwards")
async def test_async_refused_checkpoint_leaves_no_rows(
    acp: AsyncRecoveryCheckpointer, conn_string: str
) -> None:
    url = _url(conn_string)
    if url is None:
        await acp.inner.conn.execute(_SQLITE_REFUSE)
        await acp.inner.conn.commit()
    else:
        refuse_checkpoints(acp, url)
    with pytest.raises(Exception, match="checkpoint refused"):
        await graph(acp).ainvoke(ask(), config("refused"), durability="sync")
    assert stored_messages(await acp.aget_tuple(config("refused"))) == ask()["messages"]
    if url is None:
        async with acp.inner.conn.execute(
            "SELECT count(*) FROM taskpilots_message_refs WHERE thread_id = 'refused'"
        ) as cur:
            assert (await cur.fetchone())[0] == 1
    else:
        assert message_rows(acp, url, "refused") == 1
    result = await graph(acp).ainvoke(ask(), config("t-4"), durability="sync")
    assert len(result["messages"]) == 1 + _STEPS
