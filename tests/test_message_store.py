"""Messages are stored once per thread and checkpoints refer to them (checkpointers/messages).

Real LangGraph graphs with ``add_messages`` run on ``RecoveryCheckpointer`` and on the bare
LangGraph saver of the same kind (memory, SQLite file, PostgreSQL database); every state the
graph reads back (latest, full history, subgraph namespaces, forks, edits, removals) must
be the bare saver's exactly, while the stored bytes grow linearly with the conversation.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack
from pathlib import Path
from typing import Annotated, Any

import pytest
from _services import create_database, drop_database
from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    ToolMessage,
)
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver, empty_checkpoint
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from typing_extensions import TypedDict

from taskpilots_graph import AsyncRecoveryCheckpointer, RecoveryCheckpointer
from taskpilots_graph.checkpointers._message_log import MessageLog
from taskpilots_graph.checkpointers.density import CheckpointDensity
from taskpilots_graph.checkpointers.memory import MemoryStore
from taskpilots_graph.checkpointers.messages import MARKER, MessageRef, RecordMap, read_marker
from taskpilots_graph.errors import CorruptRecordError
from taskpilots_graph.state import merge_steps

Pair = tuple[RecoveryCheckpointer, BaseCheckpointSaver[Any]]


# --- the graph ------------------------------------------------------------------------------


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def page(n: int) -> str:
    """A ~1 KB observation of varied text (so compression does not flatter the bytes)."""
    rng = random.Random(n)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 9)))]
    while len(" ".join(words)) < 1000:
        words.append("".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 9))))
    return json.dumps({"n": n, "text": " ".join(words)})


def model(state: State) -> dict[str, Any]:
    """Calls ``fetch`` until as many pages were read as the last request asks for.

    Ids come from the list length, so both runs (and a fork's branch, with other content
    under the same ids) are deterministic.
    """
    messages = state["messages"]
    asked = next(m for m in reversed(messages) if isinstance(m, HumanMessage))
    goal = int(json.loads(str(asked.content))["steps"])
    done = sum(isinstance(m, ToolMessage) for m in messages)
    k = len(messages)
    if done >= goal:
        return {"messages": [AIMessage(f"read {done} pages", id=f"ai-final-{k}")]}
    call = {"name": "fetch", "args": {"n": done}, "id": f"call-{k}", "type": "tool_call"}
    return {"messages": [AIMessage("", id=f"ai-{k}", tool_calls=[call])]}


def tools(state: State) -> dict[str, Any]:
    call = state["messages"][-1].tool_calls[0]  # type: ignore[union-attr]
    message = ToolMessage(
        page(call["args"]["n"]), id=f"tool-{call['id']}", tool_call_id=call["id"], name="fetch"
    )
    return {"messages": [message]}


def route(state: State) -> str:
    last = state["messages"][-1]
    return "tools" if isinstance(last, AIMessage) and last.tool_calls else END


def agent_graph() -> StateGraph[State]:
    graph = StateGraph(State)
    graph.add_node("model", model)
    graph.add_node("tools", tools)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", route, ["tools", END])
    graph.add_edge("tools", "model")
    return graph


def build(saver: BaseCheckpointSaver[Any]) -> Any:
    return agent_graph().compile(checkpointer=saver)


def build_nested(saver: BaseCheckpointSaver[Any]) -> Any:
    """The agent as a subgraph node: its checkpoints live in a namespace of their own."""

    def greet(state: State) -> dict[str, Any]:
        return {"messages": [AIMessage("starting", id="greeting")]}

    outer = StateGraph(State)
    outer.add_node("greet", greet)
    outer.add_node("agent", agent_graph().compile())
    outer.add_edge(START, "agent")
    outer.add_edge("agent", "greet")
    outer.add_edge("greet", END)
    return outer.compile(checkpointer=saver)


def build_turns(saver: BaseCheckpointSaver[Any]) -> Any:
    """An outer loop invoking a one-step subgraph once per step: every invocation starts
    from the whole conversation, in a namespace of its own."""
    turn = StateGraph(State)
    turn.add_node("model", model)
    turn.add_node("tools", tools)
    turn.add_edge(START, "model")
    turn.add_conditional_edges("model", route, ["tools", END])
    turn.add_edge("tools", END)
    outer = StateGraph(State)
    outer.add_node("turn", turn.compile())
    outer.add_edge(START, "turn")
    outer.add_conditional_edges(
        "turn", lambda s: "turn" if isinstance(s["messages"][-1], ToolMessage) else END
    )
    return outer.compile(checkpointer=saver)


def config(thread_id: str, **extra: Any) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id, **extra}, "recursion_limit": 10_000}


def ask(steps: int) -> dict[str, Any]:
    return {"messages": [HumanMessage(json.dumps({"steps": steps}), id="ask")]}


# --- comparisons ----------------------------------------------------------------------------


def same_messages(ours: list[BaseMessage], bare: list[BaseMessage]) -> None:
    """Equal lists: same types, ids, content, tool calls (and every other field)."""
    assert [type(m) for m in ours] == [type(m) for m in bare]
    assert [m.id for m in ours] == [m.id for m in bare]
    assert [m.content for m in ours] == [m.content for m in bare]
    assert [getattr(m, "tool_calls", None) for m in ours] == [
        getattr(m, "tool_calls", None) for m in bare
    ]
    assert ours == bare


def history(graph: Any, cfg: RunnableConfig) -> list[list[BaseMessage]]:
    return [s.values.get("messages", []) for s in graph.get_state_history(cfg)]


def all_checkpoints(saver: BaseCheckpointSaver[Any], thread_id: str) -> list[tuple[str, Any]]:
    """(namespace kind, messages) of every checkpoint of the thread, oldest first per kind."""
    found = []
    for tup in saver.list({"configurable": {"thread_id": thread_id}}):
        ns = tup.config["configurable"].get("checkpoint_ns", "")
        found.append((ns.split(":")[0], tup.checkpoint["channel_values"].get("messages")))
    return sorted(found, key=lambda item: item[0])


def raw_messages_value(cp: RecoveryCheckpointer, cfg: RunnableConfig) -> Any:
    tup = cp.inner.get_tuple(cfg)
    assert tup is not None
    return tup.checkpoint["channel_values"]["messages"]


# --- storage inspection (per backend) -------------------------------------------------------


def _pg(saver: Any, statement: str, params: tuple[Any, ...] = ()) -> list[Any]:
    conn = saver.conn
    if hasattr(conn, "connection"):
        with conn.connection() as c:
            return list(c.execute(statement, params).fetchall())
    return list(conn.execute(statement, params).fetchall())


def _value(row: Any) -> Any:
    return next(iter(row.values())) if isinstance(row, dict) else row[0]


def message_rows(cp: RecoveryCheckpointer, thread_id: str) -> tuple[int, int, int]:
    """(stored messages, sequences, references) of a thread."""
    if isinstance(cp.inner, InMemorySaver):
        stored = cp.store._messages.get(thread_id)  # type: ignore[attr-defined]
        if stored is None:
            return 0, 0, 0
        return (
            len(stored.messages),
            len(stored.parents),
            sum(len(refs) for refs in stored.refs.values()),
        )
    counts = []
    for table in ("taskpilots_messages", "taskpilots_message_seqs", "taskpilots_message_refs"):
        if isinstance(cp.inner, SqliteSaver):
            sql = f"SELECT count(*) FROM {table} WHERE thread_id = ?"
            counts.append(cp.inner.conn.execute(sql, (thread_id,)).fetchone()[0])
        else:
            sql = f"SELECT count(*) FROM {table} WHERE thread_id = %s"
            counts.append(_value(_pg(cp.inner, sql, (thread_id,))[0]))
    return counts[0], counts[1], counts[2]


_PG_TABLES = (
    "checkpoints",
    "checkpoint_blobs",
    "checkpoint_writes",
    "taskpilots_messages",
    "taskpilots_message_seqs",
    "taskpilots_message_refs",
)


def stored_bytes(saver: Any) -> int:
    """What the saver (and its message tables) hold: file bytes for SQLite, row bytes for
    PostgreSQL (TOAST-compressed sizes included), serialized bytes in memory."""
    inner = getattr(saver, "inner", saver)
    if isinstance(inner, InMemorySaver):
        total = sum(
            len(checkpoint[1]) + len(metadata[1])
            for spaces in inner.storage.values()
            for stored in spaces.values()
            for checkpoint, metadata, _ in stored.values()
        )
        total += sum(len(blob[1]) for blob in inner.blobs.values())
        store = getattr(saver, "store", None)
        for thread in getattr(store, "_messages", {}).values():
            total += sum(len(payload) + 16 for _, payload in thread.messages.values())
            total += 24 * sum(len(refs) for refs in thread.refs.values())
        return total
    if isinstance(inner, SqliteSaver):
        inner.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = inner.conn.execute("PRAGMA page_count").fetchone()[0]
        return int(pages * inner.conn.execute("PRAGMA page_size").fetchone()[0])
    total = 0
    for table in _PG_TABLES:
        exists = _pg(inner, "SELECT to_regclass(%s) IS NOT NULL", (table,))
        if _value(exists[0]):
            rows = _pg(inner, f"SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM {table} t")
            total += int(_value(rows[0]))
    return total


# --- backends -------------------------------------------------------------------------------


@pytest.fixture
def second_postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """Another fresh database: the bare twin must not see our rows."""
    name = f"t_{uuid.uuid4().hex}"
    url = create_database(postgres_admin_url, name)
    yield url
    drop_database(postgres_admin_url, name)


BACKENDS = ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[ExitStack, str], Any]:
    """Opens a saver of the test's backend by name: ``ours`` (wrapped) or ``bare``.

    Opening ``ours`` twice reaches the same storage through a new checkpointer (a restart);
    in memory a restart reuses the saver and the store objects.
    """
    backend = request.param
    memory: dict[str, Any] = {}
    urls: dict[str, str] = {}
    if backend == "postgres":
        urls = {
            "ours": request.getfixturevalue("postgres_url"),
            "bare": request.getfixturevalue("second_postgres_url"),
        }

    def open_saver(stack: ExitStack, side: str) -> Any:
        if backend == "memory":
            if side == "bare":
                return memory.setdefault("bare", InMemorySaver())
            saver = memory.setdefault("ours", InMemorySaver())
            return RecoveryCheckpointer(saver, store=memory.setdefault("store", MemoryStore()))
        if backend == "sqlite":
            path = tmp_path / f"{side}.db"
            if side == "bare":
                conn = stack.enter_context(sqlite3.connect(path, check_same_thread=False))
                return SqliteSaver(conn)
            cp = stack.enter_context(RecoveryCheckpointer.from_conn_string(f"sqlite:///{path}"))
            cp.setup()
            return cp
        from langgraph.checkpoint.postgres import PostgresSaver

        if side == "bare":
            saver = stack.enter_context(PostgresSaver.from_conn_string(urls["bare"]))
            saver.setup()
            return saver
        cp = stack.enter_context(RecoveryCheckpointer.from_conn_string(urls["ours"]))
        cp.setup()
        return cp

    return open_saver


@pytest.fixture
def pair(opener: Callable[[ExitStack, str], Any]) -> Iterator[Pair]:
    with ExitStack() as stack:
        yield opener(stack, "ours"), opener(stack, "bare")


# --- behaviour ------------------------------------------------------------------------------


def test_long_run_rebuilds_exactly_what_the_bare_saver_stores(pair: Pair) -> None:
    """A 60-step run: latest state and every checkpoint of the history equal the bare
    saver's, each message is stored once, and checkpoints hold a reference, not the list."""
    ours, bare = pair
    for saver in pair:
        build(saver).invoke(ask(60), config("t-1"), durability="sync")
    g_ours, g_bare = build(ours), build(bare)
    latest = g_ours.get_state(config("t-1")).values["messages"]
    same_messages(latest, g_bare.get_state(config("t-1")).values["messages"])
    assert len(latest) == 1 + 2 * 60 + 1
    ours_history, bare_history = history(g_ours, config("t-1")), history(g_bare, config("t-1"))
    assert len(ours_history) == len(bare_history) > 100
    for mine, theirs in zip(ours_history, bare_history, strict=True):
        same_messages(mine, theirs)
    assert read_marker(raw_messages_value(ours, config("t-1"))) is not None
    stored, _, refs = message_rows(ours, "t-1")
    assert stored == len(latest)  # once each, though ~120 checkpoints contain them
    assert refs == len(latest)  # one sequence, appended to at every step


