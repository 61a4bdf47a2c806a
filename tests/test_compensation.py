"""Compensation is a side effect: every undo goes through the ledger, and happens once.

The scenario of every test: the agent opens help-desk tickets (``open_ticket``, whose
compensator sends the help desk a cancellation e-mail: *not* idempotent, each call sends one
more), then charges a card (``charge``: it acts, then times out; no pre-check, so the run
stops for a person). The person abandons the run, which undoes the tickets. The simulated
services keep every ticket and e-mail in their own SQLite file, so a cancellation sent twice
is counted.

The crash drills run the agent in worker processes (``tests/_compensation_worker.py``) and
plant a kill point on ``send_email``: the worker is SIGKILLed right after the cancellation
reached the help desk, before the ledger recorded the undo. A fresh process then continues,
for the recovery agent's abandon path, for ``RecoveryMiddleware`` and for the coordinator's
entry point (:func:`~taskpilots_graph.nodes.compensate.compensate_effect`):

* with an undo pre-check (``compensate_precheck=``) the cancellation is found and recorded,
  never sent again;
* without one the undo stops for a person, named in the takeover request (or raised as
  :class:`~taskpilots_graph.ledger.CompensationUncertain` outside a graph); the person's
  answer completes it, still with one cancellation.
"""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import BaseTool, tool

import taskpilots_graph as tp
from taskpilots_graph.demo.services import Services
from taskpilots_graph.errors import ConfigurationError, EffectInProgress, InvalidDecision
from taskpilots_graph.events import EventKind
from taskpilots_graph.leases import thread_lease_name
from taskpilots_graph.ledger import CompensationUncertain, LedgerEntry, LedgerStatus
from taskpilots_graph.locks import default_lease_backend
from taskpilots_graph.nodes._undo import UNDO_OF, is_undo, undo_key
from taskpilots_graph.nodes.compensate import (
    ABANDONED,
    acompensate_effect,
    adecide_compensation,
    compensate_effect,
    decide_compensation,
)
from taskpilots_graph.tools import spec_of

sys.path.insert(0, str(Path(__file__).parent))
from _compensation_worker import CANCEL_TO, cancellations, charge_tool
from _models import PlanModel

WORKER = Path(__file__).parent / "_compensation_worker.py"
THREAD = "t-undo"
UNDO_OPTIONS = {"retry", "skip", "provide_result"}


@pytest.fixture
def services(tmp_path: Path) -> Services:
    return Services(str(tmp_path / "services.db"), latency_s=0)


def _config(thread_id: str = THREAD) -> Any:
    return {"configurable": {"thread_id": thread_id}}


def _effect(cp: Any, thread_id: str, tool_name: str = "open_ticket") -> LedgerEntry:
    (found,) = [e for e in cp.ledger(thread_id) if e.tool == tool_name]
    return found


def _cancelled_total(services: Services) -> int:
    return sum(e["service"] == "send_email" for e in services.effects())


# --- the crash drills: SIGKILL inside the compensator, continue in a fresh process -----------


def _worker(form: str, precheck: str, action: str, db: str, services: Services) -> Any:
    done = subprocess.run(
        [sys.executable, str(WORKER), form, precheck, action, db, services.path, THREAD],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done


def _out(done: Any) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.splitlines()[-1]))


def _killed_inside_compensation(form: str, precheck: str, db: str, services: Services) -> str:
    """Run to the takeover, abandon, and die right after the cancellation reached the desk;
    returns the ticket id."""
    started = _out(_worker(form, precheck, "start", db, services))
    assert [t["uncertain_effects"][0]["tool"] for t in started["takeovers"]] == ["charge"]
    services.plant_kill("send_email", "after")
    killed = _worker(form, precheck, "decide:abandon", db, services)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert services.pending_kills() == 0
    (ticket,) = [e["payload"]["id"] for e in services.effects() if e["service"] == "create_ticket"]
    assert cancellations(services, ticket) == 1  # the undo reached the help desk, then death
    return str(ticket)


