"""The four recovery metrics: hand-built event logs with known answers, then real runs.

The first part feeds :func:`compute_metrics` event logs whose times are chosen, so every
figure has one right answer (including the time-based ones). The second part goes through
the store: hand-written events with ``cp.append_event``, and real ``create_recovery_agent``
runs with an injected transient failure and an uncertain side effect, checked end to end on
a SQLite file and a PostgreSQL database (the ``cp`` fixture), and with the async
checkpointer.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from _models import PlanModel
from langchain_core.messages import HumanMessage
from langchain_core.tools import BaseTool, StructuredTool
from prometheus_client.parser import text_string_to_metric_families

import taskpilots_graph as tp
from taskpilots_graph import testing
from taskpilots_graph.errors import ThreadNotFound
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus
from taskpilots_graph.metrics import (
    LocalRecovery,
    RecoveryMetrics,
    arecovery_metrics,
    compute_metrics,
    recovery_metrics,
)
from taskpilots_graph.policy import Backoff, ToolPolicy

T0 = datetime(2026, 1, 1, tzinfo=UTC)
FAST = Backoff(initial=1.0, multiplier=2.0, max_delay=8.0, jitter=False)


class Log:
    """Builds one thread's events at chosen times (seconds after ``T0``)."""

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        self.events: list[Event] = []

    def add(self, at: float, kind: EventKind, **payload: Any) -> Log:
        self.events.append(
            Event(
                thread_id=self.thread_id,
                seq=len(self.events) + 1,
                kind=kind,
                ts=T0 + timedelta(seconds=at),
                payload=payload,
            )
        )
        return self

    def start(self, at: float = 0) -> Log:
        return self.add(at, EventKind.AGENT_STARTED, goal="go")

    def fail(self, at: float, call: str, tool: str = "search", **extra: Any) -> Log:
        failure = {"kind": extra.pop("kind", "transient"), "error_type": "TimeoutError"}
        return self.add(
            at, EventKind.TOOL_FAILED, tool=tool, tool_call_id=call, failure=failure, **extra
        )

    def ok(self, at: float, call: str, tool: str = "search", **extra: Any) -> Log:
        return self.add(at, EventKind.TOOL_SUCCEEDED, tool=tool, tool_call_id=call, **extra)

    def finish(self, at: float, status: str = "closed") -> Log:
        return self.add(at, EventKind.AGENT_FINISHED, status=status)


def logs(*built: Log) -> dict[str, list[Event]]:
    return {log.thread_id: log.events for log in built}


def entry(key: str, thread_id: str, tool: str, status: LedgerStatus) -> LedgerEntry:
    return LedgerEntry(
        key=key,
        thread_id=thread_id,
        tool=tool,
        status=status,
        args={},
        args_digest="",
        attempt=1,
        created_at=T0,
        updated_at=T0,
    )


# --- the I/O-free core, with known answers ----------------------------------------------------


def test_a_clean_run_has_no_failures_and_undefined_rates() -> None:
    """No failure: recovery rate and time to close are undefined, not 100 % or 0 s."""
    run = Log("t").start()
    run.add(1, EventKind.TOOL_INVOKED, tool="book", key="k", tool_call_id="c1")
    run.ok(2, "c1", tool="book", key="k").finish(3)

    m = compute_metrics(logs(run), [entry("k", "t", "book", LedgerStatus.COMMITTED)], now=T0)

    assert m.local_recovery == LocalRecovery()  # all zero, rate None
    assert m.local_recovery_rate is None
    assert (m.duplicates.effects, m.duplicates.duplicates, m.duplicate_side_effect_rate) == (
        1,
        0,
        0.0,
    )
    assert m.time_to_close.samples == 0
    assert m.mean_time_to_close_seconds is None
    assert (m.takeover.takeovers, m.takeovers_per_100_runs) == (0, 0.0)
    assert (m.runs.total, m.runs.closed, m.runs.open) == (1, 1, 0)


def test_no_runs_at_all() -> None:
    """An empty store: every ratio undefined, every count zero."""
    m = compute_metrics({}, [], now=T0)
    assert m.runs.total == 0
    assert m.takeovers_per_100_runs is None
    assert m.duplicate_side_effect_rate is None
    assert math.isnan(_prom(m)["taskpilots_local_recovery_rate"][()])


