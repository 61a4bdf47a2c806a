"""``RecoveryMiddleware`` gives a langchain ``create_agent`` agent duplicate-free recovery.

The agents are real ``create_agent`` graphs on a real SQLite recovery checkpointer; the
help desk is the simulated services on their own SQLite file, so effects can be counted
after the agent's process is gone. ``tests/_middleware_worker.py`` builds the agents.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import (
    HumanInTheLoopMiddleware,
    ToolRetryMiddleware,
)
from langchain.agents.middleware.tool_error import ToolErrorMiddleware
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.types import Command

import taskpilots_graph as tp
from taskpilots_graph.demo.services import Services
from taskpilots_graph.errors import ConfigurationError, InvalidDecision, ToolWaiting
from taskpilots_graph.events import EventKind
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus, SideEffectUncertain
from taskpilots_graph.middleware import RecoveryMiddleware, check_middleware
from taskpilots_graph.nodes._context import dump_message, messages_digest
from taskpilots_graph.nodes._undo import is_undo
from taskpilots_graph.testing import fake_clock

sys.path.insert(0, str(Path(__file__).parent))
from _middleware_worker import FAST, build_agent, ticket_tool
from _models import PlanModel, ScriptedChatModel
from _slow_puts import slow_puts

WORKER = Path(__file__).parent / "_middleware_worker.py"


@pytest.fixture
def services(tmp_path: Path) -> Services:
    return Services(str(tmp_path / "services.db"), latency_s=0)


@pytest.fixture
def cp(sqlite_path: str) -> Iterator[tp.RecoveryCheckpointer]:
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as saver:
        yield saver


def _config(thread_id: str) -> Any:
    return {"configurable": {"thread_id": thread_id}}


def _tickets(services: Services, identity: str) -> int:
    return sum(
        e["service"] == "create_ticket" and e["identity"] == identity for e in services.effects()
    )


def _kinds(cp: tp.RecoveryCheckpointer, thread_id: str) -> list[str]:
    return [e.kind.value for e in cp.events(thread_id)]


# --- the acceptance test: SIGKILL after the effect, resume in a fresh process -----------------


def _worker(mode: str, action: str, db: str, services: Services, thread_id: str) -> Any:
    return subprocess.run(
        [sys.executable, str(WORKER), mode, action, db, services.path, thread_id],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "expected"), [("recovery", 1), ("retry", 2)])
def test_sigkill_after_effect_then_resume(
    mode: str, expected: int, sqlite_path: str, services: Services
) -> None:
    """Killed right after the ticket is written: RecoveryMiddleware resumes without repeating
    it, ToolRetryMiddleware alone opens it a second time."""
    services.plant_kill("create_ticket", "after")
    started = _worker(mode, "start", sqlite_path, services, "t-kill")
    assert started.returncode == -signal.SIGKILL, started.stderr
    assert services.pending_kills() == 0
    assert _tickets(services, "t-kill") == 1

    resumed = _worker(mode, "resume", sqlite_path, services, "t-kill")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[-1]) == {"type": "ai", "content": "done"}
    assert _tickets(services, "t-kill") == expected
    if mode == "recovery":
        with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as saver:
            (entry,) = saver.ledger("t-kill")
            assert entry.status is LedgerStatus.COMMITTED
            assert entry.extra["reconciled"] == "precheck_done"
            assert entry.result == services.effects()[0]["payload"]["id"]
            assert EventKind.EFFECT_RECONCILED.value in _kinds(saver, "t-kill")


# --- commit, then time out: in process, sync and async ---------------------------------------


@pytest.mark.parametrize(("mode", "expected"), [("recovery", 1), ("retry", 2)])
def test_timeout_after_commit(
    mode: str, expected: int, cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """The ticket is created but the answer times out: the pre-check finds it (once), a
    plain retry creates it again (twice)."""
    agent = build_agent(mode, cp, services)
    out = agent.invoke({"messages": [("user", "t-1")]}, _config("t-1"))
    assert _tickets(services, "t-1") == expected
    answer = next(m for m in out["messages"] if isinstance(m, ToolMessage))
    assert answer.status == "success"
    assert answer.content == services.effects()[0 if mode == "recovery" else 1]["payload"]["id"]


def test_events_record_the_call_as_it_happened(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """The thread's log holds the decision, the intent, the failure and the reconciliation,
    and the failure carries its classification and arguments."""
    build_agent("recovery", cp, services).invoke({"messages": [("user", "t-ev")]}, _config("t-ev"))
    events = cp.events("t-ev")
    # The run's own events open and close the log, as the recovery agent writes them; the
    # call's events in between are checked below.
    assert [e.kind for e in [events[0], *events[-2:]]] == [
        EventKind.AGENT_STARTED,
        EventKind.LLM_DECIDED,
        EventKind.AGENT_FINISHED,
    ]
    events = events[1:-2]
    assert [e.kind for e in events] == [
        EventKind.LLM_DECIDED,
        EventKind.TOOL_INVOKED,
        EventKind.TOOL_FAILED,
        EventKind.EFFECT_RECONCILED,
    ]
    failed = events[2].payload
    assert failed["failure"]["kind"] == "transient"
    assert failed["maybe_sent"] is True
    assert failed["args"] == {"subject": "t-ev"}
    assert events[3].payload["outcome"] == "done"
    key = events[1].payload["key"]
    assert {e.payload["key"] for e in events[1:]} == {key}
    assert events[0].payload["tool_calls"][0]["id"] == events[1].payload["tool_call_id"]


async def test_async_timeout_after_commit(sqlite_path: str, services: Services) -> None:
    """``ainvoke`` on the async checkpointer takes the same path: one ticket, reconciled."""
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as acp:
        agent = build_agent("recovery", acp, services)
        out = await agent.ainvoke({"messages": [("user", "t-a")]}, _config("t-a"))
        assert out["messages"][-1].content == "done"
        assert _tickets(services, "t-a") == 1
        (entry,) = await acp.aledger("t-a")
        assert entry.status is LedgerStatus.COMMITTED
        kinds = [e.kind for e in await acp.aevents("t-a")]
        assert EventKind.EFFECT_RECONCILED in kinds


# --- the pre-check settles an interrupted effect without running the tool ----------------------


def test_precheck_done_skips_reexecution(cp: tp.RecoveryCheckpointer, services: Services) -> None:
    """An intent left by a crashed run whose effect the service has: the tool is not called,
    the entry is committed with the pre-check's proof."""
    calls: list[str] = []

    def find(key: str, args: dict[str, Any]) -> tp.Done | tp.NotDone:
        found = services.find_ticket(key)
        return tp.NotDone() if found is None else tp.Done(found["id"], proof=found)

    @tool
    def book(order: str) -> str:
        """Book an order."""
        calls.append(order)
        return services.create_ticket(order, order, tp.current_invocation().key)

    booked = tp.side_effect(book, precheck=find, key=lambda a: f"book:{a['order']}")
    # What a run killed mid-call leaves behind: the service did it, the ledger says intended.
    ticket = services.create_ticket("o-7", "o-7", "book:o-7")
    stamp = datetime.now(UTC)
    cp.write_ledger(
        LedgerEntry(
            key="book:o-7",
            thread_id="t-old",
            tool="book",
            status=LedgerStatus.INTENDED,
            args={"order": "o-7"},
            args_digest="",
            attempt=1,
            created_at=stamp,
            updated_at=stamp,
        ),
        expect=None,
    )
    agent = create_agent(
        PlanModel(plan=[("book", {"order": "o-7"})]),
        [booked],
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp)],
    )
    out = agent.invoke({"messages": [("user", "book")]}, _config("t-pre"))
    assert calls == []
    assert _tickets(services, "o-7") == 1
    assert out["messages"][2].content == ticket
    entry = cp.ledger_entry("book:o-7")
    assert entry is not None
    assert entry.status is LedgerStatus.COMMITTED
    assert entry.proof["id"] == ticket
    reconciled = [e for e in cp.events("t-pre") if e.kind is EventKind.EFFECT_RECONCILED]
    assert [e.payload["outcome"] for e in reconciled] == ["done"]


