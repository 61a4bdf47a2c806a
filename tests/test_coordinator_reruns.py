"""The coordinator re-runs only what failed, and a re-run never repeats a committed effect.

Picker, packer and shipper sub-agents work on one shared order; the shipper books a
carrier, then its label printer jams (a fatal failure, refused before printing). Under the
order's default policy (``keep``) only the shipper runs again, on its own thread, and gets
its booking back from the ledger; under ``compensate`` the booking and the picker's
reservation are undone exactly once, then the shipper, picker and packer run again (the
packer's sealed parcel cannot be undone: its re-run gets it back from the ledger).

The World (:class:`_warehouse.Warehouse`) keeps its own SQLite file: every effect is counted
by the request key it was performed under, every undo once per key. The models are
:class:`~taskpilots_graph.testing.ScriptedModel`: they decide from the messages alone, and a
re-run's new user message makes them plan every step again, so what keeps an effect from
running twice is the ledger, not the model's restraint. Crashes are SIGKILLs of a forked
coordinator process at planted points, continued by a fresh process.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from _warehouse import ORDER, PLANS, SUBAGENTS, Warehouse, order_inputs, warehouse_tools
from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.runnables import RunnableConfig

import taskpilots_graph as tp
from taskpilots_graph.coordinator import Coordinator, Share, SharePolicy, _drive, create_coordinator
from taskpilots_graph.coordinator._rerun import NOTICE_NAME, notice_id, rerun_input, rerun_notice
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.ledger import CompensationUncertain, LedgerEntry, LedgerStatus
from taskpilots_graph.nodes.compensate import decide_compensation
from taskpilots_graph.testing import ScriptedModel

PARENT = "order-1"
SERVICES = ("reserve_stock", "pack_order", "book_carrier", "print_label")


def _coordinator(
    cp: Any,
    world: Warehouse,
    policy: SharePolicy | str,
    *,
    ttl: float = 30.0,
    undo_prechecks: bool = True,
) -> Coordinator:
    tools = warehouse_tools(world, undo_prechecks=undo_prechecks)
    graphs = {
        name: tp.create_recovery_agent(
            ScriptedModel(plan=PLANS[name], answer=f"{name} done"),
            [tools[t] for t in dict.fromkeys(step for step, _ in PLANS[name])],
            checkpointer=cp,
            lease_ttl=ttl,
            name=name,
        )
        for name in SUBAGENTS
    }
    order = Share(ORDER, policy=SharePolicy(policy))
    return create_coordinator(
        graphs,
        checkpointer=cp,
        depends_on={"shipper": ["picker", "packer"]},
        shares={name: [order] for name in SUBAGENTS},
        poll_interval=0.05,
        lease_ttl=ttl,
    )


def _log(cp: Any, kind: EventKind) -> list[Event]:
    return [e for e in cp.events(PARENT) if e.kind is kind and "subagent" in e.payload]


def _notices(coordinator: Coordinator, name: str) -> list[str]:
    config: RunnableConfig = {"configurable": {"thread_id": f"{PARENT}/{name}"}}
    messages: list[BaseMessage] = coordinator.subagents[name].get_state(config).values["messages"]
    return [
        str(m.content) for m in messages if isinstance(m, HumanMessage) and m.name == NOTICE_NAME
    ]


def _assert_each_effect_once(world: Warehouse, policy: str) -> None:
    """The World: one standing effect per step, no request key performed twice, and each
    undone effect undone exactly once (the first attempt's, under ``compensate``)."""
    assert world.repeated_keys() == 0
    assert {s: world.active(s) for s in SERVICES} == dict.fromkeys(SERVICES, 1)
    assert world.performed("pack_order") == world.performed("pack_order")[:1]
    assert len(world.performed("print_label")) == 1
    for service in ("reserve_stock", "book_carrier"):
        performed, undone = world.performed(service), world.undone(service)
        if policy == "keep":
            assert (len(performed), undone) == (1, [])
        else:
            assert len(performed) == 2
            assert undone == performed[:1]
    # No compensator ran twice, not even after a crash inside it (the undo's pre-check).
    expected_undos = 0 if policy == "keep" else 1
    assert world.calls("release_stock") == world.calls("cancel_booking") == expected_undos


@pytest.mark.parametrize("policy", ["keep", "compensate"])
def test_rerun_performs_every_committed_effect_once(
    conn_string: str, tmp_path: Path, policy: str
) -> None:
    """Acceptance: three sub-agents share one order, the shipper fails after the others
    committed and after its own booking; every committed effect is performed once overall,
    under the default policy and under the compensate-sharers policy."""
    world = Warehouse(str(tmp_path / "world.db"))
    world.plant_fault("print_label")
    with tp.RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        cp.setup()
        coordinator = _coordinator(cp, world, policy)
        report = coordinator.run(PARENT, order_inputs())
        scheduled = _log(cp, EventKind.RETRY_SCHEDULED)
        compensated = _log(cp, EventKind.COMPENSATED)
        started = _log(cp, EventKind.AGENT_STARTED)
        notices = {n: _notices(coordinator, n) for n in SUBAGENTS}
        booking = next(e for e in cp.ledger(f"{PARENT}/shipper") if e.tool == "book_carrier")

    assert report.done, report
    _assert_each_effect_once(world, policy)
    assert world.calls("print_label") == 2  # the jammed call, then the printed label
    # Every attempt continued its sub-agent's own thread.
    assert {r.thread_id for r in report.subagents.values()} == {f"{PARENT}/{n}" for n in SUBAGENTS}
    assert len(scheduled) == 1
    decision = dict(scheduled[0].payload)
    assert decision["attribution"]["tool"] == "print_label"
    assert decision["attribution"]["kind"] == "fatal"
    # The shipper's re-run was told what its earlier attempt committed.
    assert len(notices["shipper"]) == 1
    assert "book_carrier" in notices["shipper"][0]
    assert "print_label (fatal)" in notices["shipper"][0]

    if policy == "keep":
        assert decision["rerun"] == ["shipper"]
        assert decision["compensate"] == []
        assert [k["key"] for k in decision["kept"]] == [booking.key]
        assert {n: r.attempts for n, r in report.subagents.items()} == {
            "picker": 1,
            "packer": 1,
            "shipper": 2,
        }
        assert compensated == []
        assert booking.status == "committed"
        assert "kept" in notices["shipper"][0]
        assert notices["picker"] == notices["packer"] == []
        return

    assert decision["rerun"] == ["shipper", "picker", "packer"]
    assert [(u["subagent"], u["tool"]) for u in decision["compensate"]] == [
        ("shipper", "book_carrier"),
        ("picker", "reserve_stock"),
    ]
    assert [k["tool"] for k in decision["kept"]] == ["pack_order"]  # no compensator
    assert {n: r.attempts for n, r in report.subagents.items()} == dict.fromkeys(SUBAGENTS, 2)
    # Undone exactly once each, in the planned order, before any re-run started.
    assert [e.payload["key"] for e in compensated] == [
        world.performed("book_carrier")[0],
        world.performed("reserve_stock")[0],
    ]
    assert booking.status == "compensated"
    reruns = [e for e in started if e.payload["attempt"] == 2]
    assert {e.payload["subagent"] for e in reruns} == set(SUBAGENTS)
    assert min(e.seq for e in reruns) > max(e.seq for e in compensated)
    assert "Undone by the coordinator" in notices["picker"][0]
    assert "reserve_stock" in notices["picker"][0]
    assert "pack_order" in notices["packer"][0]
    assert "Undone" not in notices["packer"][0]


async def test_async_run_reruns_only_what_failed(tmp_path: Path) -> None:
    """``arun`` follows the same rule: under the default policy only the shipper runs
    again, and its booking is not repeated."""
    world = Warehouse(str(tmp_path / "world.db"))
    world.plant_fault("print_label")
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(
        f"sqlite:///{tmp_path / 'runs.db'}"
    ) as acp:
        await acp.setup()
        report = await _coordinator(acp, world, "keep").arun(PARENT, order_inputs())
    assert report.done, report
    assert {n: r.attempts for n, r in report.subagents.items()} == {
        "picker": 1,
        "packer": 1,
        "shipper": 2,
    }
    _assert_each_effect_once(world, "keep")


def _entry(n: int, status: LedgerStatus) -> LedgerEntry:
    now = datetime.now(UTC)
    return LedgerEntry(
        key=f"k{n}",
        thread_id="t",
        tool="reserve_stock",
        status=status,
        args={"order_id": ORDER, "line": n},
        args_digest=f"d{n}",
        attempt=1,
        created_at=now,
        updated_at=now,
        result=f"RES-{n}" + "x" * 500,
    )


def test_rerun_notice_names_what_stands_and_what_was_undone_in_bounded_size() -> None:
    """The notice lists kept and undone effects with their results, a bounded number of
    lines of bounded length; a messages graph gets it as one user message with a stable
    id, any other graph its own input again."""
    kept = [_entry(n, LedgerStatus.COMMITTED) for n in range(50)]
    why = {"subagent": "shipper", "tool": "print_label", "kind": "fatal", "message": "jam"}
    own = rerun_notice(
        "picker", attempt=2, max_attempts=3, why=why, kept=kept, undone=[kept[0]], objects=[ORDER]
    )
    assert "attempt 2 of 3" in own
    assert "Sub-agent 'shipper' failed at print_label (fatal) after changing order-1" in own
    assert "RES-0" in own
    assert "and 30 more" in own
    assert "Undone by the coordinator" in own
    assert len(own) < 20_000
    failed = rerun_notice("shipper", attempt=2, max_attempts=2, why=why, kept=[], undone=[])
    assert failed.startswith("The coordinator runs this task again (attempt 2 of 2). Your")
    assert "kept" not in failed
    message = rerun_input({"messages": []}, own, notice_id("p/picker", 2))["messages"][0]
    assert (message.id, message.name) == ("taskpilots_coordinator:p/picker:2", NOTICE_NAME)
    assert rerun_input({"order": ORDER}, own, "x") == {"order": ORDER}


# --- SIGKILL of the coordinator mid re-run ---------------------------------------------------


def _coordinate_in_child(
    conn: str, world_path: str, policy: str, undo_prechecks: bool = True
) -> None:
    code = 2
    try:
        world = Warehouse(world_path)
        real_submit = _drive.Drive.submit

        def submit(drive: Any, pool: Any, name: str, fn: Any, *args: Any) -> None:
            # The hand-off window: a re-run is recorded in the parent's log, its input not
            # yet handed to the sub-agent's thread.
            if drive.log.attempts(name) > 1:
                world.maybe_die("handoff")
            real_submit(drive, pool, name, fn, *args)

        _drive.Drive.submit = submit  # type: ignore[method-assign,assignment]
        with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
            coordinator = _coordinator(cp, world, policy, ttl=2.0, undo_prechecks=undo_prechecks)
            report = coordinator.run(PARENT, order_inputs())
            code = 0 if report.done else 3
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _fork(*args: Any) -> int:
    # Forked from an interpreter that already imported everything: a coordinator restarts
    # in milliseconds, not the seconds a fresh interpreter takes on a loaded machine.
    proc = multiprocessing.get_context("fork").Process(target=_coordinate_in_child, args=args)
    proc.start()
    proc.join(timeout=120)
    if proc.is_alive():
        proc.kill()
        pytest.fail("coordinator hung")
    assert proc.exitcode is not None
    return proc.exitcode


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["keep", "compensate"])
def test_sigkilled_coordinator_mid_rerun_still_performs_each_effect_once(
    conn_string: str, tmp_path: Path, policy: str
) -> None:
    """The coordinator process is SIGKILLed during the recovery and the re-runs (mid
    undo, between recording a re-run and handing it over, right after a re-run's effect
    before its commit); each time a fresh process continues. The World counts are those of
    an uninterrupted run."""
    with tp.RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        cp.setup()
    world = Warehouse(str(tmp_path / "world.db"))
    world.plant_fault("print_label")
    world.plant_kill("handoff", "before")
    if policy == "keep":
        world.plant_kill("print_label", "after", at_call=2)
        kills = 2
    else:
        world.plant_kill("cancel_booking", "after")
        world.plant_kill("reserve_stock", "after", at_call=2)
        world.plant_kill("book_carrier", "after", at_call=2)
        kills = 4
    args = (conn_string, world.path, policy)

    codes = [_fork(*args) for _ in range(kills)]
    assert codes == [-signal.SIGKILL] * kills
    assert world.pending_kills() == 0
    assert _fork(*args) == 0

    _assert_each_effect_once(world, policy)
    with tp.RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        resumed = _log(cp, EventKind.RUN_RESUMED)
        scheduled = _log(cp, EventKind.RETRY_SCHEDULED)
        started = _log(cp, EventKind.AGENT_STARTED)
        compensated = _log(cp, EventKind.COMPENSATED)
    # One recovery decision, one recorded start per attempt, whatever the kills.
    assert len(scheduled) == 1
    attempts = [(e.payload["subagent"], e.payload["attempt"]) for e in started]
    assert len(attempts) == len(set(attempts))
    # The re-run killed before its hand-off was handed over by the next process.
    assert any(e.payload.get("handoff") for e in resumed)
    if policy == "compensate":
        assert len(compensated) == 2


