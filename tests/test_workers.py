"""Queue workers on procrastinate: enqueue, per-thread job locks, the leases, stalled jobs.

* Jobs enqueued for several threads are run by a worker; every ticket closes once.
* Every job is locked on its thread id; a resume is queued at most once at a time.
* A job run again (its worker was killed after it started) never sends its input twice.
* ``python -m taskpilots_graph worker`` killed by SIGKILL mid side effect: a second worker
  re-runs the stalled job (its periodic supervisor scan finds it) and the ticket closes
  without a duplicate effect.
* ``python -m taskpilots_graph supervise --once`` and a bad graph reference.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
import typer
from _worker_graph import LEASE_TTL_ENV, SERVICES_ENV
from typer.testing import CliRunner

import taskpilots_graph as tp
from taskpilots_graph.__main__ import main
from taskpilots_graph.cli._workers import register
from taskpilots_graph.config import StorageSettings, open_graph
from taskpilots_graph.demo.batch import make_batch, thread_id
from taskpilots_graph.demo.services import Services
from taskpilots_graph.workers import (
    INPUT_MARKER,
    RUN_TASK,
    _host,
    _run_job,
    create_worker_app,
    enqueue,
    enqueue_resume,
    serve_worker,
    setup_queue,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REPO_ROOT = Path(__file__).resolve().parent.parent
GRAPH = "_worker_graph:build"


@pytest.fixture
def world(
    postgres_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """A set-up database with the queue, Redis leases and seeded services."""
    customers, tickets = make_batch(6)
    services = Services(str(tmp_path / "services.db"))
    services.seed_customers(customers)
    monkeypatch.setenv(SERVICES_ENV, services.path)
    monkeypatch.setenv(LEASE_TTL_ENV, "1.0")
    setup_queue(postgres_url)
    with tp.RecoveryCheckpointer.from_conn_string(postgres_url) as cp:
        cp.setup()
    return {
        "db": postgres_url,
        "leases": redis_url,
        "services": services,
        "tickets": tickets,
        "env": {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")]),
        },
    }


def _message(ticket: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": json.dumps(ticket)}]}


def _closed(db: str, tickets: list[dict[str, Any]]) -> list[str]:
    settings = StorageSettings(db, db)
    with open_graph(GRAPH, settings) as graph:
        closed = []
        for ticket in tickets:
            values = graph.get_state({"configurable": {"thread_id": thread_id(ticket)}}).values
            last = (values.get("messages") or [None])[-1]
            if last is not None and "closed." in str(last.content):
                closed.append(thread_id(ticket))
        return closed


def _jobs(db: str) -> list[tuple[str, str | None, str | None, str]]:
    with psycopg.connect(db) as conn:
        rows = conn.execute(
            "SELECT task_name, lock, queueing_lock, status::text FROM procrastinate_jobs "
            "ORDER BY id"
        ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def test_worker_runs_enqueued_threads_each_locked_on_its_thread(world: dict[str, Any]) -> None:
    """4 tickets and a second input on one thread: all closed, jobs locked per thread."""
    tickets = world["tickets"][:4]
    app = create_worker_app(world["db"])
    with app.open():
        ids = [enqueue(app, GRAPH, thread_id(t), _message(t)) for t in tickets]
        assert len(set(ids)) == 4
        first = thread_id(tickets[0])
        assert enqueue_resume(app, GRAPH, first) is not None
        assert enqueue_resume(app, GRAPH, first) is None  # already queued
        jobs = _jobs(world["db"])
    assert [j[1] for j in jobs] == [*(thread_id(t) for t in tickets), first]
    assert jobs[-1][2] == f"taskpilots-resume:{first}"
    serve_worker(
        GRAPH,
        db=world["db"],
        leases=world["leases"],
        concurrency=2,
        supervise_every=None,
        wait=False,  # stop once the queue is empty
    )
    assert sorted(_closed(world["db"], tickets)) == sorted(thread_id(t) for t in tickets)
    counts = world["services"].effect_counts()
    assert sum(c.duplicates for c in counts) == 0
    assert {c.service: c.performed for c in counts}["create_ticket"] == 4
    assert _jobs(world["db"]) == []  # succeeded jobs are deleted


def test_a_job_run_again_never_sends_its_input_twice(world: dict[str, Any]) -> None:
    """Run the same job (same input marker) twice: the second one resumes, not restarts."""
    ticket = world["tickets"][0]
    tid = thread_id(ticket)
    with open_graph(GRAPH, StorageSettings(world["db"], world["leases"])) as graph:
        _host(GRAPH, graph, stalled_after=30.0)

        class _Ctx:
            class job:  # the shape of procrastinate's JobContext
                id = 1

        kwargs = {"graph": GRAPH, "thread_id": tid, "input": _message(ticket), "marker": "m-1"}
        assert _run_job(_Ctx(), **kwargs) == "ran"
        assert _run_job(_Ctx(), **kwargs) == "nothing to do"
        values = graph.get_state({"configurable": {"thread_id": tid}}).values
        asked = [m for m in values["messages"] if m.type == "human" and m.name is None]
        assert len(asked) == 1
        found = list(
            graph.checkpointer.list(  # type: ignore[union-attr]
                {"configurable": {"thread_id": tid}}, filter={INPUT_MARKER: "m-1"}
            )
        )
        assert found
    assert sum(c.duplicates for c in world["services"].effect_counts()) == 0


def _worker(world: dict[str, Any], *extra: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "taskpilots_graph",
        "worker",
        "--graph",
        GRAPH,
        "--db",
        world["db"],
        "--leases",
        world["leases"],
        "--stalled-after",
        "2",
        "--heartbeat",
        "0.5",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, env=world["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "ready" in line, proc.stderr.read() if proc.stderr else line
    return proc


def test_killed_worker_stalled_job_is_rerun_and_the_ticket_closes_once(
    world: dict[str, Any],
) -> None:
    """SIGKILL inside ``create_ticket`` (after the effect): a second worker's periodic
    scan re-queues the stalled job; the ticket is not created twice and the thread closes."""
    services: Services = world["services"]
    ticket = world["tickets"][1]
    services.plant_kill("create_ticket", "after")
    app = create_worker_app(world["db"])
    with app.open():
        enqueue(app, GRAPH, thread_id(ticket), _message(ticket))
    first = _worker(world, "--no-supervise")
    assert first.wait(timeout=60) == -signal.SIGKILL
    assert [(j[0], j[3]) for j in _jobs(world["db"])] == [(RUN_TASK, "doing")]  # stalled

    second = _worker(world, "--supervise-every", "1")
    try:
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and not _closed(world["db"], [ticket]):
            time.sleep(0.3)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=30)
    assert _closed(world["db"], [ticket]) == [thread_id(ticket)]
    counts = {c.service: c for c in services.effect_counts()}
    assert counts["create_ticket"].performed == 1
    assert sum(c.duplicates for c in counts.values()) == 0


def test_supervise_command_scans_once_and_reports(
    world: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """``supervise --once`` prints a summary; a bad graph reference exits with status 2."""
    ticket = world["tickets"][2]
    with open_graph(GRAPH, StorageSettings(world["db"], world["leases"])) as graph:
        tp.run(graph, thread_id(ticket), _message(ticket))
    base = [sys.executable, "-m", "taskpilots_graph", "supervise", "--db", world["db"]]
    base += ["--leases", world["leases"], "--once"]
    done = subprocess.run(
        [*base, "--graph", GRAPH], env=world["env"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "1 threads (idle 1)" in done.stdout
    args = ["supervise", "--db", world["db"], "--leases", world["leases"], "--once"]
    assert main([*args, "--graph", GRAPH, "--queue"]) == 0  # in-process: same code path
    assert "dispatched 0" in capsys.readouterr().out
    assert main([*args, "--graph", "no_such_module:graph"]) == 2
    assert "cannot import 'no_such_module'" in capsys.readouterr().err

    cli = typer.Typer()  # the `taskpilots` commands, as the CLI registers them
    register(cli)
    result = CliRunner().invoke(cli, [*args, "--graph", GRAPH])
    assert result.exit_code == 0, result.output
    assert "1 threads (idle 1)" in result.output


def test_workers_need_postgres(tmp_path: Path) -> None:
    """The queue lives in PostgreSQL: a SQLite URL is a configuration error."""
    with pytest.raises(tp.ConfigurationError, match="PostgreSQL"):
        create_worker_app(f"sqlite:///{tmp_path / 'runs.db'}")