def _continue(form: str, precheck: str, db: str, services: Services) -> dict[str, Any]:
    """The fresh process's move. The agent resumes the thread. For the middleware the
    person's abandon was given to a tool task that never finished, so LangGraph still lists
    that takeover as pending (``tp.resume`` refuses): the fresh process answers it again."""
    action = "resume" if form == "agent" else "decide:abandon"
    return _out(_worker(form, precheck, action, db, services))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["agent", "middleware"])
def test_sigkill_inside_compensation_with_undo_precheck_undoes_once(
    form: str, sqlite_path: str, services: Services
) -> None:
    """Killed after the undo reached the service: the fresh process's undo pre-check finds
    it, records it, and never sends a second cancellation; the run ends abandoned."""
    ticket = _killed_inside_compensation(form, "precheck", sqlite_path, services)

    after = _continue(form, "precheck", sqlite_path, services)

    assert after["takeovers"] == []
    assert cancellations(services, ticket) == 1
    assert _cancelled_total(services) == 1
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as cp:
        effect = _effect(cp, THREAD)
        assert effect.status is LedgerStatus.COMPENSATED
        undo = cp.ledger_entry(undo_key(effect.key))
        assert undo is not None
        assert undo.status is LedgerStatus.COMMITTED
        assert undo.extra["reconciled"] == "precheck_done"
        assert undo.extra[UNDO_OF] == effect.key
        compensated = [e for e in cp.events(THREAD) if e.kind is EventKind.COMPENSATED]
        assert [e.payload["key"] for e in compensated] == [effect.key]
        # Settled for good: nothing runs again, nothing is undone twice.
        if form == "agent":
            assert after["stage"] == "closed"
            again = _out(_worker(form, "precheck", "resume", sqlite_path, services))
            assert again["stage"] == "closed"
        else:
            # Abandoned means stopped: the run ends on the library's answer, the model is
            # not asked again (it could otherwise call another tool after the undo).
            assert after["last"].startswith("Stopped: a person abandoned this task")
    assert _cancelled_total(services) == 1


@pytest.mark.slow
@pytest.mark.parametrize("form", ["agent", "middleware"])
def test_sigkill_inside_compensation_without_undo_precheck_stops_for_a_person(
    form: str, sqlite_path: str, services: Services
) -> None:
    """Without an undo pre-check the interrupted undo is not run again: the thread waits on a
    takeover naming the undo; the person's answer completes it, still one cancellation."""
    ticket = _killed_inside_compensation(form, "none", sqlite_path, services)

    after = _continue(form, "none", sqlite_path, services)

    (request,) = after["takeovers"]
    (named,) = request["uncertain_effects"]
    assert named["tool"] == "undo:open_ticket"
    assert named["key"] == f"undo:{named[UNDO_OF]}"
    assert named["effect_tool"] == "open_ticket"
    assert set(request["options"]) == UNDO_OPTIONS
    assert request["failure"]["error_type"] == "taskpilots_graph.ledger.CompensationUncertain"
    assert cancellations(services, ticket) == 1
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as cp:
        effect = _effect(cp, THREAD)
        assert named[UNDO_OF] == effect.key
        assert effect.status is LedgerStatus.COMMITTED  # not undone until someone knows
        undo = cp.ledger_entry(undo_key(effect.key))
        assert undo is not None
        assert undo.status is LedgerStatus.UNCERTAIN
        assert tp.thread_info(cp, THREAD).status == "awaiting_human"

    # Another fresh process: the person confirms the cancellation went out.
    decided = _out(_worker(form, "none", "decide:provide_result", sqlite_path, services))

    assert decided["takeovers"] == []
    assert cancellations(services, ticket) == 1
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as cp:
        effect = _effect(cp, THREAD)
        assert effect.status is LedgerStatus.COMPENSATED
        undo = cp.ledger_entry(undo_key(effect.key))
        assert undo is not None
        assert undo.status is LedgerStatus.COMMITTED
        assert undo.proof["manual"] is True
        assert undo.result == "cancelled by phone"
    if form == "agent":
        assert decided["stage"] == "closed"


