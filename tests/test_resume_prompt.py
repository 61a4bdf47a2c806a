# ruff: noqa: RUF001  (the Chinese golden text uses full-width punctuation on purpose)
"""The resume prompt: golden texts, the size budget over long histories, and the think node.

The pure half builds graph states and ledger entries by hand and checks ``resume_facts`` and
``build_resume_prompt`` against exact expected texts (English and Chinese), and against a
budget after 1,000 recorded steps. The graph half crashes a run with a tool call left
without an answer and checks, through a scripted chat model that keeps its inputs, what
``tp.resume`` makes the next model call receive: a history a provider accepts, the resume
prompt, refreshed data, and the optional acknowledgement.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import traceback
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from _models import PlanModel
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import StructuredTool
from pydantic import Field

import taskpilots_graph as tp
from taskpilots_graph.ledger import args_digest
from taskpilots_graph.nodes.think import ResumeContext
from taskpilots_graph.prompts import (
    DEFAULT_MAX_CHARS,
    TEMPLATES,
    ResumeFacts,
    build_resume_prompt,
    resume_facts,
)
from taskpilots_graph.state import StepRecord
from taskpilots_graph.testing import answered_calls
from taskpilots_graph.window import MemoryWindow

WHEN = datetime(2025, 1, 1, tzinfo=UTC)
UNCERTAIN_REASON = "refund: a side effect may or may not have happened"


# --- building states by hand ------------------------------------------------------------------


def ledger_entry(
    key: str, tool: str, status: tp.LedgerStatus, args: Mapping[str, Any]
) -> tp.LedgerEntry:
    return tp.LedgerEntry(
        key=key,
        thread_id="t",
        tool=tool,
        status=status,
        args=dict(args),
        args_digest=args_digest(args),
        attempt=1,
        created_at=WHEN,
        updated_at=WHEN,
    )


def call(call_id: str, tool: str, args: dict[str, Any]) -> AIMessage:
    return AIMessage("", tool_calls=[{"name": tool, "args": args, "id": call_id}])


def closed_step(call_id: str, tool: str, args: dict[str, Any], result: str) -> StepRecord:
    return {
        "tool_call_id": call_id,
        "tool": tool,
        "using": tool,
        "args": args,
        "status": "closed",
        "failure": None,
        "result": result,
    }


def uncertain_step(call_id: str, tool: str, args: dict[str, Any]) -> StepRecord:
    return {
        "tool_call_id": call_id,
        "tool": tool,
        "using": tool,
        "args": args,
        "status": "awaiting_human",
        "attempts": 1,
        "failure": {"kind": "side_effect_uncertain", "message": "timed out after sending"},
    }


REFUND = {"order": "o-7", "amount": 40}
EMAIL = {"to": "c-1", "template": "refund_started"}


def small_state(goal: str) -> tuple[dict[str, Any], list[tp.LedgerEntry]]:
    """Two done steps (one a committed email), then a refund of unknown outcome."""
    messages = [
        HumanMessage(goal),
        call("c1", "lookup_order", {"order": "o-7"}),
        ToolMessage("order o-7: 40 EUR, paid", tool_call_id="c1", name="lookup_order"),
        call("c2", "send_email", EMAIL),
        ToolMessage("sent m-1", tool_call_id="c2", name="send_email"),
        call("c3", "refund", REFUND),
    ]
    steps = {
        "c1": closed_step("c1", "lookup_order", {"order": "o-7"}, "order o-7: 40 EUR, paid"),
        "c2": closed_step("c2", "send_email", EMAIL, "sent m-1"),
        "c3": uncertain_step("c3", "refund", REFUND),
    }
    flow = {"stage": "awaiting_human", "reason": UNCERTAIN_REASON, "takeover": True}
    ledger = [
        ledger_entry("email:o-7", "send_email", tp.LedgerStatus.COMMITTED, EMAIL),
        ledger_entry("refund:o-7", "refund", tp.LedgerStatus.UNCERTAIN, REFUND),
    ]
    return {"messages": messages, "steps": steps, "flow": flow}, ledger


# --- golden texts -----------------------------------------------------------------------------

EXPECTED_EN = """\
You are resuming an interrupted task.
Goal: Refund order o-7 and email the customer
Progress: 2 step(s) done, step 3 in progress.
Done:
- step 1: lookup_order({"order": "o-7"}) → order o-7: 40 EUR, paid
- step 2: send_email({"to": "c-1", "template": "refund_started"}) → sent m-1
Side effects already committed (never repeat them):
- send_email [key email:o-7]
Side effects of UNKNOWN outcome (do not call again; a person decides):
- refund [key refund:o-7]
Not done:
- refund({"order": "o-7", "amount": 40}): awaiting_human, side_effect_uncertain
Blockers:
- refund: a side effect may or may not have happened
Refreshed data (the pause was long; these values are current):
- balance: {"EUR": 120}
Last observation: sent m-1
Continue from here; do not repeat completed steps or re-call tools that succeeded."""

EXPECTED_ZH = """\
你正在恢复一个被中断的任务。
目标：为订单 o-7 退款并发邮件通知客户
进度：已完成 2 步，第 3 步进行中。
已完成：
- 第 1 步：lookup_order({"order": "o-7"}) → order o-7: 40 EUR, paid
- 第 2 步：send_email({"to": "c-1", "template": "refund_started"}) → sent m-1
已提交的副作用（切勿重复）：
- send_email [键 email:o-7]
结果未知的副作用（不要再次调用，由人工决定）：
- refund [键 refund:o-7]
未完成：
- refund({"order": "o-7", "amount": 40})：awaiting_human, side_effect_uncertain
阻塞项：
- refund: a side effect may or may not have happened
已刷新的数据（暂停时间较长，以下为最新值）：
- balance：{"EUR": 120}
最近一次观察：sent m-1
请从这里继续；不要重复已完成的步骤，也不要重新调用已成功的工具。
在行动之前，请用两句话复述任务当前状态和你的下一步行动。"""


def test_resume_facts_gathers_the_four_layers() -> None:
    """resume_facts: goal, done steps, committed/uncertain keys, to-do, blocker, observation."""
    state, ledger = small_state("Refund order o-7 and email the customer")
    facts = resume_facts(state, ledger, refreshed={"balance": {"EUR": 120}})

    assert facts == ResumeFacts(
        goal="Refund order o-7 and email the customer",
        done=[
            ("lookup_order", '{"order": "o-7"}', "order o-7: 40 EUR, paid"),
            ("send_email", '{"to": "c-1", "template": "refund_started"}', "sent m-1"),
        ],
        committed=[("send_email", "email:o-7")],
        uncertain=[("refund", "refund:o-7")],
        todo=[
            ("refund", '{"order": "o-7", "amount": 40}', "awaiting_human, side_effect_uncertain")
        ],
        blockers=[UNCERTAIN_REASON],
        observation="sent m-1",
        refreshed={"balance": '{"EUR": 120}'},
    )


def test_english_prompt_golden_text() -> None:
    """The English prompt of a small state is exactly the expected text."""
    state, ledger = small_state("Refund order o-7 and email the customer")
    facts = resume_facts(state, ledger, refreshed={"balance": {"EUR": 120}})

    assert build_resume_prompt(facts, language="en") == EXPECTED_EN
    with_ack = build_resume_prompt(facts, language="en", acknowledge=True)
    assert with_ack == EXPECTED_EN + "\n" + TEMPLATES["en"]["acknowledge"]


def test_chinese_prompt_golden_text() -> None:
    """The Chinese prompt (with the acknowledgement request) is exactly the expected text."""
    state, ledger = small_state("为订单 o-7 退款并发邮件通知客户")
    facts = resume_facts(state, ledger, refreshed={"balance": {"EUR": 120}})

    assert build_resume_prompt(facts, language="zh", acknowledge=True) == EXPECTED_ZH


def test_prompt_of_a_fresh_thread_has_no_empty_sections() -> None:
    """With nothing done, committed or pending, only goal, progress and instruction remain."""
    facts = resume_facts({"messages": [HumanMessage("say hi")]}, [])

    assert build_resume_prompt(facts) == (
        "You are resuming an interrupted task.\n"
        "Goal: say hi\n"
        "Progress: 0 step(s) done.\n"
        "Continue from here; do not repeat completed steps or re-call tools that succeeded."
    )


# --- long histories ---------------------------------------------------------------------------

TOOLS = ("search", "fetch", "write")
PENDING_ARGS = {"order": "o-9", "amount": 99}


def long_state() -> tuple[dict[str, Any], list[tp.LedgerEntry]]:
    """1,000 closed steps, 300 committed effects, 3 uncertain ones and one pending step."""
    steps: dict[str, StepRecord] = {
        f"c{i}": closed_step(
            f"c{i}", TOOLS[i % 3], {"q": f"query number {i}"}, f"result {i} " + "x" * 60
        )
        for i in range(1000)
    }
    steps["pending"] = uncertain_step("pending", "charge", PENDING_ARGS)
    messages = [
        HumanMessage("Work through the backlog"),
        call("c999", "write", {"q": "query number 999"}),
        ToolMessage("written w-999", tool_call_id="c999", name="write"),
        call("pending", "charge", PENDING_ARGS),
    ]
    ledger = [
        ledger_entry(f"write:{i:032x}", "write", tp.LedgerStatus.COMMITTED, {"q": i})
        for i in range(300)
    ]
    ledger += [
        ledger_entry(f"charge:uncertain-{i}", "charge", tp.LedgerStatus.UNCERTAIN, {"n": i})
        for i in range(3)
    ]
    flow = {
        "stage": "awaiting_human",
        "reason": "charge: a side effect may or may not have happened",
    }
    return {"messages": messages, "steps": steps, "flow": flow}, ledger


@pytest.mark.parametrize("language", ["en", "zh"])
@pytest.mark.parametrize("max_chars", [1000, 1500, DEFAULT_MAX_CHARS, 12_000])
def test_long_history_fits_the_budget_and_keeps_exact_facts(language: str, max_chars: int) -> None:
    """After 1,000 steps: within max_chars, with every uncertain key and the pending step."""
    state, ledger = long_state()
    facts = resume_facts(state, ledger)
    prompt = build_resume_prompt(facts, language=language, max_chars=max_chars)  # type: ignore[arg-type]

    assert len(prompt) <= max_chars
    for i in range(3):
        assert f"charge:uncertain-{i}" in prompt
    assert 'charge({"order": "o-9", "amount": 99})' in prompt
    progress = {
        "en": "1000 step(s) done, step 1001 in progress",
        "zh": "已完成 1000 步，第 1001 步进行中",
    }
    assert progress[language] in prompt
    if max_chars >= 1500:  # the trajectory and the commits are summarised, not dropped silently
        summary = {"en": "earlier step(s)", "zh": "更早的"}[language]
        more = {"en": "more committed effect(s)", "zh": "个已提交的副作用"}[language]
        assert summary in prompt
        assert more in prompt


@pytest.mark.parametrize("language", ["en", "zh"])
def test_long_history_keeps_the_instruction_and_last_observation(language: str) -> None:
    """At the default budget the last observation and the closing instruction are not cut."""
    state, ledger = long_state()
    facts = resume_facts(state, ledger)
    prompt = build_resume_prompt(facts, language=language)  # type: ignore[arg-type]

    assert "written w-999" in prompt
    assert prompt.endswith(TEMPLATES[language]["instruction"])  # type: ignore[index]


@pytest.mark.parametrize("language", ["en", "zh"])
def test_long_tool_names_do_not_push_exact_facts_out(language: str) -> None:
    """With six long tool names in the trajectory, every uncertain key and the pending step stay."""
    state, ledger = long_state()
    names = [f"crm_contact_lookup_by_region_variant_{k}" for k in range(6)]
    for index, record in enumerate(state["steps"].values()):
        if record["status"] == "closed":
            record["using"] = record["tool"] = names[index % 6]
    facts = resume_facts(state, ledger)
    prompt = build_resume_prompt(facts, language=language)  # type: ignore[arg-type]

    assert len(prompt) <= DEFAULT_MAX_CHARS
    assert [f"charge:uncertain-{i}" in prompt for i in range(3)] == [True, True, True]
    assert 'charge({"order": "o-9", "amount": 99})' in prompt


def _prompts_of_long_state() -> list[str]:
    state, ledger = long_state()
    facts = resume_facts(state, ledger, refreshed={"b": 1, "a": [2]})
    return [
        build_resume_prompt(facts, language=language, max_chars=budget, acknowledge=True)
        for language in ("en", "zh")
        for budget in (3000, DEFAULT_MAX_CHARS)
    ]


def test_prompt_is_deterministic() -> None:
    """Same state and ledger, same facts and text: built twice here and under another hash seed."""
    first_state, first_ledger = long_state()
    second_state, second_ledger = long_state()
    assert resume_facts(first_state, first_ledger) == resume_facts(second_state, second_ledger)
    here = _prompts_of_long_state()
    assert _prompts_of_long_state() == here

    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_resume_prompt as t; "
        "print(json.dumps(t._prompts_of_long_state()))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    tests_dir = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", script, tests_dir],
        env=env,
        capture_output=True,
        check=True,
        text=True,
    )
    assert json.loads(out.stdout) == here


# --- the think node on resume -----------------------------------------------------------------

ORDERS = ("o-7", "o-8")
ACK = "ACK: the lookup of o-8 was interrupted; next I look it up again."


class LookupModel(BaseChatModel):
    """Looks up each order until it has a successful answer for it, then answers.

    Asked to restate the state (the resume prompt's acknowledgement request), it answers
    ``ACK``. Every input is kept in ``inputs``.
    """

    inputs: list[list[BaseMessage]] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "lookup-model"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> LookupModel:
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.inputs.append(list(messages))
        last = messages[-1]
        found = {
            str(m.content) for m in messages if isinstance(m, ToolMessage) and m.status != "error"
        }
        missing = [o for o in ORDERS if f"found {o}" not in found]
        if isinstance(last, HumanMessage) and "restate" in str(last.content):
            message = AIMessage(ACK)
        elif missing:
            args = {"order": missing[0]}
            tool_call = {"name": "lookup", "args": args, "id": f"call_{uuid.uuid4().hex[:12]}"}
            message = AIMessage("", tool_calls=[tool_call])
        else:
            message = AIMessage("final: " + ", ".join(sorted(found)))
        return ChatResult(generations=[ChatGeneration(message=message)])


def lookup_tool() -> StructuredTool:
    def lookup(order: str) -> str:
        return f"found {order}"

    return StructuredTool.from_function(lookup, name="lookup", description="look up an order")


def provider_accepts(messages: Sequence[BaseMessage]) -> bool:
    """The tool-call rule of chat providers: every call answered right after its message."""
    index = 0
    while index < len(messages):
        message = messages[index]
        index += 1
        if isinstance(message, ToolMessage):
            return False  # an answer to no call (or not right after its call)
        if isinstance(message, AIMessage) and message.tool_calls:
            answered: set[str] = set()
            while index < len(messages):
                answer = messages[index]
                if not isinstance(answer, ToolMessage):
                    break
                answered.add(answer.tool_call_id)
                index += 1
            if answered != {c["id"] for c in message.tool_calls}:
                return False
    return True


def resume_prompts(messages: Sequence[BaseMessage]) -> list[str]:
    return [
        str(m.content)
        for m in messages
        if isinstance(m, HumanMessage) and m.name == "taskpilots_resume"
    ]


def crash_with_dangling_call(cp: tp.RecoveryCheckpointer, context: ResumeContext) -> Any:
    """A thread left as a crash leaves it: o-7 answered, the o-8 call of the same message not."""
    model = LookupModel()
    graph = tp.create_recovery_agent(
        model, [lookup_tool()], checkpointer=cp, resume_context=context
    )
    calls = [
        {"name": "lookup", "args": {"order": "o-7"}, "id": "call_a"},
        {"name": "lookup", "args": {"order": "o-8"}, "id": "call_dangling"},
    ]
    graph.update_state(
        {"configurable": {"thread_id": "t"}},
        {
            "messages": [
                HumanMessage("look up orders o-7 and o-8"),
                AIMessage("", tool_calls=calls),
                ToolMessage("found o-7", tool_call_id="call_a", name="lookup"),
            ]
        },
        as_node="act",
    )
    assert not provider_accepts(
        graph.get_state({"configurable": {"thread_id": "t"}}).values["messages"]
    )
    return graph, model


def test_resume_closes_dangling_calls_and_gives_the_resume_prompt(
    cp: tp.RecoveryCheckpointer,
) -> None:
    """After a crash, resume answers the dangling call and the model gets the resume prompt once."""
    graph, model = crash_with_dangling_call(cp, ResumeContext())

    result = tp.resume(graph, "t")

    first, *later = model.inputs
    assert all(provider_accepts(messages) for messages in model.inputs)
    (prompt,) = resume_prompts(first)
    assert first[-1].content == prompt  # the prompt is the last thing the model reads
    assert prompt.startswith(TEMPLATES["en"]["header"])
    assert "Goal: look up orders o-7 and o-8" in prompt
    assert "Last observation: Error: interrupted before an answer" in prompt
    assert all(resume_prompts(messages) == [] for messages in later)  # given once
    # The answer to the dangling call is kept in the thread; the prompt is not.
    stored = result["messages"]
    (dangling,) = [
        m for m in stored if isinstance(m, ToolMessage) and m.tool_call_id == "call_dangling"
    ]
    assert dangling.status == "error"
    assert resume_prompts(stored) == []
    assert provider_accepts(stored)
    assert result["messages"][-1].content == "final: found o-7, found o-8"
    assert result["flow"]["stage"] == "closed"
    (context,) = [e.payload for e in cp.events("t") if e.kind is tp.EventKind.RESUME_CONTEXT]
    assert context["refreshed"] == []


def test_refreshers_run_after_a_long_pause_and_their_values_are_in_the_prompt(
    cp: tp.RecoveryCheckpointer,
) -> None:
    """With refresh_after=0 the refresher runs once and its current value is in the prompt."""
    seen: list[Mapping[str, Any]] = []

    def balance(state: Mapping[str, Any]) -> dict[str, int]:
        seen.append(state)
        return {"EUR": 120}

    context = ResumeContext(refreshers={"balance": balance}, refresh_after=0)
    graph, model = crash_with_dangling_call(cp, context)

    tp.resume(graph, "t")

    assert len(seen) == 1
    assert seen[0]["messages"][0].content == "look up orders o-7 and o-8"
    (prompt,) = resume_prompts(model.inputs[0])
    assert TEMPLATES["en"]["refreshed_title"] in prompt
    assert '- balance: {"EUR": 120}' in prompt
    (event,) = [e.payload for e in cp.events("t") if e.kind is tp.EventKind.RESUME_CONTEXT]
    assert event["refreshed"] == ["balance"]


def test_refreshers_do_not_run_after_a_short_pause(cp: tp.RecoveryCheckpointer) -> None:
    """Within refresh_after the refreshers are not called and the prompt has no refreshed data."""
    seen: list[Any] = []
    context = ResumeContext(refreshers={"balance": seen.append}, refresh_after=3600)
    graph, model = crash_with_dangling_call(cp, context)

    tp.resume(graph, "t")

    assert seen == []
    (prompt,) = resume_prompts(model.inputs[0])
    assert TEMPLATES["en"]["refreshed_title"] not in prompt


def test_acknowledge_makes_one_extra_call_recorded_as_llm_decided(
    cp: tp.RecoveryCheckpointer,
) -> None:
    """acknowledge=True: one extra model call, its answer logged as llm_decided acknowledgement."""
    graph, model = crash_with_dangling_call(cp, ResumeContext(acknowledge=True))

    result = tp.resume(graph, "t")

    # ack, re-lookup of o-8, final answer: one call more than without acknowledgement
    assert len(model.inputs) == 3
    ack_input, after_ack, _ = model.inputs
    assert all(provider_accepts(messages) for messages in model.inputs)
    assert str(ack_input[-1].content).endswith(TEMPLATES["en"]["acknowledge"])
    assert [type(m).__name__ for m in after_ack[-3:]] == [
        "HumanMessage",
        "AIMessage",
        "HumanMessage",
    ]
    assert after_ack[-2].content == ACK
    assert (after_ack[-1].content, after_ack[-1].name) == ("Continue.", "taskpilots_resume")
    decided = [e.payload for e in cp.events("t") if e.kind is tp.EventKind.LLM_DECIDED]
    assert [p["acknowledgement"] for p in decided if "acknowledgement" in p] == [ACK]
    assert all(m.content != ACK for m in result["messages"])  # not stored in the thread
    assert result["messages"][-1].content == "final: found o-7, found o-8"


# --- finished steps the memory window folded --------------------------------------------------


def folded_state() -> dict[str, Any]:
    """Six finished calls: three the window only counts (one failed), two it lists, one in view."""
    messages = [
        HumanMessage("read six pages"),
        call("c5", "page", {"n": 5}),
        ToolMessage("page 5", tool_call_id="c5", name="page"),
    ]
    memory = {
        "earlier": [
            {"tool": "page", "args": "{'n': 3}", "status": "ok", "result": "page 3"},
            {"tool": "fetch", "args": "{'n': 4}", "status": "ok", "result": "fetched 4"},
            {"tool": "page", "args": "{'n': 9}", "status": "failed", "result": "Error: no"},
        ],
        "folded": 4,
        "folded_done": {"page": 2, "fetch": 1},
    }
    steps = {"c5": closed_step("c5", "page", {"n": 5}, "page 5")}
    return {"messages": messages, "steps": steps, "memory": memory}


def test_folded_steps_are_counted_and_named() -> None:
    """Steps the window folded count; those it lists are named; the rest are summarised."""
    facts = resume_facts(folded_state(), [])

    assert facts.folded == {"page": 2, "fetch": 1}
    assert facts.done == [
        ("page", "{'n': 3}", "page 3"),
        ("fetch", "{'n': 4}", "fetched 4"),
        ("page", '{"n": 5}', "page 5"),
    ]
    assert build_resume_prompt(facts) == (
        "You are resuming an interrupted task.\n"
        "Goal: read six pages\n"
        "Progress: 6 step(s) done.\n"
        "Done:\n"
        "- … 3 earlier step(s): page x2, fetch x1\n"
        "- step 4: page({'n': 3}) → page 3\n"
        "- step 5: fetch({'n': 4}) → fetched 4\n"
        '- step 6: page({"n": 5}) → page 5\n'
        "Last observation: page 5\n"
        "Continue from here; do not repeat completed steps or re-call tools that succeeded."
    )


def test_memory_written_before_folded_done_counts_every_folded_call() -> None:
    """A state without ``folded_done`` (older checkpoints): its folded calls count as done."""
    state = folded_state()
    del state["memory"]["folded_done"]
    facts = resume_facts(state, [])

    assert facts.folded == {"?": 4}
    assert "Progress: 7 step(s) done." in build_resume_prompt(facts)


def test_folded_steps_stay_counted_within_a_small_budget() -> None:
    """Over a long folded history the count stays exact and the prompt within the budget."""
    state = folded_state()
    state["memory"]["folded_done"] = {"page": 5000, "fetch": 2500}
    facts = resume_facts(state, [])
    prompt = build_resume_prompt(facts, max_chars=1000)

    assert len(prompt) <= 1000
    assert "Progress: 7503 step(s) done." in prompt
    assert "- … 7500 earlier step(s): page x5000, fetch x2500" in prompt


class Crash(BaseException):
    """Stands in for the process dying: no ``except Exception`` on the way catches it."""


@pytest.mark.parametrize("budget", [None, 150])
def test_resume_prompt_counts_steps_the_window_folded(
    cp: tp.RecoveryCheckpointer, budget: int | None
) -> None:
    """5 calls, a crash in the 5th: the prompt counts and names all 5, with or without a
    context budget folding the earlier ones out of the model's view."""
    crashes = [Crash("killed in the fifth call")]
    plan = [("page", {"n": n}) for n in range(3)] + [("fetch", {"n": n}) for n in (3, 4)]

    def page(n: int) -> str:
        """Read page ``n``."""
        return f"page {n}"

    def fetch(n: int) -> str:
        """Fetch item ``n``."""
        if n == 4 and crashes:
            raise crashes.pop()
        return f"fetched {n}"

    model = PlanModel(plan=plan)
    graph = tp.create_recovery_agent(
        model,
        [StructuredTool.from_function(page), StructuredTool.from_function(fetch)],
        checkpointer=cp,
        memory_window=None if budget is None else MemoryWindow(max_tokens=budget),
    )
    config = {"configurable": {"thread_id": "t-fold"}}
    with pytest.raises(Crash):
        graph.invoke({"messages": [HumanMessage("read and fetch")]}, config)  # type: ignore[arg-type]
    asked = len(model.inputs)

    # Under the budget the model saw the earlier calls folded into its system message.
    shown_folded = any(
        isinstance(m, SystemMessage) and "folded out of the conversation" in str(m.content)
        for shown in model.inputs
        for m in shown
    )
    assert shown_folded == (budget is not None)

    tp.resume(graph, "t-fold")

    (prompt,) = resume_prompts(model.inputs[asked])
    assert "Progress: 5 step(s) done." in prompt
    # Every step is named: listed with its number, or in the summary line by tool.
    listed = [line for line in prompt.splitlines() if line.startswith("- step ")]
    numbers = [int(line.split(":")[0].removeprefix("- step ")) for line in listed]
    assert numbers == list(range(6 - len(listed), 6))
    assert 'fetch({"n": 4}) → fetched 4' in prompt  # the last one, still in view
    if len(listed) < 5:
        summary = f"- … {5 - len(listed)} earlier step(s): page x{5 - len(listed)}"
        assert summary in prompt.splitlines()


# --- the prompt reaches the model under every checkpoint density ------------------------------

DENSITY_PLAN = [
    ("lookup", {"n": 0}),
    ("lookup", {"n": 1}),
    ("record", {"n": 2}),
    ("lookup", {"n": 3}),
    ("lookup", {"n": 4}),
]
KILL_AT = 3  # the worker dies inside lookup(n=3), after the record was committed
KILLED = 9


def density_agent(cp: Any, model: Any, density: str, effects: Path, *, kill: bool) -> Any:
    def lookup(n: int) -> str:
        """Look up item ``n``."""
        if kill and n == KILL_AT:
            os._exit(KILLED)
        return f"item {n}"

    def record(n: int) -> str:
        """Record item ``n`` in the external register (a side effect)."""
        with effects.open("a") as register:
            register.write(f"{n}\n")
        return f"recorded {n}"

    tools = [
        StructuredTool.from_function(lookup),
        tp.side_effect(StructuredTool.from_function(record)),
    ]
    return tp.create_recovery_agent(
        model,
        tools,
        checkpointer=cp,
        checkpoint_density=density,  # type: ignore[arg-type]
        lease_ttl=1.0,  # the killed worker's lease lapses quickly; resume waits for it
    )


def _killed_worker(conn: str, thread_id: str, density: str, effects: str) -> None:
    code = 2
    try:
        with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
            cp.setup()
            model = PlanModel(plan=DENSITY_PLAN)
            graph = density_agent(cp, model, density, Path(effects), kill=True)
            graph.invoke(
                {"messages": [HumanMessage("look up five items, record the third")]},
                {"configurable": {"thread_id": thread_id}},
                durability="sync",  # each stored checkpoint is on disk before the next step
            )
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def kill_worker(conn_string: str, thread_id: str, density: str, effects: Path) -> None:
    """Run the plan in a forked worker that dies inside lookup(n=3)."""
    worker = multiprocessing.get_context("fork").Process(
        target=_killed_worker, args=(conn_string, thread_id, density, str(effects))
    )
    worker.start()
    worker.join(120)
    assert worker.exitcode == KILLED
    assert effects.read_text() == "2\n"


def check_resumed(
    model: PlanModel,
    result: Mapping[str, Any],
    events: Sequence[tp.Event],
    ledger: Sequence[tp.LedgerEntry],
    effects: Path,
    *,
    replays: bool,
) -> None:
    """The model's first real call after the resume had the prompt; nothing was repeated."""
    first, *later = model.inputs
    (prompt,) = resume_prompts(first)
    assert first[-1].content == prompt  # the last thing the model reads
    assert prompt.startswith(TEMPLATES["en"]["header"])
    # Counted: every step the model has an answer for, in view or folded by the window.
    assert f"Progress: {answered_calls(first)} step(s) done." in prompt
    assert answered_calls(first) >= 3
    assert all(resume_prompts(messages) == [] for messages in later)  # given once
    assert all(provider_accepts(messages) for messages in model.inputs)
    assert result["messages"][-1].content == "done"
    assert resume_prompts(result["messages"]) == []  # not stored in the thread
    (resumed,) = [e for e in events if e.kind is tp.EventKind.RUN_RESUMED]
    assert result["flow"]["resumed_seq"] == resumed.seq  # handled, by the real call
    assert len([e for e in events if e.kind is tp.EventKind.RESUME_CONTEXT]) == 1
    replayed = [
        e for e in events if e.kind is tp.EventKind.LLM_DECIDED and e.payload.get("replayed")
    ]
    assert len(replayed) <= 4
    if replays:
        # Every decision was recorded before acting and the resume starts before them:
        # they are replayed without the prompt, which waits for the first real call.
        assert len(replayed) >= 3
    # The no-duplicate guarantee holds: the record ran once, under its first key.
    assert effects.read_text() == "2\n"
    (entry,) = ledger
    assert (entry.status, entry.attempt) == (tp.LedgerStatus.COMMITTED, 1)


@pytest.mark.parametrize("density", ["every_step", "tool_boundary", "milestones"])
def test_resume_prompt_reaches_the_model_under_every_density(
    conn_string: str, tmp_path: Path, density: str
) -> None:
    """A worker killed mid-run; after resume the model's first real call has the prompt.

    Where that call comes depends on the density: ``every_step`` resumes before the killed
    lookup and runs it again; ``tool_boundary`` resumes from a stored boundary (here, after
    the side effect's observation) and asks the model; ``milestones`` resumes from the
    input and replays the recorded decisions (the record is not repeated: same call ids,
    same ledger key), then asks the model, with the prompt.
    """
    thread_id = f"t-{density}"
    effects = tmp_path / "register.txt"
    kill_worker(conn_string, thread_id, density, effects)

    with tp.RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        model = PlanModel(plan=DENSITY_PLAN)
        graph = density_agent(cp, model, density, effects, kill=False)
        result = tp.resume(graph, thread_id, wait=True)
        events, ledger = cp.events(thread_id), cp.ledger(thread_id)

    check_resumed(model, result, events, ledger, effects, replays=density == "milestones")


async def test_resume_prompt_reaches_the_model_after_aresume_under_milestones(
    conn_string: str, tmp_path: Path
) -> None:
    """The async think node too: replays first, the prompt at the first real call."""
    effects = tmp_path / "register.txt"
    kill_worker(conn_string, "t-async", "milestones", effects)

    async with tp.AsyncRecoveryCheckpointer.from_conn_string(conn_string) as acp:
        model = PlanModel(plan=DENSITY_PLAN)
        graph = density_agent(acp, model, "milestones", effects, kill=False)
        result = await tp.aresume(graph, "t-async", wait=True)
        events, ledger = await acp.aevents("t-async"), await acp.aledger("t-async")

    check_resumed(model, result, events, ledger, effects, replays=True)
