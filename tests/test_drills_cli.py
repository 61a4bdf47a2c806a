"""``taskpilots drill``: a recovery agent passes the four drills, plain LangGraph is caught.

Both graphs below follow the same plan with a scripted model: ``kb_search`` (pure), then
``create_ticket`` and ``send_email`` (side effects). The ticket service keeps its rows in
a SQLite file of its own (``$TASKPILOTS_TEST_DRILL_SERVICE``), outside the agent's
process and database, so the crash drill's child processes share it and a repeated ticket
is visible independently of the drill's own journal. ``create_ticket`` has a pre-check
(look the invocation key up in the service); ``send_email`` is declared idempotent. The
factories are marked ``@drill_graph`` (their tools are these test doubles); the same agent
unmarked stands for a factory built on real tools.
"""

from __future__ import annotations

import json
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from _models import PlanModel
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from typer.testing import CliRunner

import taskpilots_graph as tp
from taskpilots_graph.cli import app
from taskpilots_graph.drills import drill_graph

pytestmark = pytest.mark.slow

SERVICE_ENV = "TASKPILOTS_TEST_DRILL_SERVICE"
PLAN: list[tuple[str, dict[str, Any]]] = [
    ("kb_search", {"q": "refund"}),
    ("create_ticket", {"ref": "A"}),
    ("send_email", {"ref": "A"}),
]


def _service() -> sqlite3.Connection:
    conn = sqlite3.connect(os.environ[SERVICE_ENV], timeout=30, isolation_level=None)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS effects (service TEXT, ref TEXT, key TEXT, thread TEXT)"
    )
    return conn


def _key() -> str | None:
    try:
        return tp.current_invocation().key
    except tp.ConfigurationError:
        return None  # run by a plain ToolNode


def _effect(service: str) -> BaseTool:
    def perform(ref: str, config: RunnableConfig) -> str:
        thread = config["configurable"]["thread_id"]
        with closing(_service()) as conn:
            conn.execute("INSERT INTO effects VALUES (?, ?, ?, ?)", (service, ref, _key(), thread))
        return f"{service} {ref} done"

    return StructuredTool.from_function(perform, name=service, description=f"{service} a ref")


def _search() -> BaseTool:
    def kb_search(q: str) -> str:
        return f"articles about {q}"

    return StructuredTool.from_function(kb_search, name="kb_search", description="search")


def _ticket_precheck(key: str, args: dict[str, Any]) -> Any:
    with closing(_service()) as conn:
        row = conn.execute(
            "SELECT ref FROM effects WHERE service = 'create_ticket' AND key = ?", (key,)
        ).fetchone()
    return tp.Done(f"create_ticket {row[0]} done", proof={"key": key}) if row else tp.NotDone()


def _agent(checkpointer: tp.RecoveryCheckpointer) -> Any:
    tools = [
        _search(),
        tp.side_effect(_effect("create_ticket"), precheck=_ticket_precheck),
        tp.side_effect(_effect("send_email"), idempotent=True),
    ]
    return tp.create_recovery_agent(PlanModel(plan=PLAN), tools, checkpointer=checkpointer)


@drill_graph
def make_agent(checkpointer: tp.RecoveryCheckpointer) -> Any:
    """The recovery agent: pre-checked ticket, idempotent e-mail."""
    return _agent(checkpointer)


def make_unmarked(checkpointer: tp.RecoveryCheckpointer) -> Any:
    """The same agent, not declared to use test doubles (as a factory of real tools)."""
    return _agent(checkpointer)


@drill_graph
def make_plain(checkpointer: Any) -> Any:
    """Plain LangGraph: model node + ``ToolNode``, the same tools without a ledger."""
    model = PlanModel(plan=PLAN)
    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node(
        "tools", ToolNode([_search(), _effect("create_ticket"), _effect("send_email")])
    )
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer)


COMPILED = make_plain(InMemorySaver())


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The ticket service's file, named in the environment."""
    path = tmp_path / "service.db"
    monkeypatch.setenv(SERVICE_ENV, str(path))  # the crash drill's children inherit it
    return path


def drill(*args: str) -> Any:
    return CliRunner().invoke(app, ["drill", *args])


