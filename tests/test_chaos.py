"""Multi-worker chaos: 4 queue workers and the supervisor on PostgreSQL + Redis, with SIGKILLs.

100 ticket threads of the demo workflow (CRM, help desk, mailer, approvals, payments, all
side-effecting, simulated in a SQLite file of their own) are queued for 4 worker processes
(``python -m taskpilots_graph worker``) watched by one supervisor process
(``python -m taskpilots_graph supervise --queue``). While the queue still holds work, a
killer SIGKILLs a random running worker every 2 to 3.5 s and starts a new one in its place.

At the end every thread is closed, or waits on a person for a named uncertain effect (an
approval request cut off mid-call has no pre-check: "at most once, then a person decides");
no effect was performed twice; and no commit is lost: every effect the services performed
is committed on the ledger (or named in a takeover), and every committed entry of a closed
thread is in its checkpointed flow state. It prints the time from each kill that cut a run
short to that thread's next recorded step (median, max).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest
import redis
from _worker_graph import LATENCY_ENV, LEASE_TTL_ENV, SERVICES_ENV

import taskpilots_graph as tp
from taskpilots_graph.config import StorageSettings, open_graph
from taskpilots_graph.demo.batch import make_batch, thread_id
from taskpilots_graph.demo.services import Services
from taskpilots_graph.supervisor import Supervisor
from taskpilots_graph.workers import create_worker_app, enqueue, setup_queue

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

REPO_ROOT = Path(__file__).resolve().parent.parent
GRAPH = "_worker_graph:build"
THREADS = 100
WORKERS = 4
LEASE_TTL_S = 1.5
STALLED_AFTER_S = 2.0
KILL_EVERY_S = (2.0, 3.5)
DEADLINE_S = 150.0  # a hard stop for a broken build, far above the expected ~60 s


class Fleet:
    """The worker and supervisor processes, their logs, and the kills."""

    def __init__(self, workdir: Path, db: str, leases: str) -> None:
        self.workdir = workdir
        self.db = db
        self.leases = leases
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")]),
        }
        self.logs = ExitStack()
        self.workers: list[subprocess.Popen[bytes]] = []
        self.started = 0
        self.supervisor: subprocess.Popen[bytes] | None = None
        self._outs: dict[int, Path] = {}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        out = self.workdir / f"{name}.out"
        err: IO[bytes] = self.logs.enter_context(open(self.workdir / f"{name}.err", "wb"))  # noqa: SIM115
        stdout: IO[bytes] = self.logs.enter_context(open(out, "wb"))  # noqa: SIM115
        cmd = [sys.executable, "-m", "taskpilots_graph", *args, "--graph", GRAPH]
        cmd += ["--db", self.db, "--leases", self.leases]
        proc = subprocess.Popen(cmd, env=self.env, stdout=stdout, stderr=err)
        self._outs[proc.pid] = out
        return proc

    def start_worker(self) -> subprocess.Popen[bytes]:
        self.started += 1
        proc = self._spawn(
            f"worker-{self.started}",
            [
                "worker",
                "--no-supervise",
                "--stalled-after",
                str(STALLED_AFTER_S),
                "--heartbeat",
                "0.3",
            ],
        )
        self.workers.append(proc)
        return proc

    def start_supervisor(self) -> None:
        self.supervisor = self._spawn(
            "supervisor",
            ["supervise", "--queue", "--interval", "0.5", "--stalled-after", str(STALLED_AFTER_S)],
        )

    def ready(self, proc: subprocess.Popen[bytes]) -> bool:
        if proc.poll() is not None:
            err = self._outs[proc.pid].with_suffix(".err").read_text(errors="replace")
            raise AssertionError(f"process {proc.args} exited with {proc.returncode}:\n{err}")
        return b"ready" in self._outs[proc.pid].read_bytes()

    def stop(self) -> None:
        procs = [*self.workers, *([self.supervisor] if self.supervisor else [])]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.logs.close()


@pytest.fixture
def fleet(postgres_url: str, redis_url: str, tmp_path: Path) -> Iterator[Fleet]:
    """The fleet's processes, always stopped at the end."""
    group = Fleet(tmp_path, postgres_url, redis_url)
    try:
        yield group
    finally:
        group.stop()


def _queued(db: str) -> dict[str, int]:
    with psycopg.connect(db) as conn:
        rows = conn.execute(
            "SELECT status::text, COUNT(*) FROM procrastinate_jobs GROUP BY status"
        ).fetchall()
    return {status: int(n) for status, n in rows}


def _running_thread(client: redis.Redis, pid: int) -> str | None:
    """The thread whose lease the process ``pid`` holds (owner tokens are host:pid:random)."""
    for key in client.scan_iter(match="*lease:{thread:*"):
        value = client.get(key)
        if value is not None and f":{pid}:" in value.decode():
            return key.decode().split("{thread:", 1)[1].rstrip("}")
    return None


def _victim(
    fleet: Fleet, client: redis.Redis, rng: random.Random
) -> subprocess.Popen[bytes] | None:
    """A random worker that is up, preferably one in the middle of a run (None: none up).

    A worker still importing its modules has nothing to lose; killing those would measure
    interpreter start-up (seconds on a loaded machine), not recovery. So at most two
    replacements start at a time.
    """
    up = [w for w in fleet.workers if fleet.ready(w)]
    if len(up) < WORKERS - 1:
        return None  # two replacements are still starting: let the fleet breathe
    busy = [w for w in up if _running_thread(client, w.pid) is not None]
    return rng.choice(busy or up) if up else None


def _settled(supervisor: Supervisor) -> tuple[bool, dict[str, int]]:
    health = supervisor.check()
    counts: dict[str, int] = {}
    for item in health:
        counts[item.status.value] = counts.get(item.status.value, 0) + 1
    done = counts.get("idle", 0) + counts.get("takeover", 0)
    return len(health) == THREADS and done == THREADS, counts


