"""The memory window as a context budget: by default the model sees its whole conversation;
``MemoryWindow(max_tokens=...)`` folds the oldest turns out of its view only above the budget,
whole, into lines naming tool, arguments, outcome and ledger key. Real graphs on real SQLite
files and PostgreSQL (the ``cp`` / ``acp`` fixtures)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pytest
from _models import ScriptedChatModel, tool_call
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.utils import count_tokens_approximately
from langchain_core.tools import BaseTool, StructuredTool
from pydantic import Field

import taskpilots_graph as tp
from taskpilots_graph._fold import FOLD_HEADER
from taskpilots_graph.conversation import valid_conversation
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.nodes.executor import RecoveryExecutor
from taskpilots_graph.testing import answered_calls
from taskpilots_graph.window import MemoryWindow, model_input, model_token_counter

_FOLDED_READ = re.compile(r"^- read_page\((\{.*?\})\) -> ok: ", re.MULTILINE)
_GOAL = re.compile(r"read (\d+) pages")


def read_pages(messages: Sequence[BaseMessage]) -> list[int]:
    """The pages a model reading ``messages`` knows it has read, in the order it sees them:
    from the answers in the conversation and from the folded lines of the system message."""
    read = []
    for m in messages:
        if isinstance(m, SystemMessage):
            read += [json.loads(args)["n"] for args in _FOLDED_READ.findall(str(m.content))]
        elif isinstance(m, ToolMessage) and m.status != "error":
            read.append(json.loads(str(m.content))["n"])
    return read


class ReaderModel(ScriptedChatModel):
    """Reads every page the goal names, in order, deciding from what its input shows."""

    def decide(self, messages: list[BaseMessage]) -> AIMessage:
        goal = next(m for m in messages if isinstance(m, HumanMessage))
        match = _GOAL.search(str(goal.content))
        assert match is not None
        seen = set(read_pages(messages))
        missing = [n for n in range(int(match.group(1))) if n not in seen]
        if not missing:
            return AIMessage(f"read {len(seen)} pages")
        return tool_call("read_page", {"n": missing[0]})


class OwnCounterReader(ReaderModel):
    """A reader whose provider counts tokens its own way: one token per character."""

    counted: list[int] = Field(default_factory=list)

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[Any] | None = None
    ) -> int:
        tokens = sum(
            len(str(m.content)) + len(json.dumps(getattr(m, "tool_calls", []))) for m in messages
        )
        self.counted.append(tokens)
        return tokens


def page_tool(calls: list[int]) -> BaseTool:
    def read_page(n: int) -> str:
        """Read page ``n`` of the report."""
        calls.append(n)
        return json.dumps({"n": n, "text": f"page {n} of the report " * 8})

    return StructuredTool.from_function(read_page)


def config(thread_id: str) -> Any:
    return {"configurable": {"thread_id": thread_id}, "recursion_limit": 1_000}


def approximate(messages: Sequence[BaseMessage]) -> int:
    return count_tokens_approximately(messages)


def folded(messages: Sequence[BaseMessage]) -> bool:
    return (
        bool(messages)
        and isinstance(messages[0], SystemMessage)
        and (FOLD_HEADER in str(messages[0].content))
    )


# --- the default: the whole conversation -------------------------------------------------------


def test_by_default_a_model_reading_its_conversation_reads_100_pages_once(
    cp: tp.RecoveryCheckpointer,
) -> None:
    """No window by default: every answer stays in view, so no page is read twice."""
    calls: list[int] = []
    model = ReaderModel()
    graph = tp.create_recovery_agent(model, [page_tool(calls)], checkpointer=cp, max_steps=200)
    out = graph.invoke({"messages": [HumanMessage("read 100 pages")]}, config("t-default"))

    assert calls == list(range(100))
    assert out["messages"][-1].content == "read 100 pages"
    # The last decision saw all 100 answers and no folded summary.
    assert read_pages(model.inputs[-1]) == list(range(100))
    assert not any(isinstance(m, SystemMessage) for m in model.inputs[-1])
    # The state keeps every message, and every step record.
    state = graph.get_state(config("t-default")).values
    assert sum(isinstance(m, ToolMessage) for m in state["messages"]) == 100
    assert len(state["steps"]) == 100


# --- the budget ---------------------------------------------------------------------------------


def test_the_budget_folds_nothing_at_or_below_it_and_the_least_above_it() -> None:
    """At the threshold the input is the whole conversation; above it, the fewest oldest
    turns fold that make it fit (checked against every possible folding)."""
    system = "You read reports."
    messages: list[BaseMessage] = [HumanMessage("read 6 pages")]
    for n in range(6):
        ai = tool_call("read_page", {"n": n})
        page = json.dumps({"n": n, "text": f"page {n} " * 40})
        messages += [ai, ToolMessage(page, tool_call_id=ai.tool_calls[0]["id"])]
    whole = model_input(system, None, messages)
    total = approximate(whole)
    assert model_input(system, None, messages, window(total)) == whole

    # Every possible folding of the first j turns, built by hand from the lines of the
    # deepest one (the last turn is kept whole).
    turns_in_view = MemoryWindow(
        max_tokens=1, token_counter=lambda shown: sum(isinstance(m, AIMessage) for m in shown)
    )
    deepest = model_input(system, None, messages, turns_in_view)
    lines = str(deepest[0].content).split("\n")[3:]
    assert len(lines) == 5

    def folding(j: int) -> list[BaseMessage]:
        text = "\n".join([FOLD_HEADER, *lines[:j]])
        return [SystemMessage(f"{system}\n\n{text}"), messages[0], *messages[1 + 2 * j :]]

    assert folding(5) == deepest
    sizes = [approximate(folding(j)) for j in range(1, 6)]
    for budget in range(total - 1, sizes[-1] - 1, -7):
        least = next(j for j, size in enumerate(sizes, start=1) if size <= budget)
        assert model_input(system, None, messages, window(budget)) == folding(least)
    assert read_pages(folding(1)) == list(range(6))  # the folded page is named, the rest in view


def window(budget: int, **kwargs: Any) -> MemoryWindow:
    return MemoryWindow(max_tokens=budget, token_counter=approximate, **kwargs)


def test_a_turn_folds_whole_and_its_line_names_key_tool_args_outcome(
    cp: tp.RecoveryCheckpointer,
) -> None:
    """Two calls in one turn leave together; a side effect's line carries its ledger key,
    a failed call its error."""
    recorded: list[str] = []

    def lookup(order_id: str) -> str:
        """Look up an order."""
        return json.dumps({"order_id": order_id, "status": "shipped", "notes": "fragile " * 60})

    def refund(order_id: str, amount: int) -> str:
        """Refund an order (a side effect)."""
        recorded.append(order_id)
        return f"refund R-{order_id} of {amount} issued"

    class Clerk(ScriptedChatModel):
        def decide(self, messages: list[BaseMessage]) -> AIMessage:
            # Decides from what it sees: answers in view and lines folded into the system.
            text = "\n".join(str(m.content) for m in messages)
            if "refund R-o-1" not in text:
                calls = [
                    {"name": "lookup", "args": {"order_id": "o-1"}, "id": "call_look"},
                    {"name": "refund", "args": {"order_id": "o-1", "amount": 30}, "id": "call_ref"},
                ]
                return AIMessage("", tool_calls=calls)
            if "unknown tool" not in text:
                return tool_call("cancel", {"order_id": "o-1"})
            reads = len(re.findall(r'"status": "shipped"', text))
            if reads < 6:
                return tool_call("lookup", {"order_id": f"o-{reads + 1}"})
            return AIMessage("refunded o-1")

    model = Clerk()
    tools = [
        StructuredTool.from_function(lookup),
        tp.side_effect(StructuredTool.from_function(refund)),
    ]
    budget = 800
    graph = tp.create_recovery_agent(
        model,
        tools,
        checkpointer=cp,
        memory_window=MemoryWindow(max_tokens=budget, line_chars=60),
    )
    graph.invoke({"messages": [HumanMessage("refund order o-1")]}, config("t-clerk"))

    assert recorded == ["o-1"]
    (entry,) = cp.ledger("t-clerk")
    shown = model.inputs[-1]
    assert folded(shown)
    summary = str(shown[0].content)
    assert "not listed" not in summary  # every folded call has its line
    assert '- lookup({"order_id": "o-1"}) -> ok: {"order_id": "o-1", "status": "shipped", ' in (
        summary
    )
    assert (
        f'- refund({{"order_id": "o-1", "amount": 30}}) -> ok: refund R-o-1 of 30 issued\n'
        f"  ledger key: {entry.key}"
    ) in summary
    assert '- cancel({"order_id": "o-1"}) -> failed: Error: unknown tool' in summary
    for conversation in model.inputs:
        # Calls and answers together: what the provider gets needs no repair.
        assert valid_conversation(conversation) == conversation
        in_view = {m.tool_call_id for m in conversation if isinstance(m, ToolMessage)}
        asked = {c["id"] for m in conversation if isinstance(m, AIMessage) for c in m.tool_calls}
        assert in_view == asked
        assert len(in_view & {"call_look", "call_ref"}) in (0, 2)  # the turn leaves whole
        assert model_token_counter(model, tools)(conversation) <= budget
    # The state keeps every message: the fold is a view.
    state = graph.get_state(config("t-clerk")).values
    assert sum(isinstance(m, ToolMessage) for m in state["messages"]) == 8


def test_under_a_budget_a_reader_of_its_input_reads_every_page_once(
    cp: tp.RecoveryCheckpointer,
) -> None:
    """Folded pages stay named in the summary, so the reader does not read them again."""
    calls: list[int] = []
    model = ReaderModel()
    budget = 3_000
    graph = tp.create_recovery_agent(
        model,
        [page_tool(calls)],
        checkpointer=cp,
        max_steps=200,
        memory_window=MemoryWindow(max_tokens=budget, line_chars=40),
    )
    graph.invoke({"messages": [HumanMessage("read 60 pages")]}, config("t-budget"))

    assert calls == list(range(60))
    counter = model_token_counter(model, [page_tool([])])
    first_fold = next(i for i, shown in enumerate(model.inputs) if folded(shown))
    assert first_fold > 5  # nothing folds until the conversation outgrows the budget
    for i, shown in enumerate(model.inputs):
        assert counter(shown) <= budget
        assert folded(shown) == (i >= first_fold)
        assert read_pages(shown) == list(range(i))  # every page read so far, once


def test_the_step_budget_counts_decisions_folded_out_of_view(cp: tp.RecoveryCheckpointer) -> None:
    """``max_steps`` counts from the state, which keeps every decision the view folded."""

    class Forever(ScriptedChatModel):
        def decide(self, messages: list[BaseMessage]) -> AIMessage:
            return tool_call("read_page", {"n": len(read_pages(messages))})

    calls: list[int] = []
    model = Forever()
    graph = tp.create_recovery_agent(
        model,
        [page_tool(calls)],
        checkpointer=cp,
        memory_window=MemoryWindow(max_tokens=400, line_chars=20),
        max_steps=8,
    )
    graph.invoke({"messages": [HumanMessage("read on")]}, config("t-stuck"))
    assert calls == list(range(8))
    assert any(folded(shown) for shown in model.inputs)
    assert [r.thread_id for r in tp.pending_takeovers(cp, thread_ids=["t-stuck"])] == ["t-stuck"]


async def test_async_runs_fold_with_the_models_own_counter(acp: Any) -> None:
    """A model with its own tokenizer is measured with it (here: a token per character)."""
    calls: list[int] = []
    model = OwnCounterReader()
    budget = 2_500
    graph = tp.create_recovery_agent(
        model,
        [page_tool(calls)],
        checkpointer=acp,
        max_steps=200,
        memory_window=MemoryWindow(max_tokens=budget, line_chars=40),
    )
    await graph.ainvoke({"messages": [HumanMessage("read 20 pages")]}, config("t-own"))

    assert calls == list(range(20))
    assert model.counted, "the model's own counter was not used"
    for i, shown in enumerate(model.inputs):
        assert model.get_num_tokens_from_messages(shown) <= budget
        assert read_pages(shown) == list(range(i))
    # By the approximate count (~4 characters a token) the same inputs are far below the
    # budget: only the model's own count made them fold.
    assert any(folded(shown) for shown in model.inputs)
    assert max(approximate(shown) for shown in model.inputs) < budget / 2


def test_the_counter_is_the_models_own_where_it_has_one_else_approximate() -> None:
    """``get_num_tokens_from_messages`` when overridden (through a binding too), else
    langchain's approximation with the tool schemas counted."""
    tools = [page_tool([])]
    messages: list[BaseMessage] = [HumanMessage("read 3 pages"), tool_call("read_page", {"n": 0})]
    own = OwnCounterReader()
    assert model_token_counter(own, tools)(messages) == own.get_num_tokens_from_messages(messages)
    assert model_token_counter(own.bind(stop=["."]), tools)(messages) == own.counted[-1]
    # A model without a tokenizer of its own: langchain's approximation (not the base
    # class's GPT-2 tokenizer, which would warn and need transformers), tools included.
    plain = model_token_counter(ReaderModel(), tools)(messages)
    assert plain == count_tokens_approximately(messages, tools=tools)  # type: ignore[arg-type]
    assert plain > count_tokens_approximately(messages)