def test_recovery_agent_passes_every_drill(service: Path, tmp_path: Path) -> None:
    """All four drills pass on the recovery agent; the service never saw a key twice."""
    result = drill("--graph", "test_drills_cli:make_agent", "--json", "--workdir", str(tmp_path))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    outcomes = {d["name"]: (d["outcome"], d["tool"]) for d in report["drills"]}
    assert outcomes == {
        "transient": ("passed", "kb_search"),
        "outage_after_effect": ("passed", "send_email"),
        "long_outage": ("passed", "kb_search"),
        "crash": ("passed", "create_ticket"),
    }, report["drills"]
    assert report["duplicates"] == 0
    assert report["baseline"] == ["kb_search", "create_ticket", "send_email"]
    crash = next(d for d in report["drills"] if d["name"] == "crash")
    assert crash["settled"] == "closed"  # the pre-check found the ticket: no person needed
    assert report["metrics"]["duplicate_side_effects"]["duplicates"] == 0
    with closing(sqlite3.connect(service)) as conn:
        keys = [k for (k,) in conn.execute("SELECT key FROM effects")]
        per_thread = conn.execute(
            "SELECT thread, service, COUNT(*) FROM effects GROUP BY thread, service"
        ).fetchall()
    assert len(keys) == len(set(keys))  # independently of the journal: nothing twice
    assert {n for _, _, n in per_thread} == {1}
    # Ticket + e-mail in the baseline and the drills that closed; the long outage of
    # kb_search ends on a person before either.
    long_outage = next(d for d in report["drills"] if d["name"] == "long_outage")
    assert long_outage["settled"] == "awaiting_human"
    assert len(keys) == 2 * 4


def test_plain_langgraph_is_caught_repeating_an_effect(service: Path) -> None:
    """The crash drill catches plain LangGraph re-running a ticket after the SIGKILL."""
    result = drill(
        "--graph",
        "test_drills_cli:make_plain",
        "--effect",
        "create_ticket",
        "--effect",
        "send_email",
        "--json",
    )
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    crash = next(d for d in report["drills"] if d["name"] == "crash")
    assert (crash["outcome"], crash["tool"]) == ("failed", "create_ticket")
    assert crash["duplicates"] >= 1
    assert "create_ticket" in crash["detail"]
    with closing(sqlite3.connect(service)) as conn:
        (tickets,) = conn.execute(
            "SELECT COUNT(*) FROM effects WHERE service = 'create_ticket' AND thread = ?",
            (crash["thread_id"],),
        ).fetchone()
    assert tickets == 2  # the service itself saw the ticket of the crashed run twice


def test_text_report_names_each_drill(service: Path) -> None:
    """Without ``--json``: a table of the drills and the four metrics."""
    result = drill("--graph", "test_drills_cli:make_agent", "--no-crash")
    assert result.exit_code == 0, result.output
    for words in ("transient", "long outage", "local recovery success rate", "all drills passed"):
        assert words in result.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--graph", "test_drills_cli:COMPILED"], "factory taking the checkpointer"),
        (["--graph", "test_drills_cli:make_agent", "--input", "{nope"], "--input is not valid"),
        (["--graph", "test_drills_cli:make_agent", "--effect", "fax"], "no tool(s) fax"),
    ],
)
def test_drill_refuses_what_it_cannot_drill(service: Path, args: list[str], words: str) -> None:
    """A compiled graph, bad JSON or an unknown tool: one line, exit 1, no traceback."""
    result = drill(*args, "--no-crash")
    assert result.exit_code == 1
    # The line saying what is drilled may come first; then one error line.
    lines = [ln for ln in result.stderr.strip().splitlines() if not ln.startswith("drilling ")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert words in lines[0]
    assert "Traceback" not in result.output


def test_an_unmarked_factory_is_refused_before_any_tool_runs(service: Path) -> None:
    """Without ``@drill_graph`` or ``--real-effects``: one line naming both, nothing run."""
    result = drill("--graph", "test_drills_cli:make_unmarked", "--no-crash")
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for words in ("not marked as building its tools on test doubles", "--real-effects"):
        assert words in lines[0]
    assert "drill_graph" in lines[0]
    assert not service.exists()  # no tool ran: the service never even opened its file


def test_real_effects_says_so_before_it_starts(service: Path) -> None:
    """``--real-effects`` drills an unmarked factory, after a warning; the report says so."""
    result = drill("--graph", "test_drills_cli:make_unmarked", "--no-crash", "--real-effects")
    assert result.exit_code == 0, result.output
    first = result.stderr.strip().splitlines()[0]
    assert first.startswith("warning: drilling test_drills_cli:make_unmarked with --real-effects")
    assert "(real services)" in result.stdout
    marked = drill("--graph", "test_drills_cli:make_agent", "--no-crash", "--json")
    assert marked.stderr.startswith("drilling test_drills_cli:make_agent: marked @drill_graph")
    assert json.loads(marked.stdout)["real_effects"] is False
