"""``create_agent`` + ``RecoveryMiddleware`` logs a run and re-anchors a resumed model as
``create_recovery_agent`` does.

The runs are real: a SQLite checkpointer, the simulated service of ``_forms_world`` (a
SQLite file of its own), the scripted model of ``_forms_harness`` (it decides from its
messages alone and keeps every input it received). Checked here:

* a finished middleware thread shows as ``closed`` in ``tp.thread_info``,
  ``tp.list_threads`` and ``taskpilots show``, a failed one as ``failed``;
* after a person's decision and after a crash resume, the first model call gets the
  resume prompt (what was done, with the ledger keys), the same text the recovery agent's
  model gets, with one ``resume_context`` event; later calls of the run do not get it;
* ``tp.ToolNode`` (the same tool-call code in a graph of one's own) logs no run end.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from _forms_harness import BatchPlanModel, Scenario, build
from _forms_world import Crash, Jammed, Unreadable, World, world_tools
from langchain_core.messages import BaseMessage, HumanMessage
from typer.testing import CliRunner

import taskpilots_graph as tp
from taskpilots_graph.cli import app
from taskpilots_graph.engine._records import SUMMARY_CHARS
from taskpilots_graph.events import EventKind
from taskpilots_graph.prompts.resume import RESUME_NAME
from taskpilots_graph.testing import fake_clock

FAST = tp.Backoff(initial=0.01, jitter=False)
FORMS = ("recovery agent", "middleware")

FINISHED = Scenario(
    plan=[[("lookup", {"sku": "S-9"})]],
    tools=("lookup",),
    script={"lookup": ("reset",)},
    policies={"lookup": tp.ToolPolicy(max_attempts=3, backoff=FAST)},
)
FATAL = Scenario(
    plan=[[("print_label", {"order": "A-1"})]],
    tools=("print_label",),
    script={"print_label": ("jammed",)},
    policies={"print_label": tp.ToolPolicy(rules=[(Jammed, tp.FailureKind.FATAL)])},
)
UNCERTAIN = Scenario(
    plan=[[("book_courier", {"order": "B-7"})], [("refund", {"order": "B-7", "amount": 40})]],
    tools=("book_courier", "refund"),
    script={"refund": ("lost",)},
    decisions=(tp.Decision(action="skip"),),
)
REPEATED = Scenario(
    plan=[[("read_feed", {"feed": "north"})]] * 4,
    tools=("read_feed",),
    script={"read_feed": ("garbled",) * 4},
    policies={
        "read_feed": tp.ToolPolicy(
            backoff=FAST, stuck_after=3, rules=[(Unreadable, tp.FailureKind.CONTRACT)]
        )
    },
    decisions=(tp.Decision(action="skip"),),
)
CRASHED = Scenario(
    plan=[
        [("book_courier", {"order": "K-1"})],
        [("checked_refund", {"order": "K-1", "amount": 9})],
    ],
    tools=("book_courier", "checked_refund"),
    script={"checked_refund": ("crash",)},
)


def _agent(
    form: str, scenario: Scenario, cp: Any, tmp: Path, thread_id: str
) -> tuple[Any, BatchPlanModel]:
    world = World(str(tmp / f"world-{thread_id}.db"))
    for tool, actions in scenario.script.items():
        world.script(tool, *actions)
    model = BatchPlanModel(plan=scenario.plan)
    return build(form, scenario, cp, world, model), model


def _run(form: str, scenario: Scenario, cp: Any, tmp: Path, thread_id: str) -> None:
    graph, model = _agent(form, scenario, cp, tmp, thread_id)
    _run_with(graph, model, scenario, thread_id)


def _run_with(graph: Any, model: BatchPlanModel, scenario: Scenario, thread_id: str) -> int:
    """Run the scenario; how many model calls came before the resume (a person's decision,
    or ``tp.resume`` after the crash)."""
    with fake_clock():
        try:
            tp.run(graph, thread_id, {"messages": [("user", "go")]})
        except Crash:
            before = len(model.inputs)
            tp.resume(graph, thread_id)
            return before
        before = len(model.inputs)
        for decision in scenario.decisions:
            tp.decide(graph, thread_id, decision)
    return before


def _prompts(messages: list[BaseMessage]) -> list[str]:
    return [
        str(m.content) for m in messages if isinstance(m, HumanMessage) and m.name == RESUME_NAME
    ]


def _keyless(text: str, cp: tp.RecoveryCheckpointer, thread_id: str) -> str:
    """The prompt with the thread's ledger keys (random per run: the model's call ids are)
    written as the tool they belong to."""
    for entry in cp.ledger(thread_id):
        text = text.replace(entry.key, f"<{entry.tool}>")
    return text


@pytest.fixture
def cp(tmp_path: Path) -> Any:
    with tp.RecoveryCheckpointer.from_conn_string(str(tmp_path / "runs.db")) as saver:
        saver.setup()
        yield saver


def test_a_finished_middleware_thread_shows_as_closed(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    _run("middleware", FINISHED, cp, tmp_path, "done")
    kinds = [e.kind for e in cp.events("done")]
    assert kinds[0] is EventKind.AGENT_STARTED
    assert kinds[-2:] == [EventKind.LLM_DECIDED, EventKind.AGENT_FINISHED]
    finished = cp.events("done")[-1].payload
    assert finished == {"status": "closed", "answer": "done"}
    assert tp.thread_info(cp, "done").status == "closed"
    assert {t.thread_id: t.status for t in tp.list_threads(cp)} == {"done": "closed"}
    shown = CliRunner().invoke(app, ["show", "done", "--db", str(tmp_path / "runs.db"), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["thread"]["status"] == "closed"


def test_a_failed_middleware_run_shows_as_failed(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    """The fatal error still leaves ``invoke``; the log says the run ended failed."""
    with pytest.raises(Jammed):
        _run("middleware", FATAL, cp, tmp_path, "jam")
    last = cp.events("jam")[-1]
    assert last.kind is EventKind.AGENT_FINISHED
    assert last.payload["status"] == "failed"
    assert "print_label" in last.payload["reason"]
    assert tp.thread_info(cp, "jam").status == "failed"


@pytest.mark.parametrize(
    ("scenario", "after"),
    [(UNCERTAIN, 1), (REPEATED, 2), (CRASHED, 1)],
    ids=[
        "after a decision on an uncertain effect",
        "after a stuck call is skipped",
        "after a crash",
    ],
)
def test_the_middleware_model_gets_the_resume_prompt(
    cp: tp.RecoveryCheckpointer, tmp_path: Path, scenario: Scenario, after: int
) -> None:
    """The first model call after the resume gets the recovery agent's resume prompt (the
    keys of the committed effects in it), once; the run's later calls do not."""
    prompts = {}
    for form in FORMS:
        thread_id = form.replace(" ", "-")
        graph, model = _agent(form, scenario, cp, tmp_path, thread_id)
        before = _run_with(graph, model, scenario, thread_id)
        later = model.inputs[before:]
        assert len(later) == after, form
        first = _prompts(later[0])
        assert len(first) == 1, form
        assert later[0][-1].content == first[0]  # after the conversation, as its last message
        assert all(not _prompts(m) for m in later[1:]), form
        assert all(not _prompts(m) for m in model.inputs[:before]), form
        for entry in cp.ledger(thread_id):  # what was done, named by its ledger key
            assert (entry.key in first[0]) == (entry.status is tp.LedgerStatus.COMMITTED)
        (event,) = [e for e in cp.events(thread_id) if e.kind is EventKind.RESUME_CONTEXT]
        assert event.payload == {"context": first[0][:SUMMARY_CHARS], "refreshed": []}
        prompts[form] = _keyless(first[0], cp, thread_id)
    assert prompts["middleware"] == prompts["recovery agent"]