def test_local_recovery_counts_each_way_a_failed_step_ends() -> None:
    """Retried, degraded or given by a person: recovered; skipped, failed: not; open: pending."""
    main = Log("main").start()
    main.fail(1, "c1").ok(2, "c1")  # retried: recovered automatically
    main.fail(3, "c2", tool="search").add(4, EventKind.DEGRADED, using="search", fallback="bk")
    main.ok(5, "c2", tool="bk")  # the fallback answered the same call: recovered
    main.add(6, EventKind.EFFECT_UNCERTAIN, tool="charge", tool_call_id="c3", key="k3")
    main.add(7, EventKind.TAKEOVER_REQUESTED, tool="charge")
    main.add(8, EventKind.DECISION_RECORDED, decision={"action": "provide_result"}, steps=["c3"])
    main.fail(9, "c4").add(10, EventKind.TAKEOVER_REQUESTED, tool="search")
    main.add(11, EventKind.DECISION_RECORDED, decision={"action": "skip"}, steps=["c4"])
    main.finish(12)
    failed = Log("failed").start().fail(1, "d1").finish(2, status="failed")
    still_open = Log("open").start().fail(1, "e1")  # a run still going
    retried_by_person = Log("person").start().fail(1, "f1", kind="auth")
    retried_by_person.add(2, EventKind.TAKEOVER_REQUESTED, tool="search")
    retried_by_person.add(
        3, EventKind.DECISION_RECORDED, decision={"action": "retry"}, steps=["f1"]
    )
    retried_by_person.ok(4, "f1").finish(5)

    m = compute_metrics(logs(main, failed, still_open, retried_by_person), now=T0)

    lr = m.local_recovery
    assert (lr.failures, lr.recovered, lr.recovered_automatically) == (7, 4, 2)
    assert (lr.unrecovered, lr.pending) == (2, 1)
    assert lr.rate == pytest.approx(4 / 6)


def test_duplicate_side_effects_per_key() -> None:
    """Confirmed twice: duplicate; maybe twice: possible; cleared by a pre-check: single."""
    a = Log("a").start()
    # k1: once.
    a.add(1, EventKind.TOOL_INVOKED, tool="t", key="k1").ok(2, "c1", tool="t", key="k1")
    # k2: timed out after sending, the pre-check found it done: one execution.
    a.add(3, EventKind.TOOL_INVOKED, tool="t", key="k2")
    a.fail(4, "c2", tool="t", key="k2", maybe_sent=True)
    a.add(5, EventKind.EFFECT_RECONCILED, tool="t", key="k2", outcome="done")
    # k3: uncertain, a person chose retry, it ran again: possibly twice.
    a.add(6, EventKind.TOOL_INVOKED, tool="t", key="k3")
    a.fail(7, "c3", tool="t", key="k3", maybe_sent=True)
    a.add(8, EventKind.EFFECT_UNCERTAIN, tool="t", key="k3")
    a.add(9, EventKind.TOOL_INVOKED, tool="t", key="k3", attempt=2)
    a.ok(10, "c3", tool="t", key="k3")
    # k5: cut off by a crash, the pre-check says not done, executed again: once.
    a.add(11, EventKind.TOOL_INVOKED, tool="t", key="k5")
    a.add(12, EventKind.RUN_RESUMED, next=["act"])
    a.add(13, EventKind.EFFECT_RECONCILED, tool="t", key="k5", outcome="not_done")
    a.add(14, EventKind.TOOL_INVOKED, tool="t", key="k5").ok(15, "c5", tool="t", key="k5")
    # k6: refused before sending, then executed: once.
    a.add(16, EventKind.TOOL_INVOKED, tool="t", key="k6")
    a.fail(17, "c6", tool="t", key="k6", maybe_sent=False)
    a.add(18, EventKind.TOOL_INVOKED, tool="t", key="k6").ok(19, "c6", tool="t", key="k6")
    # k4: a business key executed by two threads: a confirmed duplicate.
    a.add(20, EventKind.TOOL_INVOKED, tool="t", key="k4").ok(21, "c4", tool="t", key="k4")
    a.add(22, EventKind.TOOL_INVOKED, tool="pure", key="p").ok(23, "cp", tool="pure", key="p")
    a.add(24, EventKind.TOOL_INVOKED, tool="pure", key="p").ok(25, "cp", tool="pure", key="p")
    a.finish(26)
    b = Log("b").start(30)
    b.add(31, EventKind.TOOL_INVOKED, tool="t", key="k4").ok(32, "x", tool="t", key="k4")
    b.finish(33)
    ledger = [
        entry(k, "a", "t", LedgerStatus.COMMITTED) for k in ("k1", "k2", "k3", "k4", "k5", "k6")
    ]

    d = compute_metrics(logs(a, b), ledger, now=T0).duplicates

    assert (d.effects, d.duplicates, d.possible_duplicates) == (6, 1, 1)  # "p" is no effect
    assert d.keys == ("k3", "k4")
    assert d.rate == pytest.approx(1 / 6)
    assert d.upper_rate == pytest.approx(2 / 6)


