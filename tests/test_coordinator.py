"""The multi-agent coordinator: plan logic, and real runs on PostgreSQL + Redis.

Acceptance (issue 11):

* one sub-agent SIGKILLed mid-run: only it is resumed, the others' completed work is
  untouched (their call counts in the simulated services), duplicates 0;
* a failure that touched shared data: the shared effect is compensated exactly once, before
  the dependents run again (event order in the parent's log);
* two sub-agents racing for one business operation: exactly one effect;
* a constructed mutual wait is reported STUCK naming both sub-agents.

The simulated services (:class:`CustomerServices`) keep their state in a SQLite file outside
the agents' process and database; crashes are real SIGKILLs of a forked worker process.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool

import taskpilots_graph as tp
from taskpilots_graph.coordinator import (
    CoordinationPlan,
    Share,
    SharePolicy,
    SubAgentState,
    attempt_thread_id,
    await_lock,
    create_coordinator,
    find_cycle,
    plan_recovery,
)
from taskpilots_graph.demo.multi_agent import (
    CustomerServices,
    build_coordinator,
    customer_tools,
    inputs_for,
)
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.locks import lease_backend_from_url
from taskpilots_graph.testing import ScriptedModel

# --- pure logic -----------------------------------------------------------------------------


def test_find_cycle_names_the_cycle_from_its_smallest_member() -> None:
    assert find_cycle({"a": ["b"], "b": ["c"], "c": []}) == ()
    assert find_cycle({"b": ["c"], "c": ["a"], "a": ["b"], "d": ["a"]}) == ("a", "b", "c")
    assert find_cycle({"x": ["y"], "y": ["x"]}) == ("x", "y")


def test_plan_validates_names_and_dependencies() -> None:
    with pytest.raises(tp.ConfigurationError, match="unknown"):
        CoordinationPlan.build(["a"], {"a": ["zzz"]})
    with pytest.raises(tp.ConfigurationError, match="itself"):
        CoordinationPlan.build(["a"], {"a": ["a"]})
    with pytest.raises(tp.ConfigurationError, match="unknown sub-agents"):
        CoordinationPlan.build(["a"], shares={"b": ["x"]})
    with pytest.raises(tp.ConfigurationError, match="without '/'"):
        CoordinationPlan.build(["a/b"])
    with pytest.raises(tp.ConfigurationError, match="list of names"):
        CoordinationPlan.build(["a", "b"], {"a": "b"})
    plan = CoordinationPlan.build(["a", "b", "c"], {"b": ["a"], "c": ["b"]})
    assert plan.dependents("a") == ("b", "c")
    assert plan.cycle() == ()


def test_plan_recovery_rebuilds_an_independent_failure_alone() -> None:
    plan = CoordinationPlan.build(["crm", "ticketing"], shares={"crm": ["c1"], "ticketing": []})
    decision = plan_recovery(
        plan,
        "crm",
        [("k1", "crm_sync", "c1"), ("k2", "note", None)],
        started=["crm", "ticketing"],
        attempts=1,
        max_attempts=2,
    )
    assert decision.compensate == ()
    assert decision.rerun == ("crm",)


def test_plan_recovery_keeps_shared_effects_by_default_and_reruns_the_failed_alone() -> None:
    """Default policy: a failure that touched a shared object undoes nothing and re-runs
    only the failed sub-task; its effects on the object are reported kept."""
    plan = CoordinationPlan.build(
        ["crm", "ticketing", "billing"], shares={"crm": ["c1"], "ticketing": ["c1"]}
    )
    decision = plan_recovery(
        plan,
        "crm",
        [("k1", "crm_sync", "c1"), ("k2", "note", None)],
        started=["crm", "ticketing", "billing"],
        attempts=1,
        max_attempts=2,
        sharers={"ticketing": [("t1", "open_ticket", "c1")]},
    )
    assert decision.compensate == ()
    assert decision.rerun == ("crm",)
    assert [(e.key, e.owner) for e in decision.kept] == [("k1", "crm")]


def test_plan_recovery_compensates_sharers_once_under_the_compensate_policy() -> None:
    """Policy ``compensate``: the failed sub-task's and every sharer's committed effects on
    the object are listed once, the failed one's first; effects without a compensator are
    kept; sharers that never started are left alone."""
    c1 = Share("c1", policy="compensate")
    plan = CoordinationPlan.build(
        ["picker", "packer", "shipper", "late"],
        {"shipper": ["picker", "packer"]},
        {"picker": [c1], "packer": ["c1"], "shipper": [c1], "late": ["c1"]},
    )
    decision = plan_recovery(
        plan,
        "shipper",
        [("s1", "book_carrier", "c1")],
        started=["picker", "packer", "shipper"],
        attempts=1,
        max_attempts=2,
        sharers={
            "picker": [("p1", "reserve_stock", "c1"), ("p2", "reserve_stock", "c1")],
            "packer": [("k1", "pack_order", "c1")],
        },
        undoable={"s1", "p1", "p2"},
    )
    assert decision.compensate == ("s1", "p2", "p1")
    assert [e.owner for e in decision.shared] == ["shipper", "picker", "picker"]
    assert [(e.key, e.owner) for e in decision.kept] == [("k1", "packer")]
    assert decision.rerun == ("shipper", "picker", "packer")


def test_share_policies_are_validated_per_object() -> None:
    with pytest.raises(tp.ConfigurationError, match="two policies"):
        CoordinationPlan.build(
            ["a", "b"], shares={"a": [Share("o", "compensate")], "b": [Share("o")]}
        )
    with pytest.raises(tp.ConfigurationError, match="must be one of"):
        Share("o", policy="undo")  # type: ignore[arg-type]
    with pytest.raises(tp.ConfigurationError, match="non-empty"):
        Share("")
    with pytest.raises(tp.ConfigurationError, match="not one value"):
        CoordinationPlan.build(["a"], shares={"a": Share("o")})  # type: ignore[dict-item]
    plan = CoordinationPlan.build(["a", "b"], shares={"a": ["o"], "b": [Share("o", "compensate")]})
    assert plan.policy("o") is SharePolicy.COMPENSATE  # a plain id takes the declared policy
    assert plan.policy("elsewhere") is SharePolicy.KEEP
    assert plan.policy_payload() == {"o": "compensate"}


def test_plan_recovery_compensates_shared_effects_then_reruns_readers() -> None:
    plan = CoordinationPlan.build(
        ["crm", "ticketing", "notify", "billing"],
        {"notify": ["ticketing"]},
        {"crm": [Share("c1", "compensate")], "ticketing": ["c1"], "notify": [], "billing": ["c2"]},
    )
    decision = plan_recovery(
        plan,
        "crm",
        [("k1", "crm_sync", "c1"), ("k2", "crm_sync", "c1"), ("k3", "other", "c9")],
        started=["crm", "ticketing", "billing"],
        attempts=1,
        max_attempts=3,
    )
    assert decision.compensate == ("k2", "k1")  # newest first; c9 is nobody else's
    assert decision.rerun == ("crm", "ticketing")  # notify never started; billing unrelated
    assert plan_recovery(plan, "crm", [], started=[], attempts=3, max_attempts=3).give_up


def test_create_coordinator_refuses_bad_configuration(tmp_path: Path) -> None:
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{tmp_path / 'r.db'}") as cp:
        cp.setup()
        services = CustomerServices(str(tmp_path / "s.db"))
        graph = tp.create_recovery_agent(
            ScriptedModel(plan=[]), [customer_tools(services)["notify"]], checkpointer=cp
        )
        with pytest.raises(tp.ConfigurationError, match="at least one"):
            create_coordinator({}, checkpointer=cp)
        with pytest.raises(tp.ConfigurationError, match="max_attempts"):
            create_coordinator({"a": graph}, checkpointer=cp, max_attempts=0)
        with pytest.raises(tp.ConfigurationError, match="RecoveryCheckpointer"):
            create_coordinator({"a": graph}, checkpointer=object())  # type: ignore[arg-type]
        coordinator = create_coordinator({"a": graph}, checkpointer=cp)
        with pytest.raises(tp.ConfigurationError, match="no input"):
            coordinator.run("p", {})


# --- helpers ----------------------------------------------------------------------------------


def _agent(cp: Any, plan: list[tuple[str, dict[str, Any]]], tools: list[Any], **kw: Any) -> Any:
    return tp.create_recovery_agent(
        ScriptedModel(plan=plan, answer="done"), tools, checkpointer=cp, **kw
    )


def _inputs(*names: str) -> dict[str, Any]:
    return {n: {"messages": [HumanMessage(f"go {n}")]} for n in names}


def _parent_log(cp: Any, parent: str) -> list[Event]:
    return [e for e in cp.events(parent) if "subagent" in e.payload or "subagents" in e.payload]


def test_dependency_cycle_is_reported_stuck_and_the_rest_still_runs(tmp_path: Path) -> None:
    services = CustomerServices(str(tmp_path / "s.db"))
    services.seed(dict.fromkeys("abcd", "standard"))
    tools = customer_tools(services)
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{tmp_path / 'r.db'}") as cp:
        cp.setup()
        graphs = {
            n: _agent(cp, [("notify", {"customer_id": n, "message": "hi"})], [tools["notify"]])
            for n in ("a", "b", "c", "d")
        }
        coordinator = create_coordinator(
            graphs, checkpointer=cp, depends_on={"a": ["b"], "b": ["a"], "d": ["a"]}
        )
        report = coordinator.run("cyc", _inputs("a", "b", "c", "d"))
        assert report.stuck == ("a", "b")
        assert report.subagents["c"].state is SubAgentState.DONE
        assert report.subagents["d"].state is SubAgentState.BLOCKED
        stuck = [e for e in cp.events("cyc") if e.kind is EventKind.STUCK_DETECTED]
        assert [dict(e.payload)["subagents"] for e in stuck] == [["a", "b"]]
        assert dict(stuck[0].payload)["kind"] == "dependency_cycle"
        # Coordinating again reports it again, without a second event or a run of a or b.
        again = coordinator.run("cyc", _inputs("a", "b", "c", "d"))
        assert again.stuck == ("a", "b")
        assert len([e for e in cp.events("cyc") if e.kind is EventKind.STUCK_DETECTED]) == 1
        assert [e["identity"].split(":")[0] for e in services.effects("notify")] == ["c"]


def test_async_run_coordinates_like_the_sync_one(tmp_path: Path) -> None:
    services = CustomerServices(str(tmp_path / "s.db"))
    services.seed({"cust-a": "standard"})
    conn = f"sqlite:///{tmp_path / 'r.db'}"
    with tp.RecoveryCheckpointer.from_conn_string(conn) as cp, lease_backend_from_url(conn) as ls:
        cp.setup()
        coordinator = build_coordinator(services, cp, "cust-a", leases=ls)
        report = asyncio.run(coordinator.arun("p-async", inputs_for("cust-a")))
    assert report.done
    assert [e["service"] for e in services.effects()] == [
        "crm_sync",
        "open_ticket",
        "open_ticket",
        "notify",
    ]


# --- SIGKILL of one sub-agent ----------------------------------------------------------------


def _coordinate_in_child(pg: str, redis_url: str, services_path: str, parent: str) -> None:
    code = 2
    try:
        with (
            tp.RecoveryCheckpointer.from_conn_string(pg) as cp,
            lease_backend_from_url(redis_url) as leases,
        ):
            services = CustomerServices(services_path)
            coordinator = build_coordinator(
                services, cp, "cust-1", leases=leases, lease_ttl=1.0, poll_interval=0.05
            )
            report = coordinator.run(parent, inputs_for("cust-1"))
            code = 0 if report.done else 3
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _fork(target: Any, *args: Any) -> int:
    # Forked from an interpreter that already imported everything: a worker restarts in
    # milliseconds, not the seconds a fresh interpreter takes on a loaded machine.
    proc = multiprocessing.get_context("fork").Process(target=target, args=args)
    proc.start()
    proc.join(timeout=120)
    if proc.is_alive():
        proc.kill()
        pytest.fail("worker hung")
    assert proc.exitcode is not None
    return proc.exitcode


@pytest.mark.postgres
@pytest.mark.redis
def test_sigkilled_subagent_alone_is_resumed(
    postgres_url: str, redis_url: str, tmp_path: Path
) -> None:
    """crm → ticketing → notify; the worker is SIGKILLed twice inside ticketing (right after
    a ticket was opened, before its commit; then right before the second ticket). Only
    ticketing is resumed; crm is never called again; notify starts once ticketing is done."""
    with tp.RecoveryCheckpointer.from_conn_string(postgres_url) as cp:
        cp.setup()
    services = CustomerServices(str(tmp_path / "services.db"))
    services.seed({"cust-1": "standard"})
    services.plant_kill("open_ticket", "after")
    services.plant_kill("open_ticket", "before")
    args = (postgres_url, redis_url, services.path, "onboard-1")

    codes = [_fork(_coordinate_in_child, *args) for _ in range(2)]
    assert codes == [-signal.SIGKILL, -signal.SIGKILL]
    assert services.pending_kills() == 0
    # Before the last run: crm finished; ticketing opened one ticket; notify never started.
    assert services.calls("crm_sync") == 1
    assert services.calls("notify") == 0
    assert _fork(_coordinate_in_child, *args) == 0

    # Others untouched: crm was called once, in the first process; notify once, at the end.
    assert services.calls("crm_sync") == 1
    assert services.calls("notify") == 1
    assert services.calls("open_ticket") == 3  # 2 tickets + the call killed before it acted
    assert [e["identity"] for e in services.effects("open_ticket")] == [
        "cust-1:Upgrade",
        "cust-1:Welcome pack",
    ]
    assert services.duplicates() == 0
    with tp.RecoveryCheckpointer.from_conn_string(postgres_url) as cp:
        log = _parent_log(cp, "onboard-1")
        started = [e.payload["subagent"] for e in log if e.kind is EventKind.AGENT_STARTED]
        resumed = [e for e in log if e.kind is EventKind.RUN_RESUMED]
        assert started == ["crm", "ticketing", "notify"]
        assert {e.payload["subagent"] for e in resumed} == {"ticketing"}
        assert len(resumed) == 2
        why = dict(resumed[0].payload)["attribution"]
        assert why["kind"] == "worker_lost"
        assert why["parent"] == "onboard-1"
        assert why["thread_id"] == attempt_thread_id("onboard-1", "ticketing", 1)
        # The resumed thread ran from its own checkpoint: one ledger entry per ticket.
        entries = cp.ledger("onboard-1/ticketing")
        assert [e.status for e in entries if e.tool == "open_ticket"] == ["committed"] * 2


# --- shared data ------------------------------------------------------------------------------


class VerifyFailed(Exception):
    """The CRM's consistency check refused the record: nothing will fix it in this run."""

    failure_kind = "fatal"


