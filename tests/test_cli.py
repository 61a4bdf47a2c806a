"""The ``taskpilots`` command, through typer's runner on real SQLite files and real runs.

The store of most tests holds two threads of a real recovery agent (a scripted model, see
``_models``): ``t`` reserved A, then ``charge`` C performed its effect and timed out, so
the thread waits on a person with an uncertain effect; ``ok`` ran the same plan after the
fault was used up and closed. ``make_graph`` below is the factory the commands import with
``--graph test_cli:make_graph``; the simulated service records every execution in this
module, so a repeat shows up.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _models import PlanModel
from langchain_core.messages import HumanMessage
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from typer.testing import CliRunner

import taskpilots_graph as tp
from taskpilots_graph import testing
from taskpilots_graph.cli import app

GRAPH = "test_cli:make_graph"
PLAN: list[tuple[str, dict[str, Any]]] = [("reserve", {"ref": "A"}), ("charge", {"ref": "C"})]
COMMANDS = ["threads", "show", "metrics", "resume", "decide", "rewind", "demo", "drill"]


@dataclass
class Service:
    """Every execution ``(tool, ref, key)`` of the simulated service."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)
    charge: testing.FaultyTool | None = None

    def tool(self, name: str) -> BaseTool:
        def perform(ref: str) -> str:
            self.calls.append((name, ref, tp.current_invocation().key))
            return f"{name} {ref} ok"

        base = StructuredTool.from_function(perform, name=name, description=f"perform {name}")
        return tp.side_effect(base)

    def executed(self, tool: str) -> list[str]:
        return [key for name, _, key in self.calls if name == tool]


SERVICE = Service()


def make_graph(checkpointer: tp.RecoveryCheckpointer) -> Any:
    """The factory ``--graph`` names: ``charge`` acts then times out, once per test."""
    if SERVICE.charge is None:
        SERVICE.charge = testing.fail_after_effect(SERVICE.tool("charge"), times=1)
    tools = [SERVICE.tool("reserve"), SERVICE.charge.tool]
    return tp.create_recovery_agent(PlanModel(plan=PLAN), tools, checkpointer=checkpointer)


COMPILED = None  # a module attribute that is no graph at all


def _own_graph() -> Any:
    builder = StateGraph(MessagesState)
    builder.add_node("echo", lambda state: {"messages": []})
    builder.add_edge(START, "echo")
    return builder.compile(checkpointer=InMemorySaver())


OWN_GRAPH = _own_graph()  # a compiled graph with a checkpointer of its own


def fill(conn: str) -> str:
    """Thread ``t`` waiting on a person and thread ``ok`` closed, in the store at ``conn``."""
    SERVICE.calls.clear()
    SERVICE.charge = None
    with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
        cp.setup()
        graph = make_graph(cp)
        for thread in ("t", "ok"):
            graph.invoke(
                {"messages": [HumanMessage("reserve A then charge C")]},
                {"configurable": {"thread_id": thread}},
            )
    return conn


@pytest.fixture
def db(tmp_path: Path) -> str:
    """A SQLite file (a plain path) filled by :func:`fill`."""
    return fill(str(tmp_path / "runs.db"))


@pytest.fixture
def store(conn_string: str) -> str:
    """A SQLite file or a PostgreSQL database (as a URL) filled by :func:`fill`."""
    return fill(conn_string)


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, list(args), env=env or {})


def assert_one_line_error(result: Any, *words: str) -> None:
    """Exit non-zero, one line on stderr starting with ``error:``, no traceback."""
    assert result.exit_code != 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output + result.stderr
    for word in words:
        assert word in lines[0], lines[0]


# --- help ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_command_has_help(command: str | None) -> None:
    """``--help`` works for the app and every command, and says what it is for."""
    result = invoke(*([command] if command else []), "--help")
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output
    if command is None:
        for name in COMMANDS:
            assert name in result.output