def test_mean_time_to_close_from_the_first_failure_of_each_turn() -> None:
    """30 s, 20 s (from the first of two failures) and 10 s: mean 20 s; failed and open apart."""
    a = Log("a").start().fail(10, "a1").ok(11, "a1").finish(40)
    b = Log("b").start().fail(5, "b1").fail(8, "b2").ok(9, "b2").finish(25)
    c = Log("c").start().fail(0, "c1").finish(9, status="failed")
    d = Log("d").start().fail(3, "d1")
    e = Log("e").start().fail(0, "e1").ok(1, "e1").finish(10).start(20).finish(500)

    t = compute_metrics(logs(a, b, c, d, e), now=T0).time_to_close

    assert (t.samples, t.failed, t.open) == (3, 1, 1)
    assert t.mean_seconds == pytest.approx(20.0)
    assert t.max_seconds == pytest.approx(30.0)


def test_human_takeover_cost_with_a_takeover_still_pending() -> None:
    """3 takeovers over 4 runs; 90 s answered, 60 s pending so far; decisions by action."""
    one = Log("one").start()
    one.add(0, EventKind.TAKEOVER_REQUESTED, tool="x").add(1, EventKind.TAKEOVER_REQUESTED)
    one.add(60, EventKind.RUN_RESUMED, decision="retry")  # ends the wait
    one.add(61, EventKind.DECISION_RECORDED, decision={"action": "retry"}, steps=[])
    one.add(100, EventKind.TAKEOVER_REQUESTED, tool="x")
    one.add(130, EventKind.DECISION_RECORDED, decision={"action": "skip"}, steps=[]).finish(131)
    two = Log("two").start().add(10, EventKind.TAKEOVER_REQUESTED, tool="y")
    three, four = Log("three").start().finish(1), Log("four").start().finish(1)

    m = compute_metrics(logs(one, two, three, four), now=T0 + timedelta(seconds=70))
    tk = m.takeover

    assert (tk.runs, tk.takeovers, tk.answered, tk.pending) == (4, 3, 2, 1)
    assert tk.per_100_runs == pytest.approx(75.0)
    assert tk.wait_seconds == pytest.approx(90.0)
    assert tk.mean_wait_seconds == pytest.approx(45.0)
    assert tk.pending_wait_seconds == pytest.approx(60.0)
    assert dict(tk.decisions) == {"retry": 1, "skip": 1}
    assert (m.runs.awaiting_human, m.runs.closed) == (1, 3)


def test_per_tool_figures_and_totals() -> None:
    """Calls, failures by kind, retries, degradations, compensations, missing compensators."""
    run = Log("t").start()
    for at in (1, 3):
        run.add(at, EventKind.TOOL_INVOKED, tool="search")
        run.fail(at + 1, "c1", kind="external_outage")
        run.add(at + 1.5, EventKind.RETRY_SCHEDULED, tool="search", using="search")
    run.add(5, EventKind.DEGRADED, tool="search", using="search", fallback="backup")
    run.add(6, EventKind.TOOL_INVOKED, tool="backup").ok(7, "c1", tool="backup")
    run.add(8, EventKind.EFFECT_UNCERTAIN, tool="pay", key="k")
    run.add(9, EventKind.COMPENSATED, tool="book", key="kb")
    run.add(10, EventKind.COMPENSATED, without_compensator=["k-mail", "k-sms"])
    run.add(11, EventKind.MODEL_FAILED, model=0, attempt=1, failure={"kind": "model"})
    run.add(12, EventKind.RUN_RESUMED, next=["act"])

    m = compute_metrics(logs(run), [entry("k", "t", "pay", LedgerStatus.UNCERTAIN)], now=T0)

    tools = {t.tool: t for t in m.tools}
    assert [t.tool for t in m.tools] == ["backup", "book", "pay", "search"]
    assert (tools["search"].calls, dict(tools["search"].failures)) == (2, {"external_outage": 2})
    assert (tools["search"].retries, tools["search"].degradations) == (2, 1)
    assert dict(tools["pay"].failures) == {"side_effect_uncertain": 1}
    assert tools["book"].compensations == 1
    assert (m.retries, m.degradations, m.compensations, m.compensations_missing) == (2, 1, 1, 2)
    assert (m.model_failures, m.resumes, m.uncertain_effects) == (1, 1, 1)
    assert m.runs.running == 1