def test_when_even_the_lines_do_not_fit_the_oldest_become_counts() -> None:
    """A run longer than its budget can list: the oldest lines are counted per tool, and a
    model counting its finished calls still gets the exact number."""
    messages: list[BaseMessage] = [HumanMessage("read 300 pages")]
    for n in range(300):
        ai = tool_call("read_page", {"n": n})
        page = json.dumps({"n": n})
        messages += [ai, ToolMessage(page, tool_call_id=ai.tool_calls[0]["id"])]
    budget = 2_000
    shown = model_input(None, None, messages, window(budget))

    assert approximate(shown) <= budget
    summary = str(shown[0].content)
    match = re.search(
        r"^- (\d+) earlier tool call\(s\) not listed\n  by tool: read_page (\d+) ok$",
        summary,
        re.MULTILINE,
    )
    assert match is not None
    assert match.group(1) == match.group(2)
    listed = read_pages(shown)
    assert listed == list(range(int(match.group(1)), 300))  # the newest, in order
    assert answered_calls(shown) == 300


def test_turns_kept_whole_open_turns_and_user_messages_never_fold() -> None:
    """Only answered turns older than the last ``keep_turns`` fold, whatever the budget."""
    human = HumanMessage("goal")
    done = tool_call("read_page", {"n": 0})
    answer = ToolMessage("page 0 " * 200, tool_call_id=done.tool_calls[0]["id"])
    later = HumanMessage("and also this " * 50)
    open_call = tool_call("read_page", {"n": 1})
    messages: list[BaseMessage] = [human, done, answer, later, open_call]
    # Only the first, answered turn can fold; the user's messages and the open call stay.
    shown = model_input(None, None, messages, window(approximate(messages) - 1))
    assert shown[1:] == [human, later, open_call]
    assert '- read_page({"n": 0}) -> ok: page 0' in str(shown[0].content)
    # Below what cannot fold, the budget is exceeded, never broken.
    assert model_input(None, None, messages, window(10))[1:] == [human, later, open_call]
    # keep_turns: the newest answered turns stay whole whatever the budget.
    kept = model_input(None, None, messages[:4], window(10, keep_turns=1))
    assert kept == messages[:4]


