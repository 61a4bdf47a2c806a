"""The demo, run as a user would: ``python -m taskpilots_graph.demo`` in a real process.

The ticket batch is SIGKILLed at the demo's kill schedule (business steps drawn from the
seed), once on the recovery agent and once on plain LangGraph, side by side. The default
run must print exactly the README's table (the schedule is placed by step, not by time, so
the figures do not depend on the machine), a progress line per kill, and a ``taskpilots
show`` command that opens the kept databases and tells the story of a killed ticket.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from taskpilots_graph.cli import app
from taskpilots_graph.demo.batch import make_batch
from taskpilots_graph.demo.schedule import KILL_KINDS, kill_schedule

README = Path(__file__).resolve().parents[1] / "README.md"
SCRIPT = Path(sys.executable).parent / "taskpilots"
HEADER = re.compile(r"^\s+taskpilots agent\s+plain LangGraph$")


def _demo(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "taskpilots_graph.demo", *args],
        capture_output=True, text=True, timeout=540, stdin=subprocess.DEVNULL, check=False,
        cwd=cwd, env={**os.environ, "COLUMNS": "100"},
    )  # fmt: skip


def _table(text: str) -> list[str]:
    """The demo table in ``text``: from its header line to the first blank line."""
    lines = [line.rstrip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if HEADER.match(line))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def _readme_table() -> list[str]:
    """The table in the README's fenced block that holds the demo's header."""
    blocks: list[list[str]] = []
    inside = False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            if inside:
                blocks.append([])
        elif inside:
            blocks[-1].append(line)
    (block,) = [b for b in blocks if any(HEADER.match(line) for line in b)]
    return _table("\n".join(block))


def test_the_schedule_is_the_seeds_and_places_every_kill_on_a_step() -> None:
    """One seed, one schedule; every kind of kill is placed on a ticket that makes that call."""
    _, tickets = make_batch(12, seed=7)
    schedule = kill_schedule(tickets, seed=7)
    assert schedule == kill_schedule(tickets, seed=7)
    assert schedule != kill_schedule(tickets, seed=8)
    assert sorted((s, p) for s, p, _ in schedule) == sorted(KILL_KINDS)
    refunds = {t["order_id"] for t in tickets if t["refund"] > 0}
    customers = {t["customer_id"] for t in tickets}
    for service, _, about in schedule:
        assert about in (customers if service == "crm_tag" else refunds)
    assert len({(s, a) for s, _, a in schedule}) == len(schedule)  # no step killed twice


@pytest.mark.slow
@pytest.mark.timeout(600)  # two runs of 8 worker starts each, 1.5-6 s per start
def test_default_demo_prints_the_readme_table_and_opens_with_show(tmp_path: Path) -> None:
    """The default run's table is the README's; its ``taskpilots show`` line tells the story."""
    done = _demo("--workdir", str(tmp_path / "demo"))
    context = f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, context
    assert _table(done.stdout) == _readme_table(), context
    # Progress: a line per kill and per run, as it happens (a bar too, in a terminal).
    kills = [line for line in done.stderr.splitlines() if "SIGKILL" in line]
    assert len(kills) == 2 * len(KILL_KINDS), context
    assert any(re.search(r"right after create_ticket for o\d+", line) for line in kills)

    # The last line is the command to run next, on the databases the demo kept.
    command = shlex.split(done.stdout.strip().splitlines()[-1])
    assert command[:2] == ["taskpilots", "show"], context
    show = subprocess.run(
        [str(SCRIPT), *command[1:]], capture_output=True, text=True, timeout=60, check=False
    )
    assert show.returncode == 0, show.stderr
    assert re.search(r">> process stopped during create_ticket \(no result\); resumed", show.stdout)
    assert "pre-check of create_ticket: done" in show.stdout
    assert re.search(r"^thread ticket-T\d+: closed", show.stdout), show.stdout
    metrics = subprocess.run(
        [str(SCRIPT), "metrics", *command[3:]],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert metrics.returncode == 0, metrics.stderr
    # No tool step failed, yet the crashes were recovered: the output says so.
    assert "no tool step failed; 7 run(s) resumed after a stop" in " ".join(metrics.stdout.split())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_json_kills_both_runs_at_the_same_steps(tmp_path: Path) -> None:
    """``--json``: no duplicate for the agent, some for plain LangGraph, same kill sites."""
    done = _demo("--json", "--tickets", "6", "--workdir", str(tmp_path))
    context = f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, context
    summary = json.loads(done.stdout)
    agent, plain = summary["agent"], summary["plain"]
    assert agent["tickets"] == plain["tickets"] == 6, context
    assert agent["kills"] == plain["kills"] == len(agent["kill_sites"]) > 0, context
    assert agent["kill_sites"] == plain["kill_sites"], context
    assert agent["duplicates"] == 0, context
    assert agent["closed"] + len(agent["stopped_uncertain"]) == 6, context
    assert agent["incomplete"] == [], context
    assert plain["duplicates"] > 0, f"plain LangGraph repeated nothing: {context}"
    assert agent["seconds"] > 0  # the times are in the JSON, not in the table


def _one_line(result: Any, *words: str) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], lines[0]
    return str(lines[0])


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("postgresql://nobody:secret@127.0.0.1:9/none", ["cannot reach database", "***"]),
        ("sqlite:///runs.db", ["--postgres needs a postgresql:// URL"]),
        ("postgresql:/typo", ["scheme"]),
    ],
)
def test_an_unusable_postgres_url_is_one_line(tmp_path: Path, url: str, words: list[str]) -> None:
    """``demo --postgres`` with a URL it cannot use: one line, before any worker starts."""
    result = CliRunner().invoke(app, ["demo", "--postgres", url, "--workdir", str(tmp_path)])
    line = _one_line(result, *words)
    assert "secret" not in line
    assert not list(tmp_path.iterdir())  # nothing was run


def test_postgres_without_the_extra_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without psycopg installed, ``--postgres`` names the extra to install."""
    monkeypatch.setitem(sys.modules, "psycopg", None)  # what a missing package looks like
    result = CliRunner().invoke(
        app, ["demo", "--postgres", "postgresql://u@127.0.0.1:9/x", "--workdir", str(tmp_path)]
    )
    _one_line(result, "taskpilots-graph[postgres]")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fork_server_kills_on_time_and_the_next_child_resumes(tmp_path: Path) -> None:
    """``worker --serve``: a child killed at once exits -9; the next fresh child finishes."""
    from taskpilots_graph.demo.batch import SERVING, SETTLED
    from taskpilots_graph.demo.services import Services

    customers, tickets = make_batch(2, seed=3)
    services = tmp_path / "services.db"
    Services(str(services)).seed_customers(customers)
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps(tickets))
    cmd = [sys.executable, "-m", "taskpilots_graph.demo.worker", "--serve", "agent"]
    cmd += [f"sqlite:///{tmp_path / 'runs.db'}", str(services), str(batch)]
    server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None
    assert server.stdout is not None
    try:
        assert server.stdout.readline().strip() == SERVING
        outputs = []
        for request, expected in (("run 0", "exit -9 timed"), ("run -", "exit 0")):
            server.stdin.write(request + "\n")
            server.stdin.flush()
            lines = []
            while not (line := server.stdout.readline()).startswith("exit "):
                assert line, "the fork server died"
                lines.append(line.strip())
            assert line.strip() == expected, lines
            outputs.append(lines)
        settled = {line.removeprefix(SETTLED) for line in outputs[1] if line.startswith(SETTLED)}
        assert settled == {t["ticket_id"] for t in tickets}
    finally:
        server.stdin.close()
        assert server.wait(timeout=30) == 0
    counts = Services(str(services)).effect_counts()
    assert sum(c.duplicates for c in counts) == 0