@pytest.mark.parametrize("durability", ["async", "exit"])
def test_other_durabilities_store_the_same_states(pair: Pair, durability: Any) -> None:
    """Background (``async``) and end-of-run (``exit``) writes rebuild the same state."""
    ours, bare = pair
    for saver in pair:
        build(saver).invoke(ask(12), config("t-d"), durability=durability)
    same_messages(
        build(ours).get_state(config("t-d")).values["messages"],
        build(bare).get_state(config("t-d")).values["messages"],
    )


def test_edits_and_removals_match_and_stay_cheap(pair: Pair) -> None:
    """Same-id edits and ``RemoveMessage`` give the bare saver's states; editing the last
    message adds one reference and one message, not a copy of the conversation."""
    ours, bare = pair
    for saver in pair:
        build(saver).invoke(ask(20), config("t-e"), durability="sync")
    g_ours, g_bare = build(ours), build(bare)
    final = g_ours.get_state(config("t-e")).values["messages"][-1]
    before = message_rows(ours, "t-e")
    edit = {"messages": [AIMessage("read them all, edited", id=final.id)]}
    for graph in (g_ours, g_bare):
        graph.update_state(config("t-e"), edit)
    same_messages(
        g_ours.get_state(config("t-e")).values["messages"],
        g_bare.get_state(config("t-e")).values["messages"],
    )
    after = message_rows(ours, "t-e")
    assert after[0] == before[0] + 1  # the new version of the message
    assert after[2] == before[2] + 1  # one reference: a child sequence sharing the rest
    # Remove a message from the middle, then edit an early one: both start new sequences.
    middle = g_ours.get_state(config("t-e")).values["messages"][7]
    early = g_ours.get_state(config("t-e")).values["messages"][2]
    for graph in (g_ours, g_bare):
        graph.update_state(config("t-e"), {"messages": [RemoveMessage(id=str(middle.id))]})
        graph.update_state(
            config("t-e"),
            {"messages": [ToolMessage("redacted", id=early.id, tool_call_id=early.tool_call_id)]},
        )
    ours_now = g_ours.get_state(config("t-e")).values["messages"]
    same_messages(ours_now, g_bare.get_state(config("t-e")).values["messages"])
    assert middle.id not in [m.id for m in ours_now]
    assert ours_now[2].content == "redacted"
    for mine, theirs in zip(
        history(g_ours, config("t-e")), history(g_bare, config("t-e")), strict=True
    ):
        same_messages(mine, theirs)
    # The run goes on from the edited list exactly as the bare one does.
    for graph in (g_ours, g_bare):
        graph.update_state(config("t-e"), {"messages": [HumanMessage("more", id="more")]})
    same_messages(
        g_ours.get_state(config("t-e")).values["messages"],
        g_bare.get_state(config("t-e")).values["messages"],
    )