def test_a_thread_folded_by_an_earlier_version_still_shows_its_lines() -> None:
    """The ``memory`` channel an earlier version wrote still reaches the model and counts."""
    memory: Any = {
        "earlier": [{"tool": "read_page", "args": "{'n': 4}", "status": "ok", "result": "page 4"}],
        "folded": 4,
        "folded_done": {"read_page": 4},
    }
    shown = model_input("Be brief.", memory, [HumanMessage("read 6 pages")])
    assert isinstance(shown[0], SystemMessage)
    assert "- 4 earlier tool call(s) not listed" in str(shown[0].content)
    assert answered_calls(shown) == 5


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({}, "max_tokens"),
        ({"raw_turns": 2}, "removed"),
        ({"max_tokens": 100, "summaries": 6}, "removed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 100, "keep_turns": 0}, "keep_turns"),
        ({"max_tokens": 100, "line_chars": 5}, "line_chars"),
        ({"max_tokens": 100, "token_counter": "tiktoken"}, "token_counter"),
    ],
)
def test_the_window_validates_and_names_the_fix(kwargs: dict[str, Any], says: str) -> None:
    """No budget, the removed keywords and values out of range are refused, saying why."""
    with pytest.raises(ConfigurationError, match=says):
        MemoryWindow(**kwargs)