def test_the_async_middleware_gives_the_resume_prompt_and_logs_the_run(tmp_path: Path) -> None:
    """The async hooks do the same: prompt after the decision, start and finish logged."""

    async def main() -> tuple[list[list[BaseMessage]], int, list[EventKind], str]:
        conn = str(tmp_path / "runs.db")
        async with tp.AsyncRecoveryCheckpointer.from_conn_string(conn) as acp:
            await acp.setup()
            graph, model = _agent("middleware", UNCERTAIN, acp, tmp_path, "a")
            with fake_clock():
                await tp.arun(graph, "a", {"messages": [("user", "go")]})
                before = len(model.inputs)
                await tp.adecide(graph, "a", tp.Decision(action="skip"))
            kinds = [e.kind for e in await acp.aevents("a")]
            status = (await tp.athread_info(acp, "a")).status
            return model.inputs, before, kinds, status

    inputs, before, kinds, status = asyncio.run(main())
    assert [len(_prompts(m)) for m in inputs] == [0] * before + [1]
    assert kinds[0] is EventKind.AGENT_STARTED
    assert kinds.count(EventKind.RESUME_CONTEXT) == 1
    assert kinds[-1] is EventKind.AGENT_FINISHED
    assert status == "closed"


def test_a_tool_node_in_a_graph_of_ones_own_logs_no_run_end(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    """``tp.ToolNode`` shares the middleware's tool-call code, but a graph of one's own logs
    no start of a run: a fatal error leaves ``invoke`` without ``agent_finished``, so the
    thread's later turns are not shown as failed."""
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import tools_condition

    world = World(str(tmp_path / "world-own.db"))
    world.script("print_label", "jammed")
    model = BatchPlanModel(plan=FATAL.plan)
    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node(
        "tools", tp.ToolNode([world_tools(world)["print_label"]], policies=FATAL.policies)
    )
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    graph = builder.compile(checkpointer=cp)
    with fake_clock(), pytest.raises(Jammed):
        tp.run(graph, "own", {"messages": [("user", "go")]})
    kinds = [e.kind for e in cp.events("own")]
    assert EventKind.TOOL_FAILED in kinds
    assert EventKind.AGENT_FINISHED not in kinds


def _turn_ends(cp: tp.RecoveryCheckpointer, thread_id: str) -> list[EventKind]:
    ends = (EventKind.AGENT_STARTED, EventKind.AGENT_FINISHED)
    return [e.kind for e in cp.events(thread_id) if e.kind in ends]


def test_stream_then_the_same_command_logs_each_turn_alike_in_both_forms(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    """LangGraph's own ``stream`` and then the same command through ``invoke``: each turn is
    logged started and finished once, in both forms, and the thread shows closed."""
    seen: dict[str, list[EventKind]] = {}
    for form in FORMS:
        thread_id = f"twice-{form}"
        graph, _ = _agent(form, FINISHED, cp, tmp_path, thread_id)
        command = {"messages": [("user", "go")]}
        assert list(graph.stream(command, {"configurable": {"thread_id": thread_id}}))
        graph.invoke(command, {"configurable": {"thread_id": thread_id}})
        seen[form] = _turn_ends(cp, thread_id)
        assert tp.thread_info(cp, thread_id).status == "closed"
    turn = [EventKind.AGENT_STARTED, EventKind.AGENT_FINISHED]
    assert seen == dict.fromkeys(FORMS, turn * 2)