@pytest.mark.slow
@pytest.mark.parametrize("precheck", ["precheck", "none"])
def test_sigkill_inside_the_coordinators_compensation(
    precheck: str, sqlite_path: str, services: Services
) -> None:
    """The coordinator's entry point (``compensate_effect`` on behalf of the parent thread),
    killed inside the compensator: called again in a fresh process it finishes the undo with
    the pre-check, or raises CompensationUncertain until a person decides; one cancellation."""
    started = _out(_worker("coordinator", precheck, "start", sqlite_path, services))
    assert started["takeovers"]
    services.plant_kill("send_email", "after")
    killed = _worker("coordinator", precheck, "undo", sqlite_path, services)
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    again = _out(_worker("coordinator", precheck, "undo", sqlite_path, services))

    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as cp:
        effect = _effect(cp, THREAD)
        if precheck == "none":
            assert again == {"uncertain": effect.key, "undo_key": undo_key(effect.key)}
            assert effect.status is LedgerStatus.COMMITTED
            # The undo is the parent's: its ledger holds the undo and shows a person is due.
            (undo,) = cp.ledger(f"{THREAD}/parent")
            assert undo.status is LedgerStatus.UNCERTAIN
            assert tp.thread_info(cp, f"{THREAD}/parent").status == "awaiting_human"
            decide_compensation(cp, effect.key, {"action": "provide_result", "result": "ok"})
            again = _out(_worker("coordinator", precheck, "undo", sqlite_path, services))
        assert again == {"status": "undone", "replayed": True}
        effect = _effect(cp, THREAD)
        assert effect.status is LedgerStatus.COMPENSATED
        (event,) = [e for e in cp.events(THREAD) if e.kind is EventKind.COMPENSATED]
        assert event.payload["by"] == "coordinator"
    assert _out(_worker("coordinator", precheck, "undo", sqlite_path, services)) == {
        "status": "already",
        "replayed": False,
    }
    assert _cancelled_total(services) == 1


# --- in process: the protocol of an undo, sync and async --------------------------------------


@dataclass
class Desk:
    """Tickets and cancellations on the services' SQLite file; a cancellation's reply can
    be lost (``TimeoutError`` after it was sent), and every undo key is remembered."""

    services: Services
    lose_replies: int = 0
    undo_keys: list[str] = field(default_factory=list)

    def cancel(self, key: str, args: dict[str, Any], result: Any) -> str:
        undo = tp.current_invocation().key
        self.undo_keys.append(undo)
        sent = self.services.send_email(f"{result}:cancel", CANCEL_TO, f"cancel {result}", undo)
        if self.lose_replies > 0:
            self.lose_replies -= 1
            raise TimeoutError("the help desk did not answer")
        return sent

    def cancelled(self, key: str, args: dict[str, Any], result: Any) -> tp.Done | tp.NotDone:
        sent = cancellations(self.services, str(result))
        return tp.Done("cancelled", proof=sent) if sent else tp.NotDone()

    def tool(self, *, precheck: bool) -> BaseTool:
        services = self.services

        @tool
        def open_ticket(subject: str) -> str:
            """Open a help-desk ticket."""
            return services.create_ticket(subject, subject, tp.current_invocation().key)

        return tp.side_effect(
            open_ticket,
            compensate=self.cancel,
            compensate_precheck=self.cancelled if precheck else None,
        )


PLAN = [
    ("open_ticket", {"subject": "first"}),
    ("open_ticket", {"subject": "second"}),
    ("charge", {"amount": 5.0}),
]


def _agent(cp: Any, desk: Desk, *, precheck: bool) -> Any:
    tools = [desk.tool(precheck=precheck), charge_tool(desk.services)]
    return tp.create_recovery_agent(PlanModel(plan=PLAN), tools, checkpointer=cp)