# --- takeover: an effect nobody can confirm stops for a person --------------------------------


def test_uncertain_effect_waits_for_a_person(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """Without a pre-check the timed-out ticket is uncertain: the run pauses on interrupt()
    with a takeover request naming it; the person's result is committed and the run ends,
    with the ticket opened once."""
    agent = create_agent(
        PlanModel(plan=[("open_ticket", {"subject": "$msg"})]),
        [ticket_tool(services, precheck=False)],
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp, default_policy=FAST)],
    )
    out = agent.invoke({"messages": [("user", "t-h")]}, _config("t-h"))
    assert "__interrupt__" in out
    (request,) = tp.pending_takeovers(cp, thread_ids=["t-h"])
    assert request.failure is not None
    assert request.failure["kind"] == "side_effect_uncertain"
    (uncertain,) = request.uncertain_effects
    assert uncertain["tool"] == "open_ticket"
    assert request.pending[0]["key"] == uncertain["key"]
    assert set(request.options) == {"retry", "skip", "provide_result", "edit_args", "abandon"}
    assert cp.ledger("t-h")[0].status is LedgerStatus.UNCERTAIN

    ticket = services.effects()[0]["payload"]["id"]
    done = tp.decide(agent, "t-h", tp.Decision(action="provide_result", result=ticket))
    assert done["messages"][-1].content == "done"
    assert done["messages"][-2].content == ticket
    assert _tickets(services, "t-h") == 1
    (entry,) = cp.ledger("t-h")
    assert entry.status is LedgerStatus.COMMITTED
    assert entry.proof["manual"] is True
    kinds = _kinds(cp, "t-h")
    assert kinds.count(EventKind.TAKEOVER_REQUESTED.value) == 1
    assert kinds.count(EventKind.DECISION_RECORDED.value) == 1
    assert tp.pending_takeovers(cp, thread_ids=["t-h"]) == []