def test_superseded_events_and_since_window() -> None:
    """Events a rewind superseded are left out; ``since`` keeps runs active since then."""
    old = Log("old").start().fail(1, "o1").finish(2, status="failed")
    rewound = Log("rewound").start(100).fail(101, "r1")
    rewound.events[-1] = replace(rewound.events[-1], superseded=True)
    rewound.ok(102, "r2").finish(103)

    m = compute_metrics(logs(old, rewound), now=T0)
    assert (m.local_recovery.failures, m.local_recovery.unrecovered) == (1, 1)  # old's only
    recent = compute_metrics(logs(old, rewound), since=T0 + timedelta(seconds=50), now=T0)
    assert recent.runs.total == 1
    assert recent.local_recovery.failures == 0
    assert recent.since == T0 + timedelta(seconds=50)
    epoch = compute_metrics(logs(old, rewound), since=(T0 + timedelta(seconds=50)).timestamp())
    assert epoch.runs.total == 1
    with pytest.raises(tp.ConfigurationError, match="since"):
        compute_metrics(logs(old), since="yesterday")  # type: ignore[arg-type]


def test_statuses_from_checkpoints_override_the_log() -> None:
    """A status known from the checkpoint wins; a failure in a finished run is not pending."""
    run = Log("t").start().fail(1, "c1")  # no agent_finished in the log
    m = compute_metrics(logs(run), statuses={"t": "failed"}, now=T0)
    assert (m.runs.failed, m.local_recovery.pending, m.local_recovery.unrecovered) == (1, 0, 1)