def test_fork_from_an_old_checkpoint(pair: Pair) -> None:
    """A fork from the middle of the history continues with other content under the same
    message ids; both branches read back as the bare saver's."""
    results = []
    for saver in pair:
        graph = build(saver)
        graph.invoke(ask(10), config("t-f"), durability="sync")
        old = next(
            s for s in graph.get_state_history(config("t-f")) if len(s.values["messages"]) == 9
        )
        forked = graph.update_state(
            old.config, {"messages": [HumanMessage(json.dumps({"steps": 6}), id="ask")]}
        )
        graph.invoke(None, forked, durability="sync")
        results.append(graph)
    g_ours, g_bare = results
    same_messages(
        g_ours.get_state(config("t-f")).values["messages"],
        g_bare.get_state(config("t-f")).values["messages"],
    )
    for mine, theirs in zip(
        history(g_ours, config("t-f")), history(g_bare, config("t-f")), strict=True
    ):
        same_messages(mine, theirs)
    # The original branch is intact: its last checkpoint still has the long conversation.
    old_tip = [s for s in g_ours.get_state_history(config("t-f")) if len(s.values["messages"])]
    assert max(len(s.values["messages"]) for s in old_tip) == 1 + 2 * 10 + 1


def test_subgraph_namespaces(pair: Pair) -> None:
    """Checkpoints of a subgraph (its own checkpoint_ns) store references too and read back
    as the bare saver's; the parent's and the child's lists share stored messages."""
    ours, bare = pair
    for saver in pair:
        build_nested(saver).invoke(ask(8), config("t-s"), durability="sync")
    ours_all, bare_all = all_checkpoints(ours, "t-s"), all_checkpoints(bare, "t-s")
    assert {kind for kind, _ in ours_all} == {"", "agent"}
    assert len(ours_all) == len(bare_all)
    for (kind, mine), (bare_kind, theirs) in zip(ours_all, bare_all, strict=True):
        assert kind == bare_kind
        if theirs is None:
            assert mine is None
        else:
            same_messages(mine, theirs)
    child = list(ours.inner.list({"configurable": {"thread_id": "t-s"}}))
    assert any(
        read_marker(t.checkpoint["channel_values"].get("messages")) is not None
        and t.config["configurable"]["checkpoint_ns"].startswith("agent:")
        for t in child
    )
    final = build_nested(ours).get_state(config("t-s")).values["messages"]
    stored, _, _ = message_rows(ours, "t-s")
    assert stored == len(final)  # shared by the namespaces, stored once