def _ticket_agent(
    cp: tp.RecoveryCheckpointer, services: Services, *, times_out: Callable[[str], bool]
) -> Any:
    """A ``create_agent`` graph under ``RecoveryMiddleware`` whose one side effect writes the
    ticket and then, for the subjects ``times_out`` picks, times out (outcome uncertain)."""

    @tool
    def open_ticket(subject: str) -> str:
        """Open a help-desk ticket."""
        ticket = services.create_ticket(subject, subject, tp.current_invocation().key)
        if times_out(subject):
            raise TimeoutError("the help desk did not answer in time")
        return ticket

    return create_agent(
        PlanModel(plan=[("open_ticket", {"subject": "$msg"})]),
        [tp.side_effect(open_ticket)],
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp, default_policy=FAST)],
    )


def test_retry_decision_is_applied_once(cp: tp.RecoveryCheckpointer, services: Services) -> None:
    """A person approves one retry; when that retry is uncertain again the run asks again,
    and the second answer (skip) does not re-apply the first (no third ticket)."""

    agent = _ticket_agent(cp, services, times_out=lambda subject: True)
    agent.invoke({"messages": [("user", "t-r")]}, _config("t-r"))
    assert _tickets(services, "t-r") == 1
    second = tp.decide(agent, "t-r", tp.Decision(action="retry"))
    assert "__interrupt__" in second
    assert _tickets(services, "t-r") == 2  # the approved retry ran, once
    done = tp.decide(agent, "t-r", tp.Decision(action="skip"))
    assert done["messages"][-1].content == "done"
    assert done["messages"][-2].status == "error"
    assert _tickets(services, "t-r") == 2
    decisions = [e for e in cp.events("t-r") if e.kind is EventKind.DECISION_RECORDED]
    assert [e.payload["decision"]["action"] for e in decisions] == ["retry", "skip"]


