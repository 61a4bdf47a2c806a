"""The recovery agent's ``messages`` reducer is LangGraph's ``add_messages``, made linear.

``merge_messages`` (taskpilots_graph/_messages) keeps each list's id index and appends in
O(new messages). Every result must be ``add_messages``' result: same messages, same objects
where ``add_messages`` keeps them, same ids, same errors, through appends, replacements,
removals, ``REMOVE_ALL_MESSAGES``, coercion, branches (two merges from one list, as
LangGraph's conditional edges do) and lists changed in place. Real graphs on a real SQLite
file check the same against an ``add_messages`` state, and that the message store still
stores each message once.
"""

from __future__ import annotations

import copy
import itertools
import json
import pickle
import random
import sqlite3
import typing
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pytest
from _models import ScriptedChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    AnyMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import StructuredTool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES, add_messages
from typing_extensions import TypedDict

import taskpilots_graph as tp
from taskpilots_graph import _messages
from taskpilots_graph._messages import MessageList, merge_messages
from taskpilots_graph.state import RecoveryState

Reducer = Callable[[Any, Any], Any]


@pytest.fixture
def counted_ids(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Ids that both reducers draw from one resettable counter, so that the ids they give
    messages without one can be compared."""
    counter = itertools.count()

    def fake_uuid4() -> uuid.UUID:
        return uuid.UUID(int=next(counter))

    def reset() -> None:
        nonlocal counter
        counter = itertools.count()

    monkeypatch.setattr(uuid, "uuid4", fake_uuid4)
    return reset


# --- the randomised comparison --------------------------------------------------------------


def _origins(result: list[Any], left: list[Any], right: list[Any]) -> list[Any]:
    """Where each message of a result comes from: position in ``left``, in ``right``, or a
    new object (coerced from a dict, tuple, string or chunk)."""
    in_left = {id(m): i for i, m in enumerate(left)}
    in_right = {id(m): i for i, m in enumerate(right)}
    return [
        ("left", in_left[id(m)])
        if id(m) in in_left
        else ("right", in_right[id(m)])
        if id(m) in in_right
        else "new"
        for m in result
    ]


def _same(ours: list[Any], theirs: list[Any]) -> None:
    assert [type(m) for m in ours] == [type(m) for m in theirs]
    assert [m.id for m in ours] == [m.id for m in theirs]
    assert list(ours) == list(theirs)


class _Run:
    """One random history of merges, applied to two worlds: ``merge_messages`` and
    ``add_messages``, each with its own copies of every message."""

    def __init__(self, seed: int, reset_ids: Callable[[], None]) -> None:
        self.rng = random.Random(seed)
        self.reset_ids = reset_ids
        self.serial = 0
        start = self._seed_list()
        # Pools of lists a merge may start from, position by position the same in both
        # worlds: the channel's empty start, a list with id-less messages, then results.
        self.ours: list[list[Any]] = [[], start]
        self.theirs: list[list[Any]] = [[], copy.deepcopy(start)]

    def _seed_list(self) -> list[Any]:
        return [HumanMessage("hello"), AIMessage("hi", id="a-0"), HumanMessage("more")]

    def _new_id(self) -> str:
        self.serial += 1
        return f"m-{self.serial}"

    def _message(self, message_id: str | None) -> BaseMessage:
        text = f"text {self.rng.randrange(1000)}"
        kind = self.rng.randrange(4)
        if kind == 0:
            return HumanMessage(text, id=message_id)
        if kind == 1:
            return ToolMessage(text, tool_call_id=f"call-{self.serial}", id=message_id)
        if kind == 2:
            call = {"name": "f", "args": {"x": text}, "id": f"call-{self.serial}"}
            return AIMessage("", tool_calls=[call], id=message_id)
        return AIMessage(text, id=message_id)

    def _right(self, base: list[Any]) -> Any:
        rng = self.rng
        ids = [m.id for m in base if isinstance(m, BaseMessage) and m.id is not None]
        items: list[Any] = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            roll = rng.random()
            if roll < 0.45:
                items.append(self._message(self._new_id()))
            elif roll < 0.55:
                items.append(self._message(None))
            elif roll < 0.68 and ids:
                items.append(self._message(rng.choice(ids)))  # replaces it
            elif roll < 0.73 and ids:
                items.append(RemoveMessage(id=rng.choice(ids)))
            elif roll < 0.75:
                items.append(RemoveMessage(id="no-such-message"))
            elif roll < 0.77:
                items.append(RemoveMessage(id=REMOVE_ALL_MESSAGES))
            elif roll < 0.81:
                items.append({"role": "user", "content": "as a dict", "id": self._new_id()})
            elif roll < 0.83:
                items.append(("assistant", "as a tuple"))
            elif roll < 0.85:
                items.append("as a string")
            elif roll < 0.88:
                items.append(AIMessageChunk("a chunk", id=self._new_id()))
            elif roll < 0.93 and items and isinstance(items[-1], BaseMessage):
                repeat = self._message(items[-1].id)  # the same id twice in one update
                items.append(repeat)
            else:
                items.append(self._message(self._new_id()))
        if len(items) == 1 and rng.random() < 0.3:
            return items[0]  # a single message, not a list
        return items

    def _mutate(self, ours: list[Any], theirs: list[Any]) -> None:
        """The same in-place change on both sides (a node changing ``state["messages"]``)."""
        rng = self.rng
        message = self._message(self._new_id())
        twin = copy.deepcopy(message)
        how = rng.randrange(6)
        if how == 0:
            ours.append(message)
            theirs.append(twin)
        elif how == 1 and ours:
            i = rng.randrange(len(ours))
            ours[i] = message
            theirs[i] = twin
        elif how == 2 and ours:
            ours.pop()
            theirs.pop()
        elif how == 3:
            ours.insert(0, message)
            theirs.insert(0, twin)
        elif how == 4 and ours:
            # A duplicate id: add_messages indexes the last occurrence.
            dup = copy.deepcopy(ours[0])
            ours.append(dup)
            theirs.append(copy.deepcopy(theirs[0]))
        else:
            ours += [message]
            theirs += [twin]

    def step(self, merge: Reducer) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.6:
            at = len(self.ours) - 1  # the latest value
        elif roll < 0.8:
            at = max(0, len(self.ours) - 2)  # the value a sibling merge started from
        else:
            at = rng.randrange(len(self.ours))  # any earlier value (a fork)
        left_ours, left_theirs = self.ours[at], self.theirs[at]
        right = self._right(left_theirs)
        right_ours, right_theirs = copy.deepcopy(right), copy.deepcopy(right)
        shapshot_ours = list(left_ours)
        error_ours: Exception | None = None
        error_theirs: Exception | None = None
        self.reset_ids()
        try:
            result_ours = merge(left_ours, right_ours)
        except ValueError as exc:
            error_ours = exc
        self.reset_ids()
        try:
            result_theirs = add_messages(left_theirs, right_theirs)
        except ValueError as exc:
            error_theirs = exc
        assert list(left_ours) == shapshot_ours, "left was changed"
        assert all(a is b for a, b in zip(left_ours, shapshot_ours, strict=True))
        if error_theirs is not None or error_ours is not None:
            assert str(error_ours) == str(error_theirs)
            return
        _same(result_ours, result_theirs)
        as_list = list if isinstance(right_ours, list) else lambda r: [r]
        assert _origins(result_ours, left_ours, as_list(right_ours)) == _origins(
            result_theirs, left_theirs, as_list(right_theirs)
        )
        if rng.random() < 0.1:
            self._mutate(result_ours, result_theirs)
            _same(result_ours, result_theirs)
        self.ours.append(result_ours)
        self.theirs.append(result_theirs)


def check_equivalent(merge: Reducer, reset_ids: Callable[[], None], runs: int = 40) -> None:
    for seed in range(runs):
        run = _Run(seed, reset_ids)
        for _ in range(60):
            run.step(merge)


def test_random_histories_match_add_messages(counted_ids: Callable[[], None]) -> None:
    """Thousands of random merges (appends, replacements, removals, REMOVE_ALL, coercion,
    chunks, id-less messages, branches, in-place changes) give add_messages' results,
    objects and errors."""
    check_equivalent(merge_messages, counted_ids)


def test_the_comparison_catches_a_list_changed_in_place(
    counted_ids: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With in-place changes no longer noticed (a stale index trusted), the random
    comparison fails: it has the power to catch a broken index."""
    monkeypatch.setattr(MessageList, "_changed", lambda self: None)
    with pytest.raises(AssertionError):
        check_equivalent(merge_messages, counted_ids)


def test_the_comparison_catches_a_shared_index_overwritten_by_a_branch(
    counted_ids: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a branch writing into the index it shares with its sibling instead of copying
    it, the random comparison fails."""

    def no_copy(index: dict[Any, int]) -> dict[Any, int]:
        return index

    monkeypatch.setattr(_messages, "dict", no_copy, raising=False)
    with pytest.raises(AssertionError):
        check_equivalent(merge_messages, counted_ids)


# --- explicit cases -------------------------------------------------------------------------


def _grown(n: int) -> Any:
    value: Any = []
    for i in range(n):
        value = merge_messages(value, [AIMessage(f"m{i}", id=f"id-{i}")])
    return value


def test_appends_to_its_own_list_do_not_go_through_add_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Appending to a list the reducer returned uses its index (add_messages, which indexes
    the whole list, is not called); a plain list goes through add_messages once."""
    calls: list[int] = []

    def counting(left: Any, right: Any) -> Any:
        calls.append(len(left))
        return add_messages(left, right)

    monkeypatch.setattr(_messages, "add_messages", counting)
    value = _grown(50)
    assert calls == [0]  # the channel's empty start only
    assert isinstance(value, MessageList)
    assert [m.id for m in value] == [f"id-{i}" for i in range(50)]
    merge_messages(list(value), [AIMessage("x", id="y")])
    assert calls == [0, 50]


def test_replacement_keeps_the_position_and_the_other_objects() -> None:
    """A message with an existing id replaces it in place; the others are the same objects."""
    value = _grown(5)
    edited = AIMessage("edited", id="id-2")
    result = merge_messages(value, edited)
    assert [m.content for m in result] == ["m0", "m1", "edited", "m3", "m4"]
    assert result[2] is edited
    assert all(result[i] is value[i] for i in (0, 1, 3, 4))
    assert value[2].content == "m2"  # left untouched


def test_messages_without_an_id_get_one() -> None:
    """Like add_messages, an id-less message gets a uuid, assigned on the message itself."""
    message = HumanMessage("no id")
    result = merge_messages(_grown(2), [message])
    assert message.id is not None
    assert result[-1] is message
    uuid.UUID(message.id)


def test_removal_and_remove_all() -> None:
    """``RemoveMessage`` drops one message; a later same-id message in the same update
    brings it back in place; ``REMOVE_ALL_MESSAGES`` keeps only what follows it."""
    value = _grown(4)
    removed = merge_messages(value, [RemoveMessage(id="id-1")])
    assert [m.id for m in removed] == ["id-0", "id-2", "id-3"]
    back = merge_messages(value, [RemoveMessage(id="id-1"), AIMessage("again", id="id-1")])
    assert [m.content for m in back] == ["m0", "again", "m2", "m3"]
    after_all = merge_messages(
        value, [AIMessage("gone"), RemoveMessage(id=REMOVE_ALL_MESSAGES), SystemMessage("s")]
    )
    assert [type(m) for m in after_all] == [SystemMessage]
    # Appends continue from each of these as from any list.
    assert [m.id for m in merge_messages(removed, AIMessage("n", id="n"))][-2:] == ["id-3", "n"]


def test_errors_are_add_messages_errors() -> None:
    """Removing an unknown id, or a missing argument, raises add_messages' ValueError."""
    value = _grown(3)
    with pytest.raises(ValueError, match="Attempting to delete a message with an ID"):
        merge_messages(value, [RemoveMessage(id="nope")])
    with pytest.raises(ValueError, match="Must specify non-null arguments"):
        merge_messages(value, None)


def test_coercion_of_dicts_tuples_strings_and_chunks() -> None:
    """Inputs that are not messages are coerced as add_messages coerces them."""
    value = _grown(1)
    result = merge_messages(
        value,
        [
            {"role": "user", "content": "d", "id": "d"},
            ("assistant", "t"),
            "s",
            AIMessageChunk("c", id="c"),
        ],
    )
    assert [type(m) for m in result] == [
        AIMessage,
        HumanMessage,
        AIMessage,
        HumanMessage,
        AIMessage,
    ]
    assert [m.content for m in result] == ["m0", "d", "t", "s", "c"]
    assert all(m.id for m in result)


def test_two_merges_from_one_list_stay_exact() -> None:
    """Two branches appending different messages from the same list (and a third adding
    the other's id at another position) each get add_messages' result."""
    base = _grown(3)
    a = merge_messages(base, [AIMessage("a", id="x")])
    b = merge_messages(base, [AIMessage("b", id="y"), AIMessage("b2", id="x")])
    assert [m.id for m in a] == ["id-0", "id-1", "id-2", "x"]
    assert [m.id for m in b] == ["id-0", "id-1", "id-2", "y", "x"]
    # Replacing "x" in each branch replaces it where that branch holds it.
    a2 = merge_messages(a, [AIMessage("a-edit", id="x")])
    b2 = merge_messages(b, [AIMessage("b-edit", id="x")])
    assert [m.content for m in a2] == ["m0", "m1", "m2", "a-edit"]
    assert [m.content for m in b2] == ["m0", "m1", "m2", "b", "b-edit"]
    assert merge_messages(a, [AIMessage("y-in-a", id="y")])[-1].content == "y-in-a"
    assert len(merge_messages(a, [AIMessage("y-in-a", id="y")])) == 5


def test_in_place_changes_are_noticed() -> None:
    """A list changed in place through a list method is re-indexed by the next merge."""
    value = _grown(3)
    value.insert(0, AIMessage("first", id="first"))  # every position moves
    result = merge_messages(value, [AIMessage("edit", id="id-2")])
    assert [m.content for m in result] == ["first", "m0", "m1", "edit"]
    reference = add_messages(list(value), [AIMessage("edit", id="id-2")])
    assert result == reference


def test_readers_get_a_plain_list() -> None:
    """Pickle and copy give the plain list add_messages would have given."""
    value = _grown(3)
    for clone in (pickle.loads(pickle.dumps(value)), copy.copy(value), copy.deepcopy(value)):
        assert type(clone) is list
        assert clone == value
    assert type(value[:2]) is list


# --- real graphs ----------------------------------------------------------------------------


class MergedState(TypedDict):
    messages: Annotated[list[AnyMessage], merge_messages]


class AddedState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def _reader(state: dict[str, Any]) -> dict[str, Any]:
    """Reads a page per step until the request is met; ids from the list length, so both
    graphs produce the same messages."""
    messages = state["messages"]
    asked = next(m for m in reversed(messages) if isinstance(m, HumanMessage))
    goal = int(json.loads(str(asked.content))["steps"])
    done = sum(isinstance(m, ToolMessage) for m in messages)
    k = len(messages)
    if done >= goal:
        return {"messages": [AIMessage(f"read {done}", id=f"final-{k}")]}
    call = {"name": "fetch", "args": {"n": done}, "id": f"call-{k}", "type": "tool_call"}
    return {"messages": [AIMessage("", id=f"ai-{k}", tool_calls=[call])]}


def _fetch(state: dict[str, Any]) -> dict[str, Any]:
    call = state["messages"][-1].tool_calls[0]
    text = f"page {call['args']['n']}"
    return {"messages": [ToolMessage(text, id=f"t-{call['id']}", tool_call_id=call["id"])]}


def _route(state: dict[str, Any]) -> str:
    last = state["messages"][-1]
    return "fetch" if isinstance(last, AIMessage) and last.tool_calls else END


def _graph(schema: type[Any], cp: Any) -> Any:
    graph = StateGraph(schema)
    graph.add_node("reader", _reader)
    graph.add_node("fetch", _fetch)
    graph.add_edge(START, "reader")
    graph.add_conditional_edges("reader", _route, ["fetch", END])
    graph.add_edge("fetch", "reader")
    return graph.compile(checkpointer=cp)


def _cfg(thread_id: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id}, "recursion_limit": 1000}


def _ask(steps: int) -> dict[str, Any]:
    return {"messages": [HumanMessage(json.dumps({"steps": steps}), id="ask")]}


def _stored_messages(path: Path, thread_id: str) -> dict[str, int]:
    """How many stored versions each message id has (step records are stored there too,
    under their tool-call ids)."""
    with sqlite3.connect(path) as conn:
        sql = "SELECT message_id, count(*) FROM taskpilots_messages WHERE thread_id = ? GROUP BY 1"
        return dict(conn.execute(sql, (thread_id,)).fetchall())


def test_graphs_match_an_add_messages_graph_on_sqlite(tmp_path: Path) -> None:
    """On a real SQLite file, a graph whose state uses merge_messages reads back every
    checkpoint of an add_messages graph's history (runs, edits, removals, a fork), and
    stores each message once."""
    path = tmp_path / "graphs.db"
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{path}") as cp:
        cp.setup()
        ours, theirs = _graph(MergedState, cp), _graph(AddedState, cp)
        for graph, thread in ((ours, "ours"), (theirs, "theirs")):
            graph.invoke(_ask(25), _cfg(thread), durability="sync")
        latest = ours.get_state(_cfg("ours")).values["messages"]
        assert len(latest) == 1 + 2 * 25 + 1
        stored = _stored_messages(path, "ours")
        assert [stored[str(m.id)] for m in latest] == [1] * len(latest)  # once each
        assert sum(stored.values()) == len(latest)
        for graph, thread in ((ours, "ours"), (theirs, "theirs")):
            middle = graph.get_state(_cfg(thread)).values["messages"][9]
            graph.update_state(_cfg(thread), {"messages": [RemoveMessage(id=str(middle.id))]})
            graph.update_state(_cfg(thread), {"messages": [AIMessage("edited", id="final-51")]})
            graph.invoke(_ask(30), _cfg(thread), durability="sync")
            old = next(
                s for s in graph.get_state_history(_cfg(thread)) if len(s.values["messages"]) == 11
            )
            forked = graph.update_state(old.config, _ask(8))
            graph.invoke(None, forked, durability="sync")
        histories = [
            [s.values["messages"] for s in graph.get_state_history(_cfg(thread))]
            for graph, thread in ((ours, "ours"), (theirs, "theirs"))
        ]
        assert len(histories[0]) == len(histories[1]) > 60
        for mine, reference in zip(*histories, strict=True):
            _same(mine, reference)


def fetch_page(n: int) -> str:
    """Page ``n`` of the document."""
    return f"page {n}: " + "x" * 200


def test_recovery_agent_state_stores_each_message_once(tmp_path: Path) -> None:
    """create_recovery_agent's state (merge_messages) keeps the whole conversation, the
    model sees every earlier result, and the SQLite store holds each message once."""

    class Reader(ScriptedChatModel):
        def decide(self, messages: list[BaseMessage]) -> AIMessage:
            done = sum(isinstance(m, ToolMessage) for m in messages)
            if done >= 40:
                return AIMessage(f"read {done} pages")
            call = {"name": "fetch_page", "args": {"n": done}, "id": f"call_{uuid.uuid4().hex}"}
            return AIMessage("", tool_calls=[call])

    hints = typing.get_type_hints(RecoveryState, include_extras=True)
    assert hints["messages"].__metadata__ == (merge_messages,)
    path = tmp_path / "agent.db"
    model = Reader()
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{path}") as cp:
        cp.setup()
        graph = tp.create_recovery_agent(
            model, [StructuredTool.from_function(fetch_page)], checkpointer=cp, max_steps=100
        )
        out = graph.invoke({"messages": [("user", "read")]}, _cfg("agent"), durability="sync")
        messages = out["messages"]
        assert messages[-1].content == "read 40 pages"
        last_input = model.inputs[-1]
        assert sum(isinstance(m, ToolMessage) for m in last_input) == 40
        stored = _stored_messages(path, "agent")
        assert [stored.get(str(m.id)) for m in messages] == [1] * len(messages)
        _same(graph.get_state(_cfg("agent")).values["messages"], messages)