def test_subgraph_invoked_at_every_step_stays_linear(pair: Pair) -> None:
    """A subgraph started 25 times from the whole conversation refers to its parent's
    stored list instead of listing every message again in each new namespace."""
    ours, bare = pair
    for saver in pair:
        build_turns(saver).invoke(ask(25), config("t-turns"), durability="sync")
    final = build_turns(ours).get_state(config("t-turns")).values["messages"]
    same_messages(final, build_turns(bare).get_state(config("t-turns")).values["messages"])
    ours_all, bare_all = all_checkpoints(ours, "t-turns"), all_checkpoints(bare, "t-turns")
    assert len(ours_all) == len(bare_all)
    for (_, mine), (_, theirs) in zip(ours_all, bare_all, strict=True):
        assert (mine is None) == (theirs is None)
        if theirs is not None:
            same_messages(mine, theirs)
    stored, _, refs = message_rows(ours, "t-turns")
    assert stored == len(final)
    # Each of the 25 namespaces adds its own new messages only (~2 each), not ~50.
    assert refs < 3 * len(final), (refs, len(final))


def test_checkpoints_written_without_the_store_still_load(
    opener: Callable[[ExitStack, str], Any],
) -> None:
    """A thread written with message lists inside its checkpoints (``store_messages`` off,
    as every checkpoint written before this change) loads, and a run continues it with
    references, matching a bare twin."""
    with ExitStack() as stack:
        ours, bare = opener(stack, "ours"), opener(stack, "bare")
        ours.store_messages = False
        for saver in (ours, bare):
            build(saver).invoke(ask(5), config("t-old"), durability="sync")
        assert isinstance(raw_messages_value(ours, config("t-old")), list)
    with ExitStack() as stack:
        ours, bare = opener(stack, "ours"), opener(stack, "bare")
        assert ours.store_messages
        for saver in (ours, bare):
            more = {"messages": [HumanMessage(json.dumps({"steps": 9}), id="ask-2")]}
            build(saver).invoke(more, config("t-old"), durability="sync")
        assert read_marker(raw_messages_value(ours, config("t-old"))) is not None
        for mine, theirs in zip(
            history(build(ours), config("t-old")),
            history(build(bare), config("t-old")),
            strict=True,
        ):
            same_messages(mine, theirs)