@pytest.mark.postgres
@pytest.mark.redis
def test_shared_failure_is_compensated_once_before_dependents_rerun(
    postgres_url: str, redis_url: str, tmp_path: Path
) -> None:
    services = CustomerServices(str(tmp_path / "services.db"))
    services.seed({"cust-7": "standard"})
    tools = customer_tools(services)
    verified: list[str] = []

    def verify_record(customer_id: str) -> str:
        """Check the CRM record."""
        verified.append(customer_id)
        if len(verified) == 1:
            raise VerifyFailed("tier conflicts with the billing plan")
        return "consistent"

    verify = StructuredTool.from_function(verify_record)
    c = {"customer_id": "cust-7"}
    with (
        tp.RecoveryCheckpointer.from_conn_string(postgres_url) as cp,
        lease_backend_from_url(redis_url) as leases,
    ):
        cp.setup()
        kw = {"leases": leases, "lease_ttl": 5.0}
        graphs = {
            "crm": _agent(
                cp,
                [("crm_sync", {**c, "tier": "gold"}), ("verify_record", c)],
                [tools["crm_sync"], verify],
                **kw,
            ),
            "ticketing": _agent(cp, [("read_customer", c)], [tools["read_customer"]], **kw),
            "notify": _agent(
                cp, [("notify", {**c, "message": "welcome"})], [tools["notify"]], **kw
            ),
        }
        # The record's policy: a failure that changed it undoes the changes (default: keep).
        record = Share("cust-7", policy="compensate")
        coordinator = create_coordinator(
            graphs,
            checkpointer=cp,
            leases=leases,
            shares={"crm": [record], "ticketing": [record], "notify": [record]},
            poll_interval=0.05,
        )
        report = coordinator.run("shared-1", _inputs("crm", "ticketing", "notify"))
        log = _parent_log(cp, "shared-1")
        first_sync = cp.ledger("shared-1/crm")[0]

    assert report.done, report
    assert {n: r.attempts for n, r in report.subagents.items()} == {
        "crm": 2,
        "ticketing": 2,
        "notify": 2,
    }
    # Compensated exactly once: one undo call, one event, the ledger entry marked.
    assert services.calls("crm_revert") == 1
    compensated = [e for e in log if e.kind is EventKind.COMPENSATED]
    assert len(compensated) == 1
    assert compensated[0].payload["key"] == first_sync.key
    assert first_sync.status == "compensated"
    why = dict(compensated[0].payload)["attribution"]
    assert (why["subagent"], why["tool"], why["kind"]) == ("crm", "verify_record", "fatal")
    assert why["step"]  # the tool call id of the failed step
    # Order: every re-run starts after the compensation.
    reruns = [e for e in log if e.kind is EventKind.AGENT_STARTED and e.payload["attempt"] == 2]
    assert {e.payload["subagent"] for e in reruns} == {"crm", "ticketing", "notify"}
    assert all(e.seq > compensated[0].seq for e in reruns)
    # The record was restored, then synced again by the second attempt.
    assert [e["service"] for e in services.effects() if "crm" in e["service"]] == [
        "crm_sync",
        "crm_revert",
        "crm_sync",
    ]
    assert services.tier("cust-7") == "gold"
    # Every attempt continued its sub-agent's own thread: notify's re-run got its message
    # back from the ledger instead of sending it again.
    assert {r.thread_id for r in report.subagents.values()} == {
        f"shared-1/{n}" for n in ("crm", "ticketing", "notify")
    }
    assert services.calls("notify") == 1