@pytest.mark.slow
def test_uncertain_undo_stops_the_coordination_for_a_person(tmp_path: Path) -> None:
    """Killed inside a compensator with no undo pre-check: the next coordinator stops with
    ``CompensationUncertain`` before anything re-runs on the order (the compensator is not
    run again blindly); once a person confirms the undo happened, it goes on, and each
    effect and undo still happened once."""
    conn = f"sqlite:///{tmp_path / 'runs.db'}"
    with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
        cp.setup()
    world = Warehouse(str(tmp_path / "world.db"))
    world.plant_fault("print_label")
    world.plant_kill("cancel_booking", "after")
    assert _fork(conn, world.path, "compensate", False) == -signal.SIGKILL

    with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
        coordinator = _coordinator(cp, world, "compensate", ttl=2.0, undo_prechecks=False)
        with pytest.raises(CompensationUncertain) as stopped:
            coordinator.run(PARENT, order_inputs())
        assert stopped.value.effect_key == world.performed("book_carrier")[0]
        assert world.calls("cancel_booking") == 1  # not run again blindly
        assert world.calls("release_stock") == 0  # nothing after it either
        assert len(world.performed("reserve_stock")) == 1  # no re-run started
        # The person checked with the carrier: the booking is cancelled.
        decide_compensation(
            cp, stopped.value.effect_key, tp.Decision(action="provide_result", result="ok")
        )
        report = coordinator.run(PARENT, order_inputs())

    assert report.done, report
    assert world.calls("cancel_booking") == 1
    assert world.calls("release_stock") == 1
    assert world.repeated_keys() == 0
    assert {s: world.active(s) for s in SERVICES} == dict.fromkeys(SERVICES, 1)