def test_four_workers_and_a_supervisor_survive_random_sigkills(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """≥ 100 threads, SIGKILLs every few seconds: all settled, 0 duplicates, 0 lost commits."""
    rng = random.Random(7)
    customers, tickets = make_batch(THREADS, seed=11)
    services = Services(str(tmp_path / "services.db"))
    services.seed_customers(customers)
    for name, value in {
        SERVICES_ENV: services.path,
        LEASE_TTL_ENV: str(LEASE_TTL_S),
        LATENCY_ENV: "0.02",  # each service call takes up to 20 ms: kills land mid-run
    }.items():
        monkeypatch.setenv(name, value)
        fleet.env[name] = value
    setup_queue(fleet.db)
    with tp.RecoveryCheckpointer.from_conn_string(fleet.db) as cp:
        cp.setup()
    began = time.monotonic()
    app = create_worker_app(fleet.db)
    with app.open():
        for ticket in tickets:
            message = {"role": "user", "content": json.dumps(ticket)}
            enqueue(app, GRAPH, thread_id(ticket), {"messages": [message]})

    fleet.start_supervisor()
    for _ in range(WORKERS):
        fleet.start_worker()
    while not all(fleet.ready(w) for w in fleet.workers):
        assert time.monotonic() - began < DEADLINE_S, "workers did not start"
        time.sleep(0.2)

    kills: list[tuple[float, int, str | None]] = []
    client = redis.Redis.from_url(fleet.leases)
    with open_graph(GRAPH, StorageSettings(fleet.db, fleet.leases)) as graph:
        observer = Supervisor(graph)  # only its read-only health check is used here
        next_kill = time.monotonic() + rng.uniform(*KILL_EVERY_S)
        settled, counts = False, {}
        while time.monotonic() - began < DEADLINE_S:
            if _queued(fleet.db).get("todo", 0) > 0:
                if time.monotonic() >= next_kill and (victim := _victim(fleet, client, rng)):
                    running = _running_thread(client, victim.pid)
                    victim.send_signal(signal.SIGKILL)
                    kills.append((time.time(), victim.pid, running))
                    victim.wait()
                    fleet.workers.remove(victim)
                    fleet.start_worker()
                    next_kill = time.monotonic() + rng.uniform(*KILL_EVERY_S)
                time.sleep(0.1)
                continue
            settled, counts = _settled(observer)
            if settled:
                break
            time.sleep(1.0)
        elapsed = time.monotonic() - began
        assert settled, f"not settled after {elapsed:.0f} s: {counts}, jobs {_queued(fleet.db)}"
        fleet.stop()

        cp = graph.checkpointer
        assert isinstance(cp, tp.RecoveryCheckpointer)
        report = _verify(graph, cp, services, tickets)
    recover_s = _times_to_recover(cp_url=fleet.db, kills=kills)
    assert len(kills) >= 3, f"only {len(kills)} kills happened: the batch ran too fast"
    print(
        f"\nchaos: {THREADS} threads, {WORKERS} workers + supervisor, {len(kills)} SIGKILLs "
        f"({len(recover_s)} cut a run short), {elapsed:.1f} s"
    )
    print(
        f"chaos: closed {report['closed']}, waiting on a named takeover {report['takeover']}, "
        f"duplicates {report['duplicates']}, lost commits {report['lost']}"
    )
    if recover_s:
        print(
            f"chaos: time to recover after a kill: median {statistics.median(recover_s):.2f} s, "
            f"max {max(recover_s):.2f} s (lease TTL {LEASE_TTL_S} s)"
        )
    assert report["closed"] + report["takeover"] == THREADS
    assert report["duplicates"] == 0
    assert report["lost"] == 0


def _verify(
    graph: Any, cp: tp.RecoveryCheckpointer, services: Services, tickets: list[dict[str, Any]]
) -> dict[str, int]:
    """Count closed threads, named takeovers, duplicate effects and lost commits."""
    ledger = {e.key: e for e in cp.ledger()}
    closed = takeover = lost = 0
    for ticket in tickets:
        tid = thread_id(ticket)
        state = graph.get_state({"configurable": {"thread_id": tid}})
        last = state.values["messages"][-1]
        if not state.next and "closed." in str(last.content):
            closed += 1
            committed = {
                k
                for k, e in ledger.items()
                if e.thread_id == tid and e.status == tp.LedgerStatus.COMMITTED
            }
            lost += len(committed - set(state.values["flow"].get("committed", [])))
            continue
        requests = tp.pending_takeovers(cp, thread_ids=[tid])
        named = [r for r in requests if r.uncertain_effects or r.pending]
        assert named, f"{tid} is neither closed nor waiting on a named takeover: {state.next}"
        takeover += 1
    for effect in services.effects():
        entry = ledger.get(effect["request_key"] or "")
        if entry is None or entry.status not in ("committed", "uncertain"):
            lost += 1  # the service did it, the agent's record does not say so
    duplicates = sum(c.duplicates for c in services.effect_counts())
    return {"closed": closed, "takeover": takeover, "duplicates": duplicates, "lost": lost}


def _times_to_recover(*, cp_url: str, kills: list[tuple[float, int, str | None]]) -> list[float]:
    """Per kill that cut a run short: seconds until that thread's next recorded event."""
    times = []
    with tp.RecoveryCheckpointer.from_conn_string(cp_url) as cp:
        for killed_at, _pid, tid in kills:
            if tid is None:
                continue  # the worker was between jobs: nothing to recover
            after = [e.ts.timestamp() for e in cp.events(tid) if e.ts.timestamp() > killed_at]
            if after:
                times.append(min(after) - killed_at)
    return times