def test_help_shows_no_type_labels_and_every_decision() -> None:
    """Flags carry no ``<bool>`` label; ``decide --help`` names every action, ``accept`` too."""
    from taskpilots_graph.takeover import DECISION_ACTIONS, DRIFT_ACTIONS

    for command in [None, *COMMANDS]:
        result = invoke(*([command] if command else []), "--help", env={"COLUMNS": "80"})
        assert "<bool>" not in result.output, (command, result.output)
        assert max(len(line) for line in result.output.splitlines()) <= 80, result.output
    decide = invoke("decide", "--help", env={"COLUMNS": "200"}).output
    for action in {*DECISION_ACTIONS, *DRIFT_ACTIONS}:
        assert action in decide, action


def test_python_m_runs_the_same_app(db: str) -> None:
    """``python -m taskpilots_graph`` is the ``taskpilots`` app: same commands, same output."""
    from taskpilots_graph.__main__ import main

    script = Path(sys.executable).parent / "taskpilots"
    for args in (["threads", "--db", db, "--json"], ["show", "t", "--db", db]):
        by_module = subprocess.run(
            [sys.executable, "-m", "taskpilots_graph", *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        by_script = subprocess.run(
            [str(script), *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert by_module.returncode == by_script.returncode == 0, by_module.stderr
        assert by_module.stdout == by_script.stdout
    assert main(["show", "nope", "--db", db]) == 1
    assert main(["no-such-command"]) == 2  # a usage error, as click reports it


def test_service_commands_exit_2_on_a_configuration_mistake(db: str) -> None:
    """``supervise`` with a bad ``--graph``: one line, status 2 (a process manager stops)."""
    result = invoke("supervise", "--graph", "no_such_module_xyz:graph", "--db", db, "--once")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: cannot import")


# --- reading ------------------------------------------------------------------------------


def test_threads_lists_each_status(store: str) -> None:
    """``threads --json`` tells the thread waiting on a person from the closed one."""
    result = invoke("threads", "--db", store, "--json")
    assert result.exit_code == 0, result.output
    statuses = {row["thread_id"]: row["status"] for row in json.loads(result.stdout)}
    assert statuses == {"t": "awaiting_human", "ok": "closed"}

    waiting = invoke("threads", "--db", store, "--status", "awaiting_human", "--json")
    assert [row["thread_id"] for row in json.loads(waiting.stdout)] == ["t"]

    table = invoke("threads", "--db", store)
    assert table.exit_code == 0
    assert "awaiting_human" in table.stdout
    assert "closed" in table.stdout


@pytest.mark.parametrize("name", ["TASKPILOTS_DB", "TASKPILOTS_POSTGRES_URL"])
def test_threads_reads_the_database_from_the_environment(db: str, name: str) -> None:
    """Without ``--db`` the store comes from the environment; ``--db`` wins over it."""
    result = invoke("threads", "--json", env={name: f"sqlite:///{db}"})
    assert result.exit_code == 0, result.output
    assert {row["thread_id"] for row in json.loads(result.stdout)} == {"t", "ok"}
    overridden = invoke("threads", "--db", "elsewhere.db", env={name: db})
    assert_one_line_error(overridden, "elsewhere.db")


def test_show_gives_timeline_ledger_step_and_takeover(store: str) -> None:
    """``show --json`` has the events, the uncertain ledger entry and the takeover naming it."""
    result = invoke("show", "t", "--db", store, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    (uncertain,) = [e for e in data["ledger"] if e["tool"] == "charge"]
    assert uncertain["status"] == "uncertain"
    assert data["thread"]["status"] == "awaiting_human"
    assert data["thread"]["current_step"]["tool"] == "charge"
    kinds = [e["kind"] for e in data["events"]]
    assert kinds[0] == "agent_started"
    assert "takeover_requested" in kinds
    assert data["takeover"]["uncertain_effects"][0]["key"] == uncertain["key"]
    assert [step["kind"] for step in data["replay"]["steps"]] == kinds


def test_show_tells_the_story_by_default(store: str) -> None:
    """Without options ``show`` is the replayed run, the ledger and the takeover."""
    text = invoke("show", "t", "--db", store)
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert lines[0].startswith("thread t: awaiting_human")
    assert any(re.search(r"^\s+\d+\. .* tool +call reserve\(", line) for line in lines), lines
    assert any("model" in line and "decides: charge(" in line for line in lines), lines
    assert "takeover requested" in text.stdout
    assert "Replay of thread" not in text.stdout  # the story, not the old dump
    assert "\nevents (" not in text.stdout  # the raw rows only with --events
    with_events = invoke("show", "t", "--db", store, "--events")
    assert "takeover_requested" in with_events.stdout
    # --replay, the old way to ask for the story, still works and changes nothing.
    assert invoke("show", "t", "--db", store, "--replay").stdout == text.stdout


@pytest.mark.parametrize("command", [["threads"], ["show", "t", "--events"], ["metrics"]])
def test_output_fits_80_columns_without_breaking_words(db: str, command: list[str]) -> None:
    """At 80 columns no line is longer, and no tool name is split across lines."""
    result = invoke(*command, "--db", db, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, [ln for ln in lines if len(ln) > 80]
    words = set(re.findall(r"[\w-]+", result.stdout))
    for fragment in ("cha", "rge", "res", "erve"):  # what wrapping inside a cell leaves
        assert fragment not in words, result.stdout
    wide = invoke(*command, "--db", db, env={"COLUMNS": "200"})
    assert max(len(line) for line in wide.stdout.splitlines()) <= 200


def test_metrics_as_json_and_prometheus(store: str) -> None:
    """``metrics`` counts one takeover over two runs, as JSON and as Prometheus text."""
    result = invoke("metrics", "--db", store, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["human_takeover"]["takeovers"] == 1
    assert data["human_takeover"]["runs"] == 2

    prom = invoke("metrics", "--db", store, "--prometheus")
    assert prom.exit_code == 0, prom.output
    assert "# TYPE" in prom.stdout

    only_ok = invoke("metrics", "--db", store, "--thread", "ok", "--since", "1h", "--json")
    assert json.loads(only_ok.stdout)["human_takeover"]["takeovers"] == 0

    table = invoke("metrics", "--db", store)
    assert table.exit_code == 0, table.output
    assert "human takeovers per 100 runs" in table.stdout
    assert "50" in table.stdout


# --- acting -------------------------------------------------------------------------------


def test_decide_retry_runs_the_effect_once_more_and_closes(store: str) -> None:
    """``decide t retry``: charge runs once more under the same key, the thread closes."""
    key = SERVICE.executed("charge")[0]
    result = invoke("decide", "t", "retry", "--graph", GRAPH, "--db", store, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["thread"]["status"] == "closed"
    charged = SERVICE.executed("charge")
    assert charged.count(key) == 2  # the first (uncertain) try and the person's retry
    assert len(SERVICE.executed("reserve")) == 2  # one per thread: nothing repeated

    again = invoke("decide", "t", "retry", "--graph", GRAPH, "--db", store)
    assert_one_line_error(again, "not waiting on a person")
    assert SERVICE.executed("charge") == charged


def test_decide_provide_result_takes_json(db: str) -> None:
    """``--result`` is JSON; the person's result closes the thread without executing."""
    before = list(SERVICE.calls)
    result = invoke(
        "decide", "t", "provide_result", "--result", '"charged by hand"', "--by", "ops",
        "--graph", GRAPH, "--db", db,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "closed" in result.stdout
    assert SERVICE.calls == before


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["explode"], ["invalid decision"]),
        (["provide_result", "--result", "{bad"], ["--result is not valid JSON"]),
        (["edit_args", "--args", "[1,"], ["--args is not valid JSON"]),
        (["edit_args", "--args", '{"amount": 3}'], ["edit_args does not fit charge"]),
        (["provide_result"], ["provide_result needs result"]),
    ],
)
def test_invalid_decisions_change_nothing(db: str, args: list[str], words: list[str]) -> None:
    """A bad action, bad JSON or arguments that do not fit the tool: one line, no change."""
    before = list(SERVICE.calls)
    result = invoke("decide", "t", *args, "--graph", GRAPH, "--db", db)
    assert_one_line_error(result, *words)
    assert SERVICE.calls == before
    status = invoke("threads", "--db", db, "--json")
    assert {r["thread_id"]: r["status"] for r in json.loads(status.stdout)}["t"] == (
        "awaiting_human"
    )


def test_resume_refuses_a_thread_waiting_on_a_person(db: str) -> None:
    """``resume`` on a takeover points to ``decide``; on a closed thread it runs nothing."""
    assert_one_line_error(invoke("resume", "t", "--graph", GRAPH, "--db", db), "decide")
    before = list(SERVICE.calls)
    result = invoke("resume", "ok", "--graph", GRAPH, "--db", db)
    assert result.exit_code == 0, result.output
    assert "closed" in result.stdout
    assert SERVICE.calls == before


def test_rewind_to_a_checkpoint_repeats_no_committed_effect(db: str) -> None:
    """``rewind ok --to <checkpoint of the reserve call>``: no committed effect runs again.

    The model decides anew after the target, so ``charge`` is a new call (a new key) with
    the arguments of the charge committed before the rewind: the repeat guard returns
    that charge's recorded result instead of charging twice.
    """
    with tp.RecoveryCheckpointer.from_conn_string(db) as cp:
        history = list(cp.list({"configurable": {"thread_id": "ok"}}))
    earliest_with_call = next(
        c
        for c in reversed(history)  # oldest first
        if any(
            getattr(m, "tool_calls", None)
            for m in c.checkpoint["channel_values"].get("messages", [])
        )
    )
    target = earliest_with_call.checkpoint["id"]
    reserved, charged = SERVICE.executed("reserve"), SERVICE.executed("charge")
    result = invoke("rewind", "ok", "--to", target, "--graph", GRAPH, "--db", db, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["thread"]["status"] == "closed"
    assert SERVICE.executed("reserve") == reserved  # committed before the target: reconciled
    assert SERVICE.executed("charge") == charged  # the re-decided charge was a repeat
    with tp.RecoveryCheckpointer.from_conn_string(db) as cp:
        assert tp.EventKind.REPEAT_CAUGHT in [e.kind for e in cp.events("ok")]

    assert_one_line_error(
        invoke("rewind", "ok", "--to", "no-such-milestone", "--graph", GRAPH, "--db", db),
        "no-such-milestone",
    )


# --- user mistakes ------------------------------------------------------------------------


def test_unknown_thread_is_one_line(store: str) -> None:
    """An unknown thread id: one line naming it, for reads and for runs."""
    assert_one_line_error(invoke("show", "nope", "--db", store), "nope")
    assert_one_line_error(invoke("resume", "nope", "--graph", GRAPH, "--db", store), "nope")


@pytest.mark.parametrize(
    ("db_arg", "words"),
    [
        ("postgresql://nobody:secret@127.0.0.1:9/none", ["cannot reach database", "***"]),
        ("missing/runs.db", ["no database at"]),
        ("redis://localhost/0", ["unsupported connection string scheme"]),
        (":memory:", ["in-memory"]),
    ],
)
def test_unusable_database_is_one_line(db_arg: str, words: list[str]) -> None:
    """Unreachable, missing or unsupported storage: one line (never the password)."""
    result = invoke("threads", "--db", db_arg)
    assert_one_line_error(result, *words)
    assert "secret" not in result.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["threads", "--status", "sleeping"], ["unknown status sleeping"]),
        (["metrics", "--since", "last tuesday"], ["--since 'last tuesday'"]),
        (["metrics", "--thread", "nope"], ["nope"]),
    ],
)
def test_bad_read_options_are_one_line(db: str, args: list[str], words: list[str]) -> None:
    """An unknown status, an unreadable ``--since`` or an unknown thread: one line."""
    assert_one_line_error(invoke(*args, "--db", db), *words)


def test_a_file_that_is_not_sqlite_is_one_line(tmp_path: Path) -> None:
    """A file that is no SQLite database: one line."""
    junk = tmp_path / "notes.txt"
    junk.write_text("not a database " * 100)
    assert_one_line_error(invoke("threads", "--db", str(junk)), "not a usable SQLite")


def test_another_programs_sqlite_file_is_refused_untouched(tmp_path: Path) -> None:
    """A SQLite file of some other program: "not a taskpilots store", and no table added."""
    other = tmp_path / "crm.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE customers (id TEXT)")
    for command in (["threads"], ["show", "t"], ["metrics"]):
        assert_one_line_error(invoke(*command, "--db", str(other)), "not a taskpilots store")
    with sqlite3.connect(other) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    assert tables == ["customers"]
    # A plain LangGraph store is a taskpilots store to be: accepted.
    from langgraph.checkpoint.sqlite import SqliteSaver

    plain = tmp_path / "plain.db"
    with SqliteSaver.from_conn_string(str(plain)) as saver:
        saver.setup()
    result = invoke("threads", "--db", str(plain))
    assert result.exit_code == 0, result.output
    assert "no threads" in result.stdout


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("nocolon", ["package.module:attr"]),
        ("no_such_module_xyz:make", ["cannot import"]),
        ("test_cli:missing", ["no attribute"]),
        ("test_cli:COMPILED", ["NoneType"]),
        ("test_cli:PLAN", ["list"]),
    ],
)
def test_bad_graph_reference_is_one_line(db: str, spec: str, words: list[str]) -> None:
    """A ``--graph`` that is not ``module:attribute`` of a graph factory: one line."""
    assert_one_line_error(invoke("resume", "t", "--graph", spec, "--db", db), *words)


def test_a_compiled_graph_runs_on_its_own_store(db: str) -> None:
    """A compiled graph brings its checkpointer: ``--db`` is refused, not ignored."""
    assert_one_line_error(
        invoke("resume", "t", "--graph", "test_cli:OWN_GRAPH", "--db", db), "own checkpointer"
    )
    # Without --db it runs on its own (empty, in-memory) store, where "t" does not exist.
    assert_one_line_error(invoke("resume", "t", "--graph", "test_cli:OWN_GRAPH"), "'t'")


def test_missing_required_arguments_exit_non_zero() -> None:
    """Typer's own usage errors exit non-zero too (2), without a traceback."""
    result = invoke("decide", "t")
    assert result.exit_code == 2
    assert "Traceback" not in result.output


# --- a real process -----------------------------------------------------------------------


def test_demo_json_in_a_real_process(tmp_path: Path) -> None:
    """``python -m taskpilots_graph.cli demo --json`` prints the demo's report, as JSON."""
    from taskpilots_graph.demo.batch import DrillReport

    proc = subprocess.run(
        [
            sys.executable, "-m", "taskpilots_graph.cli", "demo", "--json", "--tickets", "2",
            "--timed-kills", "0", "--skip-plain", "--workdir", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "COLUMNS": "120"},
    )  # fmt: skip
    summary = json.loads(proc.stdout)
    assert set(summary) == {"agent"}
    report = summary["agent"]
    assert set(report) == set(DrillReport.__dataclass_fields__)
    assert report["tickets"] == 2
    assert report["kills"] >= 1  # the worker really was SIGKILLed and resumed
    assert proc.returncode == (1 if report["duplicates"] else 0)
    assert report["duplicates"] == 0, report


def test_taskpilots_script_runs(db: str) -> None:
    """The installed ``taskpilots`` script (next to the interpreter) answers for real."""
    script = Path(sys.executable).parent / "taskpilots"
    proc = subprocess.run(
        [str(script), "threads", "--db", db, "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert {row["thread_id"] for row in json.loads(proc.stdout)} == {"t", "ok"}
    bad = subprocess.run(
        [str(script), "show", "nope", "--db", db],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 1
    assert bad.stderr.strip().startswith("error:")
    assert "Traceback" not in bad.stderr