def test_abandon_compensates_committed_effects(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """Abandon: the thread's committed effects are undone newest first, the uncertain one is
    left as it is, and the model is told to stop."""
    undone: list[str] = []

    @tool
    def tag(customer: str) -> str:
        """Tag a customer."""
        return services.crm_tag(customer, "vip", tp.current_invocation().key)

    tagged = tp.side_effect(tag, idempotent=True, compensate=lambda k, a, r: undone.append(k))
    agent = create_agent(
        PlanModel(plan=[("tag", {"customer": "c-1"}), ("open_ticket", {"subject": "$msg"})]),
        [tagged, ticket_tool(services, precheck=False)],
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp, default_policy=FAST)],
    )
    agent.invoke({"messages": [("user", "t-x")]}, _config("t-x"))
    done = tp.decide(agent, "t-x", tp.Decision(action="abandon"))
    # The undo has an entry of its own (``undo:<key>``): compensation is a side effect too.
    tag_entry, ticket_entry = [e for e in cp.ledger("t-x") if not is_undo(e)]
    assert undone == [tag_entry.key]
    assert tag_entry.status is LedgerStatus.COMPENSATED
    assert ticket_entry.status is LedgerStatus.UNCERTAIN
    assert done["messages"][-2].content.startswith("Abandoned by a person")
    assert EventKind.COMPENSATED.value in _kinds(cp, "t-x")


def test_abandon_through_stream_ends_the_run_and_the_same_answer_again_changes_nothing(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """Abandon answered through LangGraph's own ``stream(Command(resume=...))``: the undo runs
    once, the model is not asked again (the run ends on the library's stop message, not the
    model's "done"), and streaming the same answer again undoes nothing more."""
    undone: list[str] = []

    @tool
    def tag(customer: str) -> str:
        """Tag a customer."""
        return services.crm_tag(customer, "vip", tp.current_invocation().key)

    tagged = tp.side_effect(tag, idempotent=True, compensate=lambda k, a, r: undone.append(k))
    agent = create_agent(
        PlanModel(plan=[("tag", {"customer": "c-1"}), ("open_ticket", {"subject": "$msg"})]),
        [tagged, ticket_tool(services, precheck=False)],
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp, default_policy=FAST)],
    )
    paused = agent.invoke({"messages": [("user", "t-s")]}, _config("t-s"))
    (pending,) = paused["__interrupt__"]
    answer = Command(resume={pending.id: {"action": "abandon"}})
    for _ in range(2):  # the same command, run twice
        for _ in agent.stream(answer, _config("t-s")):
            pass
    messages = agent.get_state(_config("t-s")).values["messages"]
    assert str(messages[-1].content).startswith("Stopped: a person abandoned this task")
    assert not any(m.type == "ai" and m.content == "done" for m in messages)
    assert len(undone) == 1
    finished = [e for e in cp.events("t-s") if e.kind is EventKind.AGENT_FINISHED]
    assert [e.payload.get("reason") for e in finished] == ["abandoned by a person"]


def test_edit_args_runs_under_a_new_key(cp: tp.RecoveryCheckpointer, services: Services) -> None:
    """edit_args (answered with Command(resume=...)): the old key is closed for good and the
    call runs with the new arguments under a new key."""

    agent = _ticket_agent(cp, services, times_out=lambda subject: subject == "t-e")
    paused = agent.invoke({"messages": [("user", "t-e")]}, _config("t-e"))
    (pending,) = paused["__interrupt__"]
    answer = {"action": "edit_args", "args": {"subject": "t-e2"}}
    done = agent.invoke(Command(resume={pending.id: answer}), _config("t-e"))
    assert done["messages"][-1].content == "done"
    old, new = cp.ledger("t-e")
    assert old.status is LedgerStatus.FAILED
    assert old.error is not None
    assert old.error["type"] == "superseded"
    assert (new.status, dict(new.args)) == (LedgerStatus.COMMITTED, {"subject": "t-e2"})
    assert [_tickets(services, "t-e"), _tickets(services, "t-e2")] == [1, 1]


# --- policies: retries with backoff, long waits, contract errors ------------------------------