def test_independent_failure_is_rebuilt_alone(tmp_path: Path) -> None:
    """A sub-agent failing without touching shared data: it alone runs again, nothing is
    compensated, and its sibling's finished work is not touched."""
    services = CustomerServices(str(tmp_path / "services.db"))
    services.seed({"cust-9": "standard"})
    tools = customer_tools(services)
    checks: list[str] = []

    def verify_record(customer_id: str) -> str:
        """Check the CRM record."""
        checks.append(customer_id)
        if len(checks) == 1:
            raise VerifyFailed("billing plan not loaded yet")
        return "consistent"

    c = {"customer_id": "cust-9"}
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{tmp_path / 'r.db'}") as cp:
        cp.setup()
        graphs = {
            "crm": _agent(
                cp,
                [("crm_sync", {**c, "tier": "gold"}), ("verify_record", c)],
                [tools["crm_sync"], StructuredTool.from_function(verify_record)],
            ),
            "notify": _agent(cp, [("notify", {**c, "message": "hi"})], [tools["notify"]]),
        }
        # crm's record is nobody else's business here: no shares declared.
        report = create_coordinator(graphs, checkpointer=cp, poll_interval=0.05).run(
            "alone", _inputs("crm", "notify")
        )
        log = _parent_log(cp, "alone")
    assert report.done
    assert (report.subagents["crm"].attempts, report.subagents["notify"].attempts) == (2, 1)
    assert services.calls("crm_revert") == 0
    assert services.calls("notify") == 1
    scheduled = [e for e in log if e.kind is EventKind.RETRY_SCHEDULED]
    assert [dict(e.payload)["rerun"] for e in scheduled] == [["crm"]]
    why = dict(scheduled[0].payload)["attribution"]
    assert (why["parent"], why["subagent"], why["tool"], why["kind"]) == (
        "alone",
        "crm",
        "verify_record",
        "fatal",
    )
    assert why["thread_id"] == "alone/crm"
    assert not [e for e in log if e.kind is EventKind.COMPENSATED]