def test_the_executor_no_longer_takes_a_window(cp: tp.RecoveryCheckpointer) -> None:
    """The budget moved to the think node; the executor says where."""
    with pytest.raises(ConfigurationError, match="ThinkNode"):
        RecoveryExecutor([page_tool([])], checkpointer=cp, memory_window=object())  # type: ignore[arg-type]


def test_the_step_budget_counts_alike_on_growing_and_unrelated_conversations() -> None:
    """The decisions of the user's turn are counted from the new messages only when the
    conversation grew from the last one counted; any other conversation is counted whole.
    Either way the count is the one a full scan gives."""
    import random

    from taskpilots_graph.window import decisions_this_turn

    rng = random.Random(3)

    def message(n: int) -> Any:
        kind = rng.choice(["user", "resume", "calls", "calls", "answer", "tool"])
        if kind == "user":
            return HumanMessage(f"do {n}", id=f"u{n}")
        if kind == "resume":
            return HumanMessage("resumed", name="taskpilots_resume", id=f"r{n}")
        if kind == "calls":
            return AIMessage("", tool_calls=[{"name": "t", "args": {}, "id": f"c{n}"}])
        if kind == "answer":
            return AIMessage("done")
        return ToolMessage("r", tool_call_id=f"c{n}")

    def full_scan(messages: list[Any]) -> tuple[str | None, int]:
        last = max(
            (
                i
                for i, m in enumerate(messages)
                if isinstance(m, HumanMessage) and m.name != "taskpilots_resume"
            ),
            default=-1,
        )
        count = sum(1 for m in messages[last + 1 :] if isinstance(m, AIMessage) and m.tool_calls)
        return (messages[last].id if last >= 0 else None), count

    conversations: list[list[Any]] = []
    for _ in range(40):
        grown: list[Any] = []
        for n in range(30):
            grown = [*grown, message(n)]
            conversations.append(grown)
    rng.shuffle(conversations[len(conversations) // 2 :])  # unrelated ones in between
    for messages in conversations:
        assert decisions_this_turn(messages, None) == full_scan(messages)


class _CountedReads(list[Any]):
    """A conversation that counts the messages read from it one by one."""

    reads = 0

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int):
            self.reads += 1
        return super().__getitem__(key)


def _turn(n: int) -> list[Any]:
    call = {"name": "t", "args": {"n": n}, "id": f"turn-{n}"}
    return [AIMessage("", tool_calls=[call]), ToolMessage("r", tool_call_id=f"turn-{n}")]


def test_with_a_prompt_the_validity_check_reads_only_the_new_turn() -> None:
    """The prompt's system message is new at every model call; the check of the
    conversation behind it still reads only the messages added since the last call."""
    conversation: list[Any] = [HumanMessage("go")]
    reads = []
    for n in range(60):
        conversation = [*conversation, *_turn(n)]
        counted = _CountedReads([SystemMessage("the prompt"), *conversation])
        assert valid_conversation(counted) == list(counted)
        reads.append(counted.reads)
    assert max(reads[1:]) <= 6  # the system message, the first after it, the new turn


def test_leading_system_messages_never_hide_a_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversations behind one or more system messages built anew at every call: faults
    after a remembered valid prefix are still repaired, as a full check repairs them."""
    import random

    import taskpilots_graph.conversation as conversation

    rng = random.Random(11)
    checked = []
    for _ in range(200):
        grown: list[Any] = [HumanMessage("go")]
        for n in range(10):
            grown = [*grown, *_turn(n)]
            if rng.random() < 0.2:
                grown = [*grown, ToolMessage("stray", tool_call_id=f"turn-{n}")]
            if rng.random() < 0.1:
                grown = [*grown, AIMessage("", tool_calls=[{"name": "t", "args": {}, "id": "x"}])]
            heads = [SystemMessage(f"prompt {k}") for k in range(rng.randint(0, 2))]
            checked.append([*heads, *grown])
    fast = [valid_conversation(m) for m in checked]
    assert any(len(f) != len(m) for f, m in zip(fast, checked, strict=True))  # some repaired
    monkeypatch.setattr(conversation, "_answered", lambda messages: False)
    assert fast == [valid_conversation(m) for m in checked]