def test_pure_tool_retried_with_backoff(cp: tp.RecoveryCheckpointer) -> None:
    """A transient failure of a pure tool is retried in place with the policy's backoff."""
    failures = [ConnectionResetError("reset"), ConnectionResetError("reset")]

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        if failures:
            raise failures.pop()
        return f"found {q}"

    policy = tp.ToolPolicy(max_attempts=3, backoff=tp.Backoff(initial=2.0, jitter=False))
    agent = create_agent(
        PlanModel(plan=[("lookup", {"q": "x"})]),
        [lookup],
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp, policies={"lookup": policy})],
    )
    with fake_clock() as clock:
        out = agent.invoke({"messages": [("user", "go")]}, _config("t-p"))
    assert out["messages"][2].content == "found x"
    assert clock.slept == [2.0, 4.0]
    retries = [e for e in cp.events("t-p") if e.kind is EventKind.RETRY_SCHEDULED]
    assert [e.payload["failure_kind"] for e in retries] == ["transient", "transient"]


def test_long_wait_stops_the_run_until_resume(cp: tp.RecoveryCheckpointer) -> None:
    """A wait beyond ``max_in_process_wait`` ends the run with ToolWaiting; resume continues."""
    failures = [TimeoutError("slow")]

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        if failures:
            raise failures.pop()
        return "ok"

    policy = tp.ToolPolicy(
        backoff=tp.Backoff(initial=120.0, jitter=False), max_in_process_wait=30.0
    )
    agent = create_agent(
        PlanModel(plan=[("lookup", {"q": "x"})]),
        [lookup],
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp, default_policy=policy)],
    )
    with pytest.raises(ToolWaiting) as waiting:
        agent.invoke({"messages": [("user", "go")]}, _config("t-w"))
    assert waiting.value.thread_id == "t-w"
    out = tp.resume(agent, "t-w")
    assert out["messages"][-1].content == "done"
    assert out["messages"][-2].content == "ok"


def test_fatal_failure_fails_the_run(cp: tp.RecoveryCheckpointer) -> None:
    """A failure classified FATAL is not retried: the run fails with the tool's error."""
    calls: list[int] = []

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        calls.append(1)
        raise NotImplementedError("no such feature")

    agent = create_agent(
        PlanModel(plan=[("lookup", {"q": "x"})]),
        [lookup],
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp, default_policy=FAST)],
    )
    with pytest.raises(NotImplementedError):
        agent.invoke({"messages": [("user", "go")]}, _config("t-f"))
    assert calls == [1]


# --- one retry owner -------------------------------------------------------------------------


def test_two_retry_owners_refused_at_build(cp: tp.RecoveryCheckpointer, services: Services) -> None:
    """RecoveryMiddleware and ToolRetryMiddleware both retrying a tool: ``create_agent``
    raises a clear error, whichever comes first in the list."""
    for order in ("recovery-first", "retry-first"):
        layers: list[Any] = [RecoveryMiddleware(cp), ToolRetryMiddleware(max_retries=2)]
        if order == "retry-first":
            layers.reverse()
        with pytest.raises(ConfigurationError, match="one layer owns retries"):
            create_agent(
                PlanModel(plan=[("open_ticket", {"subject": "$msg"})]),
                [ticket_tool(services)],
                checkpointer=cp,
                middleware=layers,
            )