# --- a race for one business operation ---------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.redis
def test_two_subagents_racing_for_one_contract_send_one(
    postgres_url: str, redis_url: str, tmp_path: Path
) -> None:
    services = CustomerServices(str(tmp_path / "services.db"), latency_s=0.2)
    tools = customer_tools(services)
    rounds = 4
    with (
        tp.RecoveryCheckpointer.from_conn_string(postgres_url) as cp,
        lease_backend_from_url(redis_url) as leases,
    ):
        cp.setup()
        for r in range(rounds):
            customer = f"cust-{r}"
            plan = [("send_contract", {"customer_id": customer})]
            graphs = {
                n: _agent(cp, plan, [tools["send_contract"]], leases=leases, lease_ttl=5.0)
                for n in ("ticketing", "notify")
            }
            report = create_coordinator(
                graphs, checkpointer=cp, leases=leases, poll_interval=0.05
            ).run(f"race-{r}", _inputs("ticketing", "notify"))
            assert report.done
            answers = {
                n: [
                    m.content
                    for m in graphs[n]
                    .get_state({"configurable": {"thread_id": f"race-{r}/{n}"}})
                    .values["messages"]
                    if isinstance(m, ToolMessage)
                ]
                for n in graphs
            }
            # The loser got the winner's recorded contract instead of sending another.
            assert answers["ticketing"] == answers["notify"], answers
    sent = [e["identity"] for e in services.effects("send_contract")]
    assert sorted(sent) == [f"cust-{r}" for r in range(rounds)]
    assert services.calls("send_contract") == rounds