def _stopped(cp: Any, desk: Desk, *, precheck: bool) -> Any:
    graph = _agent(cp, desk, precheck=precheck)
    out = graph.invoke({"messages": [HumanMessage("two tickets, then charge")]}, _config())
    assert "__interrupt__" in out
    return graph


def _tickets(cp: Any) -> list[LedgerEntry]:
    return [e for e in cp.ledger(THREAD) if e.tool == "open_ticket"]


def test_spec_refuses_an_undo_precheck_without_compensator() -> None:
    """compensate_precheck= needs compensate=, and must be callable."""

    @tool
    def noop() -> str:
        """Do nothing."""
        return "ok"

    with pytest.raises(ConfigurationError, match="compensate_precheck"):
        tp.side_effect(noop, compensate_precheck=lambda k, a, r: tp.NotDone())
    with pytest.raises(ConfigurationError, match="must be a callable"):
        tp.side_effect(noop, compensate=lambda k, a, r: None, compensate_precheck="yes")  # type: ignore[arg-type]


def test_abandon_runs_each_undo_through_the_ledger(cp: Any, services: Services) -> None:
    """Each undo has its own entry ``undo:<key>`` (intent, then commit) before the effect is
    marked compensated; the compensator sees that key; nothing is undone twice."""
    desk = Desk(services)
    graph = _stopped(cp, desk, precheck=True)
    first, second = _tickets(cp)

    out = tp.decide(graph, THREAD, tp.Decision(action="abandon"))

    assert out["flow"]["stage"] == "closed"
    assert out["flow"]["reason"] == ABANDONED
    assert desk.undo_keys == [undo_key(second.key), undo_key(first.key)]  # newest first
    for effect in (first, second):
        undo = cp.ledger_entry(undo_key(effect.key))
        assert undo is not None
        assert is_undo(undo)
        assert undo.status is LedgerStatus.COMMITTED
        assert undo.attempt == 1
        assert undo.tool == "undo:open_ticket"
        assert undo.thread_id == THREAD
        kinds = [e.kind for e in cp.events(THREAD) if e.payload.get("key") == undo.key]
        assert kinds == [EventKind.TOOL_INVOKED, EventKind.TOOL_SUCCEEDED]
    assert all(e.status is LedgerStatus.COMPENSATED for e in _tickets(cp))
    compensated = [e.payload["key"] for e in cp.events(THREAD) if e.kind is EventKind.COMPENSATED]
    assert compensated == [second.key, first.key]
    tp.resume(graph, THREAD)
    assert _cancelled_total(services) == 2
    assert tp.recovery_metrics(cp).duplicates.duplicates == 0


def test_lost_undo_reply_is_settled_by_the_undo_precheck(cp: Any, services: Services) -> None:
    """A cancellation whose reply was lost is found by the undo pre-check: recorded, never
    sent again, and the run closes."""
    desk = Desk(services, lose_replies=1)
    graph = _stopped(cp, desk, precheck=True)

    out = tp.decide(graph, THREAD, tp.Decision(action="abandon"))

    assert out["flow"]["stage"] == "closed"
    assert _cancelled_total(services) == 2  # one per ticket
    assert len(desk.undo_keys) == 2
    newest = _tickets(cp)[1]
    undo = cp.ledger_entry(undo_key(newest.key))
    assert undo is not None
    assert undo.extra["reconciled"] == "precheck_done"