def _prom(m: RecoveryMetrics) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(m.to_prometheus()):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def test_exports_dict_and_prometheus_with_and_without_the_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``as_dict`` is JSON; the Prometheus text parses, and is the same without the library."""
    run = Log("t").start().fail(1, "c1", tool='we"ird\\tool').ok(2, "c1")
    run.add(3, EventKind.DECISION_RECORDED, decision={"action": "skip"}, steps=[]).finish(4)
    m = compute_metrics(logs(run), now=T0)

    data = json.loads(json.dumps(m.as_dict()))
    assert set(data) == {
        "local_recovery_rate",
        "duplicate_side_effect_rate",
        "mean_time_to_close_seconds",
        "takeovers_per_100_runs",
        "local_recovery",
        "duplicate_side_effects",
        "time_to_close",
        "human_takeover",
        "runs",
        "tools",
        "totals",
        "since",
        "computed_at",
    }
    assert data["local_recovery"]["rate"] == data["local_recovery_rate"] == 1.0
    assert (data["duplicate_side_effect_rate"], data["takeovers_per_100_runs"]) == (None, 0.0)
    assert data["mean_time_to_close_seconds"] == 3.0
    assert data["time_to_close"]["mean_seconds"] == 3.0
    assert data["human_takeover"]["decisions"] == {"skip": 1}
    assert data["tools"]['we"ird\\tool']["failures"] == {"transient": 1}
    assert data["runs"]["open"] == 0

    with_library = m.to_prometheus()
    samples = _prom(m)
    assert samples["taskpilots_local_recovery_rate"][()] == 1.0
    assert samples["taskpilots_time_to_close_seconds_mean"][()] == 3.0
    assert math.isnan(samples["taskpilots_duplicate_side_effect_rate"][()])
    labels = (("kind", "transient"), ("tool", 'we"ird\\tool'))
    assert samples["taskpilots_tool_failures"][labels] == 1.0
    assert samples["taskpilots_runs"][(("status", "closed"),)] == 1.0

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # "not installed"
    assert m.to_prometheus() == with_library


# --- through the store ------------------------------------------------------------------------


def test_hand_written_log_in_the_store(cp: tp.RecoveryCheckpointer) -> None:
    """Events appended with ``append_event`` (no checkpoint) are measured when named."""
    cp.append_event("h1", "agent_started", {"goal": "go"})
    cp.append_event("h1", "tool_failed", {"tool": "s", "tool_call_id": "c", "failure": {}})
    cp.append_event("h1", "tool_succeeded", {"tool": "s", "tool_call_id": "c"})
    cp.append_event("h1", "agent_finished", {"status": "closed"})
    cp.append_event("h2", "agent_started", {"goal": "go"})
    cp.append_event("h2", "takeover_requested", {"tool": "s"})

    m = recovery_metrics(cp, thread_ids=["h1", "h2"])

    assert (m.local_recovery.recovered, m.local_recovery.rate) == (1, 1.0)
    assert dict(m.tools[0].failures) == {"unknown": 1}
    assert (m.runs.total, m.runs.closed, m.runs.awaiting_human) == (2, 1, 1)
    assert (m.takeover.takeovers, m.takeover.pending) == (1, 1)
    assert m.takeover.pending_wait_seconds >= 0.0
    assert recovery_metrics(cp).runs.total == 0  # no checkpoint and no ledger: not scanned
    with pytest.raises(ThreadNotFound):
        recovery_metrics(cp, thread_ids=["h1", "nobody"])
    with pytest.raises(tp.ConfigurationError):
        recovery_metrics(cp, thread_ids="h1")


def _read_tool(name: str) -> BaseTool:
    def read(q: str) -> str:
        return f"found: {q}"

    return StructuredTool.from_function(read, name=name, description=f"read {name}")


class Service:
    """A simulated service recording each executed effect."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def tool(self, name: str) -> BaseTool:
        def perform(ref: str) -> str:
            self.done.append(f"{name}:{ref}")
            return f"{name} {ref} ok"

        return StructuredTool.from_function(perform, name=name, description=f"perform {name}")


def _transient_run(cp: Any, service: Service) -> tuple[Any, testing.FaultyTool]:
    search = testing.failing(_read_tool("kb_search"), times=2, exc=TimeoutError("timed out"))
    model = PlanModel(plan=[("create_ticket", {"ref": "A"}), ("kb_search", {"q": "refund"})])
    graph = tp.create_recovery_agent(
        model,
        [search.tool, tp.side_effect(service.tool("create_ticket"), idempotent=True)],
        checkpointer=cp,
        default_policy=ToolPolicy(backoff=FAST),
    )
    return graph, search


def _check_transient(m: RecoveryMetrics) -> None:
    assert (m.runs.total, m.runs.closed) == (1, 1)
    lr = m.local_recovery
    assert (lr.failures, lr.recovered, lr.recovered_automatically, lr.rate) == (1, 1, 1, 1.0)
    assert (m.duplicates.effects, m.duplicates.duplicates, m.duplicates.rate) == (1, 0, 0.0)
    assert m.time_to_close.samples == 1
    assert m.mean_time_to_close_seconds is not None
    assert m.mean_time_to_close_seconds >= 0
    assert (m.takeover.takeovers, m.takeovers_per_100_runs) == (0, 0.0)
    tools = {t.tool: t for t in m.tools}
    assert (tools["kb_search"].calls, dict(tools["kb_search"].failures)) == (3, {"transient": 2})
    assert (tools["kb_search"].retries, m.retries) == (2, 2)


def test_real_run_with_a_transient_failure(cp: tp.RecoveryCheckpointer) -> None:
    """A real agent run: the timed-out search is retried, recovered in place, effect once."""
    service = Service()
    graph, search = _transient_run(cp, service)
    with testing.fake_clock():
        graph.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "t"}})

    assert search.calls == 3
    assert service.done == ["create_ticket:A"]
    _check_transient(recovery_metrics(cp))  # the thread is found by the scan
    assert recovery_metrics(cp, since=datetime.now(UTC) + timedelta(hours=1)).runs.total == 0