@pytest.fixture
def no_build_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the build-time check, to exercise the one made at the first call."""
    monkeypatch.setattr(RecoveryMiddleware, "tools", [])


def _conflicting(cp: Any, services: Services) -> Any:
    return create_agent(
        PlanModel(plan=[("open_ticket", {"subject": "$msg"})]),
        [ticket_tool(services)],
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp), ToolRetryMiddleware(max_retries=2)],
    )


@pytest.mark.usefixtures("no_build_check")
def test_two_retry_owners_refused_on_first_call(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """Without the build-time check, the first call finds the stack and refuses it before
    the tool runs."""
    agent = _conflicting(cp, services)
    with pytest.raises(ConfigurationError, match="one layer owns retries"):
        agent.invoke({"messages": [("user", "t")]}, _config("t"))
    assert services.effects() == []


@pytest.mark.usefixtures("no_build_check")
async def test_two_retry_owners_refused_on_first_async_call(
    sqlite_path: str, services: Services
) -> None:
    """The async path runs the same first-call check."""
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as acp:
        agent = _conflicting(acp, services)
        with pytest.raises(ConfigurationError, match="one layer owns retries"):
            await agent.ainvoke({"messages": [("user", "t")]}, _config("t"))
    assert services.effects() == []


def test_check_middleware_at_build(cp: tp.RecoveryCheckpointer, services: Services) -> None:
    """The build-time check: conflicts named, compatible stacks accepted."""
    tools = [ticket_tool(services)]
    single = {"open_ticket": tp.ToolPolicy(max_attempts=1)}
    with pytest.raises(ConfigurationError, match="both RecoveryMiddleware and ToolRetry"):
        check_middleware([RecoveryMiddleware(cp), ToolRetryMiddleware()], tools)
    with pytest.raises(ConfigurationError, match="both RecoveryMiddleware and ToolRetry"):
        check_middleware([ToolRetryMiddleware(), RecoveryMiddleware(cp)])  # tools unknown
    # Retries of the side effect inside one ledger attempt, even with our retries off.
    with pytest.raises(ConfigurationError, match="inside one ledger attempt"):
        check_middleware([RecoveryMiddleware(cp, policies=single), ToolRetryMiddleware()], tools)
    with pytest.raises(ConfigurationError, match="ToolErrorMiddleware"):
        check_middleware([RecoveryMiddleware(cp), ToolErrorMiddleware(on_error=str)], tools)
    with pytest.raises(ConfigurationError, match="more than once"):
        check_middleware([RecoveryMiddleware(cp), RecoveryMiddleware(cp)], tools)
    # Accepted: ToolRetryMiddleware outside, owning a tool RecoveryMiddleware does not retry;
    # a ToolRetryMiddleware limited to another tool; human-in-the-loop; error messages outside.
    check_middleware([ToolRetryMiddleware(), RecoveryMiddleware(cp, policies=single)], tools)
    check_middleware([RecoveryMiddleware(cp), ToolRetryMiddleware(tools=["kb_search"])], tools)
    check_middleware(
        [
            ToolErrorMiddleware(on_error=str),
            HumanInTheLoopMiddleware(interrupt_on={"open_ticket": True}),
            RecoveryMiddleware(cp),
        ],
        tools,
    )


def test_outer_tool_retry_goes_through_the_ledger(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """ToolRetryMiddleware placed first may own the retries of a tool RecoveryMiddleware does
    not retry: each of its retries passes through the ledger (same key, next attempt), and
    an effect of unknown outcome still goes to a person instead of being retried."""
    refusals = [ConnectionRefusedError("help desk down")]

    @tool
    def open_ticket(subject: str) -> str:
        """Open a help-desk ticket."""
        if refusals:
            raise refusals.pop()  # refused before anything was sent
        services.create_ticket(subject, subject, tp.current_invocation().key)
        if subject == "t-unsure":
            raise TimeoutError("the help desk did not answer in time")
        return "ticket"

    no_retry = tp.ToolPolicy(max_attempts=1, on_exhausted="fail")
    agent = create_agent(
        PlanModel(plan=[("open_ticket", {"subject": "$msg"})]),
        [tp.side_effect(open_ticket)],
        checkpointer=cp,
        middleware=[
            ToolRetryMiddleware(max_retries=2, initial_delay=0, jitter=False),
            RecoveryMiddleware(cp, default_policy=no_retry),
        ],
    )
    out = agent.invoke({"messages": [("user", "t-o")]}, _config("t-o"))
    assert out["messages"][2].content == "ticket"
    (entry,) = cp.ledger("t-o")
    assert (entry.status, entry.attempt) == (LedgerStatus.COMMITTED, 2)
    assert _tickets(services, "t-o") == 1

    paused = agent.invoke({"messages": [("user", "t-unsure")]}, _config("t-unsure"))
    assert "__interrupt__" in paused
    assert _tickets(services, "t-unsure") == 1
    assert cp.ledger("t-unsure")[0].status is LedgerStatus.UNCERTAIN


def test_requires_recovery_checkpointer() -> None:
    """A plain LangGraph saver is refused with the fix in the message."""
    from langgraph.checkpoint.memory import InMemorySaver

    with pytest.raises(ConfigurationError, match="RecoveryCheckpointer"):
        RecoveryMiddleware(InMemorySaver())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="ToolPolicy"):
        RecoveryMiddleware(
            tp.RecoveryCheckpointer(InMemorySaver()),
            policies={"x": 3},  # type: ignore[dict-item]
        )


def test_uncertain_is_a_typed_error_class() -> None:
    """The escalation error is the library's typed one (what tp.decide reports on)."""
    assert issubclass(SideEffectUncertain, tp.TaskPilotsError)