# --- a mutual wait ------------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.redis
def test_mutual_wait_is_reported_stuck_naming_both(
    postgres_url: str, redis_url: str, tmp_path: Path
) -> None:
    both_hold = threading.Barrier(2)
    waiting_since: list[float] = []
    with (
        tp.RecoveryCheckpointer.from_conn_string(postgres_url) as cp,
        lease_backend_from_url(redis_url) as leases,
    ):
        cp.setup()

        def merge_records(first: str, second: str) -> str:
            """Merge two customer records: lock the first, then the second."""
            with await_lock(leases, first, "merge", ttl=5.0):
                both_hold.wait(timeout=30)
                waiting_since.append(time.time())
                with await_lock(leases, second, "merge", ttl=5.0):
                    return "merged"

        merge = tp.side_effect(StructuredTool.from_function(merge_records))
        policy = {"merge_records": tp.ToolPolicy(max_attempts=1)}
        graphs = {
            "crm": _agent(
                cp,
                [("merge_records", {"first": "c1", "second": "c2"})],
                [merge],
                leases=leases,
                policies=policy,
            ),
            "billing": _agent(
                cp,
                [("merge_records", {"first": "c2", "second": "c1"})],
                [merge],
                leases=leases,
                policies=policy,
            ),
        }
        coordinator = create_coordinator(graphs, checkpointer=cp, leases=leases, poll_interval=0.2)
        report = coordinator.run("deadlock", _inputs("crm", "billing"))
        stuck = [e for e in cp.events("deadlock") if e.kind is EventKind.STUCK_DETECTED]
        statuses = {n: tp.thread_info(cp, f"deadlock/{n}").status for n in graphs}

    assert report.stuck == ("crm", "billing")
    # Every sub-agent of the cycle stopped waiting and escalated to a person, except one
    # that got its second lock because the other let go first (it may finish).
    assert "awaiting_human" in statuses.values()
    for name, status in statuses.items():
        expected = SubAgentState.DONE if status == "closed" else SubAgentState.STUCK
        assert status in ("awaiting_human", "closed")
        assert report.subagents[name].state is expected
    assert len(stuck) == 1
    payload = dict(stuck[0].payload)
    assert payload["kind"] == "mutual_wait"
    assert sorted(payload["subagents"]) == ["billing", "crm"]
    assert payload["locks"] == ["lock:c1:merge", "lock:c2:merge"]
    # Reported within the configured bound (one poll; generous slack for a loaded machine).
    assert stuck[0].ts.timestamp() - max(waiting_since) < 10.0