def test_real_takeover_pending_then_answered(cp: tp.RecoveryCheckpointer) -> None:
    """An uncertain effect waits on a person (pending), then ``retry``: a possible duplicate."""
    service = Service()
    charge = testing.fail_after_effect(tp.side_effect(service.tool("charge")), times=1)
    graph = tp.create_recovery_agent(
        PlanModel(plan=[("charge", {"ref": "C"})]), [charge.tool], checkpointer=cp
    )
    graph.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "t"}})

    waiting = recovery_metrics(cp)
    assert (waiting.runs.awaiting_human, waiting.takeover.pending) == (1, 1)
    assert (waiting.local_recovery.pending, waiting.uncertain_effects) == (1, 1)
    assert waiting.time_to_close.open == 1

    tp.decide(graph, "t", "retry")
    done = recovery_metrics(cp)
    (key,) = [e.key for e in cp.ledger("t")]
    assert service.done == ["charge:C", "charge:C"]  # the person's retry ran it again
    assert (done.takeover.answered, dict(done.takeover.decisions)) == (1, {"retry": 1})
    assert (done.duplicates.possible_duplicates, done.duplicates.keys) == (1, (key,))
    assert (done.local_recovery.recovered, done.local_recovery.recovered_automatically) == (1, 0)
    assert done.runs.closed == 1


async def test_async_metrics_of_a_real_async_run(sqlite_path: str) -> None:
    """``arecovery_metrics`` on an ``AsyncRecoveryCheckpointer`` after ``ainvoke``."""
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as acp:
        await acp.setup()
        service = Service()
        graph, _ = _transient_run(acp, service)
        with testing.fake_clock():
            await graph.ainvoke(
                {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "t"}}
            )
        _check_transient(await arecovery_metrics(acp))
        _check_transient(await arecovery_metrics(acp, thread_ids=["t"]))


def test_killed_and_resumed_run_counts_no_duplicate(sqlite_path: str) -> None:
    """SIGKILL inside an idempotent effect, resume: one effect, a resume, nothing duplicated."""
    import signal
    import subprocess

    from test_threads import BOOK_KEY, CHILD, TESTS

    conn = f"sqlite:///{sqlite_path}"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, conn, str(TESTS)], capture_output=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
        killed = recovery_metrics(cp)
        assert (killed.runs.running, killed.duplicates.effects) == (1, 1)  # maybe executed
        service = Service()
        graph = tp.create_recovery_agent(
            PlanModel(plan=[("book", {"ref": "A"})]),
            [tp.side_effect(service.tool("book"), idempotent=True, key=BOOK_KEY)],
            checkpointer=cp,
        )
        tp.resume(graph, "t")
        m = recovery_metrics(cp)

    assert service.done == ["book:A"]
    assert (m.runs.closed, m.resumes, m.local_recovery.failures) == (1, 1, 0)
    # The cut-off call may have reached the service, but the service deduplicates by key.
    assert (m.duplicates.effects, m.duplicates.duplicates, m.duplicates.possible_duplicates) == (
        1,
        0,
        0,
    )
    assert dict(next(t for t in m.tools if t.tool == "book").failures) == {}


def test_metrics_publish_as_opentelemetry_gauges() -> None:
    """The same gauges reach an OpenTelemetry reader, with labels as attributes."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    run = Log("t").start().fail(1, "c1").ok(2, "c1").finish(4)
    m = compute_metrics(logs(run), now=T0)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    m.record_opentelemetry(provider.get_meter("taskpilots-test"))
    data = reader.get_metrics_data()
    assert data is not None
    points = {
        metric.name: {
            tuple(sorted((p.attributes or {}).items())): p.value for p in metric.data.data_points
        }
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
    }
    prometheus = _prom(m)
    assert points["taskpilots_local_recovery_rate"] == {(): 1.0}
    assert points["taskpilots_runs"][(("status", "closed"),)] == 1.0
    # Every defined Prometheus sample is there too; undefined (NaN) ones are left out.
    for name, samples in prometheus.items():
        for labels, value in samples.items():
            if not math.isnan(value):
                assert points[name][labels] == value, (name, labels)
    assert (
        "taskpilots_duplicate_side_effect_rate" not in points
        or not points["taskpilots_duplicate_side_effect_rate"]
    )
    provider.shutdown()