def test_a_restarted_checkpointer_appends_instead_of_restoring(
    opener: Callable[[ExitStack, str], Any],
) -> None:
    """A new checkpointer on the same storage continues the thread with one new sequence
    sharing the stored prefix: references for the new messages only."""
    with ExitStack() as stack:
        build(opener(stack, "ours")).invoke(ask(10), config("t-r"), durability="sync")
    with ExitStack() as stack:
        ours = opener(stack, "ours")
        before = message_rows(ours, "t-r")
        graph = build(ours)
        more = {"messages": [HumanMessage(json.dumps({"steps": 15}), id="ask-2")]}
        graph.invoke(more, config("t-r"), durability="sync")
        after = message_rows(ours, "t-r")
        messages = graph.get_state(config("t-r")).values["messages"]
    assert len(messages) == (1 + 2 * 10 + 1) + (1 + 2 * 5 + 1)
    new = 1 + 2 * 5 + 1
    assert after[0] - before[0] == new  # messages: only the new ones
    assert after[2] - before[2] == new  # references: none of the 22 earlier ones again
    assert after[1] - before[1] == 1  # one sequence continuing the stored one


def test_delete_thread_removes_the_stored_messages(pair: Pair) -> None:
    """delete_thread removes the thread's messages, sequences and references only; the id
    can then be used again from scratch."""
    ours, _ = pair
    graph = build(ours)
    graph.invoke(ask(4), config("t-del"), durability="sync")
    graph.invoke(ask(3), config("t-keep"), durability="sync")
    assert message_rows(ours, "t-del")[0] > 0
    ours.delete_thread("t-del")
    assert message_rows(ours, "t-del") == (0, 0, 0)
    assert message_rows(ours, "t-keep")[0] == 1 + 2 * 3 + 1
    assert graph.get_state(config("t-del")).values == {}
    # The same message objects again (ids included): nothing may refer to deleted rows.
    again = ask(2)
    graph.invoke(again, config("t-del"), durability="sync")
    graph.invoke(again, config("t-del2"), durability="sync")
    assert len(graph.get_state(config("t-del")).values["messages"]) == 1 + 2 * 2 + 1


def test_prune_keeps_the_kept_checkpoints_readable(pair: Pair) -> None:
    """Retention prune drops old checkpoints, never the messages a kept one refers to."""
    ours, bare = pair
    for saver in pair:
        build(saver).invoke(ask(6), config("t-p"), durability="sync")
    report = ours.prune(["t-p"])
    assert report.pruned == ("t-p",)
    assert len(list(ours.list(config("t-p")))) == 1
    same_messages(
        build(ours).get_state(config("t-p")).values["messages"],
        build(bare).get_state(config("t-p")).values["messages"],
    )
    graph = build(ours)
    graph.update_state(config("t-p"), {"messages": [HumanMessage("after", id="after")]})
    assert graph.get_state(config("t-p")).values["messages"][-1].content == "after"


def test_copy_thread_writes_references_of_its_own(pair: Pair) -> None:
    """copy_thread reads and writes through the checkpointer: the copy's history equals
    the source's and its references point at rows of the copy's own thread."""
    ours, _ = pair
    graph = build(ours)
    graph.invoke(ask(5), config("t-src"), durability="sync")
    ours.copy_thread("t-src", "t-copy")
    ours.delete_thread("t-src")  # the copy must not depend on the source's rows
    copied = history(build(ours), config("t-copy"))
    assert len(copied[0]) == 1 + 2 * 5 + 1
    assert message_rows(ours, "t-copy")[0] == len(copied[0])
    graph.update_state(config("t-copy"), {"messages": [HumanMessage("go", id="go")]})
    assert graph.get_state(config("t-copy")).values["messages"][-1].id == "go"


def test_held_checkpoints_are_encoded_when_flushed(pair: Pair) -> None:
    """Under a sparse density, checkpoints held in memory and stored later (at a read) go
    through the message store too."""
    ours, bare = pair
    sparse = ours.with_density(CheckpointDensity("milestones"))
    build(sparse).invoke(ask(6), config("t-h"), durability="sync")
    build(bare).invoke(ask(6), config("t-h"), durability="sync")
    same_messages(
        build(sparse).get_state(config("t-h")).values["messages"],
        build(bare).get_state(config("t-h")).values["messages"],
    )
    for tup in ours.inner.list(config("t-h")):
        value = tup.checkpoint["channel_values"].get("messages")
        assert value is None or read_marker(value) is not None