def test_lost_undo_reply_without_precheck_asks_a_person_and_retry_runs_it_once_more(
    cp: Any, services: Services
) -> None:
    """Without an undo pre-check a lost reply stops for a person (the undo named, only
    retry / skip / provide_result offered); retry runs the compensator exactly once more."""
    desk = Desk(services, lose_replies=1)
    graph = _stopped(cp, desk, precheck=False)

    paused = tp.decide(graph, THREAD, tp.Decision(action="abandon"))

    assert "__interrupt__" in paused
    (request,) = tp.pending_takeovers(cp, thread_ids=[THREAD])
    newest = _tickets(cp)[1]
    assert [u["key"] for u in request.uncertain_effects] == [undo_key(newest.key)]
    assert set(request.options) == UNDO_OPTIONS
    assert "may or may not have happened" in (request.reason or "")
    assert _cancelled_total(services) == 1
    with pytest.raises(InvalidDecision):
        tp.decide(graph, THREAD, tp.Decision(action="abandon"))

    out = tp.decide(graph, THREAD, tp.Decision(action="retry", decided_by="ops"))

    assert out["flow"]["stage"] == "closed"
    assert _cancelled_total(services) == 3  # the person chose a second cancellation
    assert desk.undo_keys.count(undo_key(newest.key)) == 2
    assert all(e.status is LedgerStatus.COMPENSATED for e in _tickets(cp))
    undo = cp.ledger_entry(undo_key(newest.key))
    assert undo is not None
    assert undo.attempt == 2
    decided = [e for e in cp.events(THREAD) if e.kind is EventKind.DECISION_RECORDED]
    assert decided[-1].payload["key"] == undo_key(newest.key)
    assert decided[-1].payload["decided_by"] == "ops"


@pytest.mark.parametrize("first_answer", ["skip", "provide_result"])
def test_answers_to_two_uncertain_undos_reach_the_right_undo(
    cp: Any, services: Services, first_answer: str
) -> None:
    """Two undos lose their replies in one compensation task; the node re-runs from its
    first line after each answer, and each answer still lands on its own undo: the newest
    ticket gets ``first_answer``, the older one the second answer (the opposite one)."""
    desk = Desk(services, lose_replies=2)
    graph = _stopped(cp, desk, precheck=False)
    first, second = _tickets(cp)
    answers = {
        "skip": tp.Decision(action="skip"),
        "provide_result": tp.Decision(action="provide_result", result="called them"),
    }
    second_answer = "skip" if first_answer == "provide_result" else "provide_result"

    tp.decide(graph, THREAD, tp.Decision(action="abandon"))
    (asked,) = tp.pending_takeovers(cp, thread_ids=[THREAD])
    assert asked.uncertain_effects[0]["key"] == undo_key(second.key)
    tp.decide(graph, THREAD, answers[first_answer])
    (asked,) = tp.pending_takeovers(cp, thread_ids=[THREAD])
    assert asked.uncertain_effects[0]["key"] == undo_key(first.key)

    out = tp.decide(graph, THREAD, answers[second_answer])

    assert out["flow"]["stage"] == "closed"
    outcome = {first_answer: second, second_answer: first}
    left, confirmed = outcome["skip"], outcome["provide_result"]
    assert f"left in place by a person: {left.key}" in out["flow"]["reason"]
    assert cp.ledger_entry(left.key).status is LedgerStatus.COMMITTED
    assert cp.ledger_entry(confirmed.key).status is LedgerStatus.COMPENSATED
    assert cp.ledger_entry(undo_key(confirmed.key)).result == "called them"
    assert _cancelled_total(services) == 2  # each sent once, none again
    assert tp.pending_takeovers(cp, thread_ids=[THREAD]) == []


def test_compensate_effect_outside_a_graph_raises_typed_until_decided(
    cp: Any, services: Services
) -> None:
    """Outside a graph an uncertain undo raises CompensationUncertain (typed, picklable,
    naming effect and undo) on every call, without running the compensator again, until
    decide_compensation records a person's answer."""
    desk = Desk(services, lose_replies=1)
    _stopped(cp, desk, precheck=False)
    effect = _tickets(cp)[0]
    spec = spec_of(desk.tool(precheck=False))
    assert spec is not None

    for _ in range(2):
        with pytest.raises(CompensationUncertain) as raised:
            compensate_effect(cp, effect, spec, thread_id="parent", by="coordinator")
    error = pickle.loads(pickle.dumps(raised.value))
    assert (error.effect_key, error.key, error.tool) == (
        effect.key,
        undo_key(effect.key),
        "undo:open_ticket",
    )
    assert isinstance(error, tp.SideEffectUncertain)
    assert _cancelled_total(services) == 1
    with pytest.raises(InvalidDecision):
        decide_compensation(cp, effect.key, "abandon")

    decide_compensation(cp, effect.key, "skip")

    assert compensate_effect(cp, effect, spec, thread_id="parent").status == "left"
    assert cp.ledger_entry(effect.key).status is LedgerStatus.COMMITTED
    assert _cancelled_total(services) == 1
    with pytest.raises(InvalidDecision):
        decide_compensation(cp, effect.key, "retry")  # nothing waits any more