# --- model decisions, human-in-the-loop ------------------------------------------------------


def test_recorded_decision_is_replayed(cp: tp.RecoveryCheckpointer, services: Services) -> None:
    """A decision recorded for exactly this conversation (by a run whose checkpoint was lost)
    is replayed instead of asking the model: same tool-call id, hence the same ledger key."""
    recorded = AIMessage(
        "", tool_calls=[{"name": "open_ticket", "args": {"subject": "t-d"}, "id": "call_old"}]
    )
    cp.record_decision("t-d", "", messages_digest([HumanMessage("t-d")]), dump_message(recorded))
    model = PlanModel(plan=[("open_ticket", {"subject": "$msg"})])
    agent = create_agent(
        model,
        [ticket_tool(services)],
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp, default_policy=FAST)],
    )
    out = agent.invoke({"messages": [("user", "t-d")]}, _config("t-d"))
    assert out["messages"][1].tool_calls[0]["id"] == "call_old"
    assert len(model.inputs) == 1  # asked only after the tool answered
    assert cp.ledger("t-d")[0].tool_call_id == "call_old"
    decided = [e for e in cp.events("t-d") if e.kind is EventKind.LLM_DECIDED]
    assert decided[0].payload["replayed"] is True


def test_side_effect_decision_recorded_before_the_call(
    cp: tp.RecoveryCheckpointer, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under "async" durability, with the checkpoint not on disk in time, the model's message
    is recorded before its side effect runs; under "sync" (checkpoint already durable) it is
    not."""
    slow_puts(monkeypatch, cp)
    agent = build_agent("recovery", cp, services)
    agent.invoke({"messages": [("user", "t-s")]}, _config("t-s"))
    digest = messages_digest([HumanMessage("t-s")])
    assert cp.decision("t-s", "", digest) is not None
    agent.invoke({"messages": [("user", "t-y")]}, _config("t-y"), durability="sync")
    assert cp.decision("t-y", "", messages_digest([HumanMessage("t-y")])) is None


class _TwoTicketsAtOnce(ScriptedChatModel):
    """Asks for two tickets in one message (parallel tool calls), then answers."""

    def decide(self, messages: list[BaseMessage]) -> AIMessage:
        if any(isinstance(m, ToolMessage) for m in messages):
            return AIMessage("done")
        calls = [{"name": "open_ticket", "args": {"subject": s}, "id": f"call_{s}"} for s in "ab"]
        return AIMessage("", tool_calls=calls)


def _two_ticket_agent(cp: Any, services: Services, sqlite_path: str, seen: list[int]) -> Any:
    """A ``create_agent`` graph asking for two tickets at once; each call notes how many
    decisions another connection sees on disk as it runs."""

    @tool
    def open_ticket(subject: str) -> str:
        """Open a help-desk ticket."""
        with closing(sqlite3.connect(sqlite_path)) as lite:
            (count,) = lite.execute("SELECT COUNT(*) FROM taskpilots_decisions").fetchone()
        seen.append(int(count))
        return services.create_ticket(subject, subject, tp.current_invocation().key)

    return create_agent(
        _TwoTicketsAtOnce(),
        [tp.side_effect(open_ticket)],
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp, default_policy=FAST)],
    )


def test_parallel_side_effects_each_find_the_decision_on_disk(
    cp: tp.RecoveryCheckpointer,
    services: Services,
    sqlite_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two side effects of one model message run in parallel; neither may run before the
    message is on disk, even while the other call is still writing it (slowed down here,
    with the checkpoint holding the message late too)."""
    slow_puts(monkeypatch, cp)
    record = cp.record_decision

    def slow_record(*args: Any) -> None:
        time.sleep(0.3)
        record(*args)

    monkeypatch.setattr(cp, "record_decision", slow_record)
    seen: list[int] = []
    agent = _two_ticket_agent(cp, services, sqlite_path, seen)
    agent.invoke({"messages": [("user", "two tickets")]}, _config("t-par"))

    assert len(seen) == 2
    assert min(seen) == 1  # each call found the decision already recorded


async def test_async_parallel_side_effects_each_find_the_decision_on_disk(
    services: Services, sqlite_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async form of the test above: the two calls run as concurrent tasks."""
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as acp:
        slow_puts(monkeypatch, acp)
        record = acp.arecord_decision

        async def slow_record(*args: Any) -> None:
            await asyncio.sleep(0.3)
            await record(*args)

        monkeypatch.setattr(acp, "arecord_decision", slow_record)
        seen: list[int] = []
        agent = _two_ticket_agent(acp, services, sqlite_path, seen)
        await agent.ainvoke({"messages": [("user", "two tickets")]}, _config("t-apar"))

    assert len(seen) == 2
    assert min(seen) == 1


def test_human_in_the_loop_composes(cp: tp.RecoveryCheckpointer, services: Services) -> None:
    """HumanInTheLoopMiddleware asks before the call; the approved call then runs through the
    ledger (its timeout reconciled by the pre-check): one ticket."""
    agent = create_agent(
        PlanModel(plan=[("open_ticket", {"subject": "$msg"})]),
        [ticket_tool(services)],
        checkpointer=cp,
        middleware=[
            HumanInTheLoopMiddleware(interrupt_on={"open_ticket": True}),
            RecoveryMiddleware(cp, default_policy=FAST),
        ],
    )
    asked = agent.invoke({"messages": [("user", "t-hitl")]}, _config("t-hitl"))
    assert "__interrupt__" in asked
    assert services.effects() == []
    assert tp.pending_takeovers(cp, thread_ids=["t-hitl"]) == []  # not a recovery takeover
    done = agent.invoke(Command(resume={"decisions": [{"type": "approve"}]}), _config("t-hitl"))
    assert done["messages"][-1].content == "done"
    assert _tickets(services, "t-hitl") == 1
    assert cp.ledger("t-hitl")[0].status is LedgerStatus.COMMITTED


def test_decide_edit_args_on_a_create_agent_graph(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """tp.decide answers the middleware's takeover too: the graph has no step layer, so the
    middleware checks the decision itself when it resumes."""

    agent = _ticket_agent(cp, services, times_out=lambda subject: subject == "t-d")
    agent.invoke({"messages": [("user", "t-d")]}, _config("t-d"))
    tp.decide(agent, "t-d", tp.Decision(action="edit_args", args={"subject": "t-d2"}))
    final = agent.get_state(_config("t-d")).values["messages"][-1]
    assert final.content == "done"
    assert [_tickets(services, "t-d"), _tickets(services, "t-d2")] == [1, 1]


def test_decide_refuses_an_action_the_takeover_does_not_offer(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """accept answers only a drifted result: refused before anything resumes."""

    agent = _ticket_agent(cp, services, times_out=lambda subject: True)
    agent.invoke({"messages": [("user", "t-a")]}, _config("t-a"))
    with pytest.raises(InvalidDecision, match="not an option"):
        tp.decide(agent, "t-a", tp.Decision(action="accept"))
    assert [r.thread_id for r in tp.pending_takeovers(cp, thread_ids=["t-a"])] == ["t-a"]
    assert _tickets(services, "t-a") == 1