def test_missing_rows_are_reported_as_corrupt(pair: Pair) -> None:
    """A checkpoint whose messages were removed behind its back raises CorruptRecordError
    (never an empty or shortened conversation)."""
    ours, _ = pair
    graph = build(ours)
    graph.invoke(ask(2), config("t-c"), durability="sync")
    ours.store.delete_thread("t-c")  # the store's rows only: the checkpoints remain
    with pytest.raises(CorruptRecordError):
        graph.get_state(config("t-c"))
    with pytest.raises(CorruptRecordError):
        list(ours.list(config("t-c")))


def test_a_failure_between_rows_and_checkpoint_leaves_a_loadable_thread(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows are written before the checkpoint: when the checkpoint write fails (a crash
    there) the thread's last checkpoint still loads, and a retry continues exactly; when
    the rows' write fails, no checkpoint refers to them."""
    ours, bare = pair
    graph = build(ours)
    graph.invoke(ask(3), config("t-x"), durability="sync")
    before = graph.get_state(config("t-x")).values["messages"]
    real_put = ours.inner.put
    calls = {"n": 0}

    def put_failing_once(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("the process died before the checkpoint was written")
        return real_put(*args)

    more = {"messages": [HumanMessage(json.dumps({"steps": 6}), id="ask-2")]}
    monkeypatch.setattr(ours.inner, "put", put_failing_once)
    with pytest.raises(RuntimeError):
        graph.invoke(more, config("t-x"), durability="sync")
    assert graph.get_state(config("t-x")).values["messages"] == before
    graph.invoke(more, config("t-x"), durability="sync")
    monkeypatch.undo()

    def write_failing(rows: Any) -> None:
        raise RuntimeError("the message rows could not be written")

    monkeypatch.setattr(ours.store, "messages_write", write_failing)
    with pytest.raises(RuntimeError):
        graph.update_state(config("t-x"), {"messages": [HumanMessage("lost", id="lost")]})
    monkeypatch.undo()
    build(bare).invoke(ask(3), config("t-x"), durability="sync")
    build(bare).invoke(more, config("t-x"), durability="sync")
    same_messages(
        graph.get_state(config("t-x")).values["messages"],
        build(bare).get_state(config("t-x")).values["messages"],
    )
    graph.update_state(config("t-x"), {"messages": [HumanMessage("kept", id="kept")]})
    assert graph.get_state(config("t-x")).values["messages"][-1].id == "kept"


def test_storage_grows_linearly(opener: Callable[[ExitStack, str], Any]) -> None:
    """Bytes after 400 steps are under 5x the bytes after 100 (the bare savers' grow ~16x),
    with the whole conversation kept."""
    sizes = {}
    for steps in (100, 400):
        with ExitStack() as stack:
            ours = opener(stack, "ours")
            base = stored_bytes(ours)
            build(ours).invoke(ask(steps), config(f"t-{steps}"), durability="sync")
            sizes[steps] = stored_bytes(ours) - base
            assert len(build(ours).get_state(config(f"t-{steps}")).values["messages"]) == (
                2 + 2 * steps
            )
    assert sizes[400] < 5 * sizes[100], sizes


# --- async ----------------------------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
async def async_cp(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """An ``AsyncRecoveryCheckpointer`` of each backend."""
    async with AsyncExitStack() as stack:
        if request.param == "memory":
            yield AsyncRecoveryCheckpointer(InMemorySaver())
            return
        url = (
            f"sqlite:///{tmp_path / 'ours.db'}"
            if request.param == "sqlite"
            else request.getfixturevalue("postgres_url")
        )
        cp = await stack.enter_async_context(AsyncRecoveryCheckpointer.from_conn_string(url))
        await cp.setup()
        yield cp


async def test_async_graph_matches_the_reference(async_cp: Any) -> None:
    """ainvoke, aupdate_state (edit, removal) and aget_state_history through the async
    checkpointer rebuild what a bare in-memory saver holds."""
    bare = InMemorySaver()
    graphs = (build(async_cp), build(bare))
    for graph in graphs:
        await graph.ainvoke(ask(15), config("a-1"), durability="sync")
        state = await graph.aget_state(config("a-1"))
        fifth = state.values["messages"][5]
        await graph.aupdate_state(config("a-1"), {"messages": [RemoveMessage(id=fifth.id)]})
        await graph.aupdate_state(
            config("a-1"), {"messages": [AIMessage("edited", id="ai-final-31")]}
        )
    ours_history = [s.values["messages"] async for s in graphs[0].aget_state_history(config("a-1"))]
    bare_history = [s.values["messages"] async for s in graphs[1].aget_state_history(config("a-1"))]
    assert len(ours_history) == len(bare_history)
    for mine, theirs in zip(ours_history, bare_history, strict=True):
        same_messages(mine, theirs)
    tup = await async_cp.inner.aget_tuple(config("a-1"))
    assert read_marker(tup.checkpoint["channel_values"]["messages"]) is not None
    assert (await async_cp.aget(config("a-1")))["channel_values"]["messages"] == ours_history[0]


async def test_async_sync_faces_share_the_encoding(async_cp: Any) -> None:
    """The sync face of the async checkpointer (from a worker thread) reads what the async
    face wrote, and writes what it reads."""
    graph = build(async_cp)
    await graph.ainvoke(ask(3), config("a-2"), durability="sync")
    state = await asyncio.to_thread(graph.get_state, config("a-2"))
    assert [m.id for m in state.values["messages"]][-1] == "ai-final-7"
    more = {"messages": [HumanMessage(json.dumps({"steps": 5}), id="ask-2")]}
    await asyncio.to_thread(graph.invoke, more, config("a-2"), durability="sync")
    reference = build(InMemorySaver())
    reference.invoke(ask(3), config("a-2"))
    reference.invoke(more, config("a-2"))
    same_messages(
        (await graph.aget_state(config("a-2"))).values["messages"],
        reference.get_state(config("a-2")).values["messages"],
    )


# --- the encoding itself (no storage) -------------------------------------------------------


def _checkpoint(values: dict[str, Any]) -> Any:
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = values
    return checkpoint


def test_encoding_plans_appends_children_and_leaves_other_values_alone() -> None:
    """Appends add rows to one sequence, an edit starts a child sharing the prefix, a prefix
    (fork) writes nothing; lists that are not messages with ids stay inline."""
    log, serde = MessageLog(), JsonPlusSerializer()
    cfg = config("u")
    first = [HumanMessage("a", id="1"), AIMessage("b", id="2")]
    encoded, rows = log.encode(cfg, _checkpoint({"messages": first, "n": [1, 2]}), serde)
    assert encoded["channel_values"]["n"] == [1, 2]
    marker = encoded["channel_values"]["messages"]
    assert set(marker) == {MARKER, "seq", "len"}
    assert rows is not None
    assert len(rows.sequences) == 1
    assert len(rows.refs) == 2
    seq = rows.sequences[0].seq
    longer = [*first, AIMessage("c", id="3")]
    _, rows = log.encode(cfg, _checkpoint({"messages": longer}), serde)
    assert rows is not None
    assert rows.sequences == ()
    assert rows.refs[0][:2] == (seq, 2)
    edited = [*first, AIMessage("c2", id="3")]
    _, rows = log.encode(cfg, _checkpoint({"messages": edited}), serde)
    assert rows is not None
    assert len(rows.refs) == 1
    assert len(rows.messages) == 1
    assert (rows.sequences[0].parent_seq, rows.sequences[0].parent_len) == (seq, 2)
    encoded, rows = log.encode(cfg, _checkpoint({"messages": first}), serde)
    assert rows is None
    assert read_marker(encoded["channel_values"]["messages"]) is not None
    no_ids = [HumanMessage("x")]
    encoded, rows = log.encode(config("v"), _checkpoint({"messages": no_ids}), serde)
    assert rows is None
    assert encoded["channel_values"]["messages"] is no_ids


def test_a_malformed_marker_is_corrupt() -> None:
    """A value that carries the marker key but no valid reference is never taken as data."""
    assert read_marker({"x": 1}) is None
    with pytest.raises(CorruptRecordError):
        read_marker({MARKER: 1, "seq": "1", "len": 2})


# --- record maps (the recovery agent's step layer) ------------------------------------------


class Ledgerish(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    steps: Annotated[dict[str, dict[str, Any]], merge_steps]


def step_graph() -> StateGraph[Ledgerish]:
    """Each step adds a record and updates the previous one (as the executor does)."""

    def work(state: Ledgerish) -> dict[str, Any]:
        steps = state.get("steps") or {}
        n = len(steps)
        update: dict[str, Any] = {f"call-{n}": {"status": "running", "args": {"n": n}}}
        if n:
            update[f"call-{n - 1}"] = {"status": "closed", "result": page(n - 1)[:200]}
        return {"steps": update, "messages": [AIMessage(f"step {n}", id=f"m-{n}")]}

    def more(state: Ledgerish) -> str:
        return "work" if len(state["steps"]) < 40 else END

    graph = StateGraph(Ledgerish)
    graph.add_node("work", work)
    graph.add_edge(START, "work")
    graph.add_conditional_edges("work", more, ["work", END])
    return graph


def test_record_maps_are_stored_once_per_record_version(pair: Pair) -> None:
    """A step layer that grows by one record per step is rebuilt exactly (as a RecordMap,
    plain dicts inside) in every checkpoint, and costs references per changed record."""
    ours, bare = pair
    for saver in pair:
        step_graph().compile(checkpointer=saver).invoke({"messages": []}, config("r-1"))
    g_ours = step_graph().compile(checkpointer=ours)
    g_bare = step_graph().compile(checkpointer=bare)
    ours_states = [s.values for s in g_ours.get_state_history(config("r-1"))]
    bare_states = [s.values for s in g_bare.get_state_history(config("r-1"))]
    assert len(ours_states) == len(bare_states) > 40
    for mine, theirs in zip(ours_states, bare_states, strict=True):
        assert mine.get("steps", {}) == theirs.get("steps", {})
    latest = g_ours.get_state(config("r-1")).values["steps"]
    assert type(latest) is RecordMap
    assert len(latest) == 40
    assert latest["call-0"] == {"status": "closed", "args": {"n": 0}, "result": page(0)[:200]}
    raw = cp_raw_value(ours, config("r-1"), "steps")
    assert read_marker(raw) is not None
    assert raw.get("map") == 1
    stored, _, refs = message_rows(ours, "r-1")
    # 40 messages, and each record twice (running, then closed): linear, not 40²/2.
    assert stored == 40 + 2 * 40 - 1
    assert refs < 4 * 40 * 2


def test_a_record_map_continues_after_a_restart(opener: Callable[[ExitStack, str], Any]) -> None:
    """A fresh checkpointer reads the map back and the next step adds only its changes."""
    with ExitStack() as stack:
        ours = opener(stack, "ours")
        graph = step_graph().compile(checkpointer=ours)
        with pytest.raises(GraphRecursionError):
            graph.invoke(
                {"messages": []}, {**config("r-2"), "recursion_limit": 20}, durability="sync"
            )
        before = message_rows(ours, "r-2")
    with ExitStack() as stack:
        again = opener(stack, "ours")
        graph = step_graph().compile(checkpointer=again)
        graph.invoke(None, config("r-2"))
        steps = graph.get_state(config("r-2")).values["steps"]
        assert len(steps) == 40
        assert [s["status"] for s in steps.values()].count("running") == 1
        after = message_rows(again, "r-2")
    # 20 more steps: about two records and one message each, never the whole map again.
    assert after[2] - before[2] < 20 * 4 + 20


def test_plain_dicts_are_never_encoded() -> None:
    """Only a RecordMap promises records replaced, never changed in place."""
    log, serde = MessageLog(), JsonPlusSerializer()
    plain = {"a": {"x": 1}, "b": {"x": 2}}
    encoded, rows = log.encode(config("p"), _checkpoint({"steps": plain}), serde)
    assert rows is None
    assert encoded["channel_values"]["steps"] is plain
    records = RecordMap(plain)
    encoded, rows = log.encode(config("p"), _checkpoint({"steps": records}), serde)
    assert rows is not None
    assert len(rows.refs) == 2
    assert read_marker(encoded["channel_values"]["steps"]) == MessageRef(
        rows.sequences[0].seq, 2, True
    )
    # The same records under other keys are other entries.
    swapped = RecordMap({"b": records["a"], "a": records["b"]})
    _, rows = log.encode(config("p"), _checkpoint({"steps": swapped}), serde)
    assert rows is not None
    assert len(rows.refs) == 2


def cp_raw_value(cp: RecoveryCheckpointer, cfg: RunnableConfig, channel: str) -> Any:
    tup = cp.inner.get_tuple(cfg)
    assert tup is not None
    return tup.checkpoint["channel_values"][channel]


def test_message_rows_skip_their_fsync_only_in_wal_mode(tmp_path: Path) -> None:
    """Rows are committed without an fsync in WAL mode (the checkpoint's synced commit right
    after makes them durable with it); the connection's own level is restored at once, and
    outside WAL mode nothing changes."""
    from taskpilots_graph.checkpointers import sqlite as sqlite_store

    wal = sqlite3.connect(tmp_path / "wal.db")
    wal.execute("PRAGMA journal_mode=WAL")
    wal.execute("PRAGMA synchronous=FULL")
    assert sqlite_store._no_fsync(wal) == 2
    assert wal.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL for this commit
    rollback = sqlite3.connect(tmp_path / "rollback.db")
    rollback.execute("PRAGMA synchronous=FULL")
    assert sqlite_store._no_fsync(rollback) is None
    assert rollback.execute("PRAGMA synchronous").fetchone()[0] == 2

    with RecoveryCheckpointer.from_conn_string(f"sqlite:///{tmp_path / 'runs.db'}") as cp:
        cp.setup()
        conn = cp.inner.conn
        before = conn.execute("PRAGMA synchronous").fetchone()[0]
        build(cp).invoke(ask(5), config("f-1"), durability="sync")
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == before
        assert message_rows(cp, "f-1")[0] == 1 + 2 * 5 + 1


async def test_async_message_rows_restore_the_level(tmp_path: Path) -> None:
    async with AsyncRecoveryCheckpointer.from_conn_string(
        f"sqlite:///{tmp_path / 'runs.db'}"
    ) as cp:
        await cp.setup()
        conn = cp.inner.conn
        async with conn.execute("PRAGMA synchronous") as cur:
            before = (await cur.fetchone())[0]
        await build(cp).ainvoke(ask(5), config("f-2"), durability="sync")
        async with conn.execute("PRAGMA synchronous") as cur:
            assert (await cur.fetchone())[0] == before
        assert len((await build(cp).aget_state(config("f-2"))).values["messages"]) == 12