async def test_async_undo_with_coroutine_compensator_and_precheck(
    acp: Any, services: Services
) -> None:
    """Async: a coroutine compensator whose reply is lost is settled by a coroutine undo
    pre-check; a second call finds it compensated."""
    desk = Desk(services, lose_replies=1)
    graph = _agent(acp, desk, precheck=True)
    await graph.ainvoke({"messages": [HumanMessage("two tickets")]}, _config())
    effect = _tickets_async(await acp.aledger(THREAD))[0]

    async def cancel(key: str, args: dict[str, Any], result: Any) -> str:
        return desk.cancel(key, args, result)

    async def cancelled(key: str, args: dict[str, Any], result: Any) -> tp.Done | tp.NotDone:
        return desk.cancelled(key, args, result)

    spec = spec_of(tp.side_effect(desk.tool(precheck=False).tool, compensate=cancel))
    assert spec is not None
    checked = spec_of(
        tp.side_effect(
            desk.tool(precheck=False).tool, compensate=cancel, compensate_precheck=cancelled
        )
    )
    assert checked is not None

    done = await acompensate_effect(acp, effect, checked, by="coordinator")

    assert (done.status, done.replayed) == ("undone", True)
    assert (await acp.aledger_entry(effect.key)).status is LedgerStatus.COMPENSATED
    assert (await acompensate_effect(acp, effect, spec)).status == "already"
    assert _cancelled_total(services) == 1


async def test_async_abandon_asks_about_an_uncertain_undo(acp: Any, services: Services) -> None:
    """Async agent: abandon, a lost undo reply without pre-check stops for a person; the
    answer is applied once (adecide_compensation refuses a second one)."""
    desk = Desk(services, lose_replies=1)
    graph = _agent(acp, desk, precheck=False)
    await graph.ainvoke({"messages": [HumanMessage("two tickets, then charge")]}, _config())

    await tp.adecide(graph, THREAD, tp.Decision(action="abandon"))
    (request,) = await tp.apending_takeovers(acp, thread_ids=[THREAD])
    newest = _tickets_async(await acp.aledger(THREAD))[1]
    assert request.uncertain_effects[0]["key"] == undo_key(newest.key)

    out = await tp.adecide(graph, THREAD, tp.Decision(action="provide_result", result="ok"))

    assert out["flow"]["stage"] == "closed"
    assert _cancelled_total(services) == 2
    with pytest.raises(InvalidDecision):
        await adecide_compensation(acp, newest.key, "retry")


def _tickets_async(entries: list[LedgerEntry]) -> list[LedgerEntry]:
    return [e for e in entries if e.tool == "open_ticket"]


async def test_async_middleware_abandon_asks_about_an_uncertain_undo(
    sqlite_path: str, services: Services
) -> None:
    """RecoveryMiddleware, async: abandon, a lost undo reply without pre-check stops for a
    person naming the undo; provide_result completes it without a second cancellation."""
    from langchain.agents import create_agent

    from taskpilots_graph.middleware import RecoveryMiddleware

    desk = Desk(services, lose_replies=1)
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as acp:
        await acp.setup()
        agent = create_agent(
            PlanModel(plan=PLAN),
            [desk.tool(precheck=False), charge_tool(services)],
            checkpointer=acp,
            middleware=[RecoveryMiddleware(acp)],
        )
        await agent.ainvoke({"messages": [("user", "two tickets, then charge")]}, _config())

        await tp.adecide(agent, THREAD, tp.Decision(action="abandon"))
        (request,) = await tp.apending_takeovers(acp, thread_ids=[THREAD])
        first, second = _tickets_async(await acp.aledger(THREAD))
        assert [u["key"] for u in request.uncertain_effects] == [undo_key(second.key)]
        assert set(request.options) == UNDO_OPTIONS

        out = await tp.adecide(agent, THREAD, tp.Decision(action="provide_result", result="ok"))

        assert str(out["messages"][-1].content).startswith("Stopped: a person abandoned")
        assert (await acp.aledger_entry(first.key)).status is LedgerStatus.COMPENSATED
        assert (await acp.aledger_entry(second.key)).status is LedgerStatus.COMPENSATED
        assert await tp.apending_takeovers(acp, thread_ids=[THREAD]) == []
    assert _cancelled_total(services) == 2


def test_policy_compensate_path_asks_about_an_uncertain_undo(cp: Any, services: Services) -> None:
    """``on_exhausted="compensate"``: the router undoes the tickets through the same ledger
    path; an undo of unknown outcome stops for a person; the run then ends failed, the
    tickets compensated, each cancellation sent once."""
    desk = Desk(services, lose_replies=1)

    @tool
    def lookup(order: str) -> str:
        """Look an order up."""
        raise ConnectionResetError("the order service dropped the connection")

    graph = tp.create_recovery_agent(
        PlanModel(plan=[*PLAN[:2], ("lookup", {"order": "o-1"})]),
        [desk.tool(precheck=False), lookup],
        checkpointer=cp,
        policies={"lookup": tp.ToolPolicy(max_attempts=1, on_exhausted="compensate")},
    )

    paused = graph.invoke({"messages": [HumanMessage("two tickets, then look up")]}, _config())

    assert "__interrupt__" in paused
    (request,) = tp.pending_takeovers(cp, thread_ids=[THREAD])
    newest = _tickets(cp)[-1]
    assert [u["key"] for u in request.uncertain_effects] == [undo_key(newest.key)]

    out = tp.decide(graph, THREAD, tp.Decision(action="provide_result", result="ok"))

    assert out["flow"]["stage"] == "failed"
    assert all(e.status is LedgerStatus.COMPENSATED for e in _tickets(cp))
    assert _cancelled_total(services) == 2


def test_a_live_undo_elsewhere_is_waited_for_never_run_against(cp: Any, services: Services) -> None:
    """An undo intent whose runner still holds its thread lease is in progress elsewhere:
    another caller waits for it and stops with EffectInProgress; nothing runs here."""
    desk = Desk(services)
    _stopped(cp, desk, precheck=True)
    effect = _tickets(cp)[0]
    spec = spec_of(desk.tool(precheck=True))
    assert spec is not None
    now = effect.created_at
    live = LedgerEntry(
        key=undo_key(effect.key),
        thread_id="parent",
        tool="undo:open_ticket",
        status=LedgerStatus.INTENDED,
        args=dict(effect.args),
        args_digest=effect.args_digest,
        attempt=1,
        created_at=now,
        updated_at=now,
        extra={UNDO_OF: effect.key},
    )
    cp.write_ledger(live, expect=None)
    backend = default_lease_backend(cp)
    held = backend.acquire(thread_lease_name("parent"), "elsewhere:1:other-runner", 30.0)
    assert held is not None

    with pytest.raises(EffectInProgress):
        compensate_effect(cp, effect, spec, thread_id="parent", lease_ttl=0.3)

    assert desk.undo_keys == []
    assert cp.ledger_entry(undo_key(effect.key)).status is LedgerStatus.INTENDED
    assert cp.ledger_entry(effect.key).status is LedgerStatus.COMMITTED
    backend.release(held)
    # Its runner gone, the intent is an orphan: the undo pre-check settles it (not sent yet,
    # so the compensator runs, once).
    assert compensate_effect(cp, effect, spec, thread_id="parent").status == "undone"
    assert desk.undo_keys == [undo_key(effect.key)]
