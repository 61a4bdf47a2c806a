"""Unfinished work first: new input on a thread that stopped mid-work (issue 16, items 1, 2, 6).

A travel desk (``_travel``: its own SQLite file, outside the agent's process and database)
books flights and hotels; a scripted model decides only from the messages it receives. The
crash drills SIGKILL a forked worker right after a booking is written and before the
library records it; then the person runs *the same command again* (``tp.run`` with the
original input) instead of ``tp.resume``, in every durability mode. Each booking must be
made once, no ledger entry left ``intended``, and every conversation the model receives
valid (each tool call answered exactly once before the next human or AI message).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import signal
import sys
import traceback
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

import taskpilots_graph as tp
from taskpilots_graph import testing
from taskpilots_graph.conversation import NO_ANSWER, valid_conversation
from taskpilots_graph.errors import ThreadNotFound, ToolWaiting
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus, args_digest
from taskpilots_graph.middleware import RecoveryMiddleware
from taskpilots_graph.window import MemoryWindow

sys.path.insert(0, str(Path(__file__).parent))
from _travel import (
    REQUEST,
    TRIP,
    RateLimited,
    TravelDesk,
    TravelModel,
    assert_valid_conversation,
    travel_tools,
)

DURABILITIES = ["async", "sync", "exit"]
START = {"messages": [("user", REQUEST)]}


@pytest.fixture
def desk(tmp_path: Path) -> TravelDesk:
    return TravelDesk(str(tmp_path / "travel.db"))


BUDGET_ENV = "TRAVEL_ONE_TURN_BUDGET"  # set in a worker too: build with ONE_TURN


def turns_in_view(messages: Sequence[BaseMessage]) -> int:
    """A token counter under which only model turns cost: a budget of 1 shows the latest
    turn whole and every earlier one as a folded line, whatever the prompts' sizes."""
    return sum(isinstance(m, AIMessage) and bool(m.tool_calls) for m in messages)


ONE_TURN = MemoryWindow(max_tokens=1, token_counter=turns_in_view)


def build(cp: Any, desk: TravelDesk, model: TravelModel, **kwargs: Any) -> Any:
    # By default the model reads the whole trip; a test may set a context budget instead.
    # A short lease: the killed worker's thread lease lapses quickly, and the next runner
    # waits for it (wait=True) instead of failing with ThreadBusy.
    if os.environ.get(BUDGET_ENV):
        kwargs.setdefault("memory_window", ONE_TURN)
    return tp.create_recovery_agent(
        model, travel_tools(desk), checkpointer=cp, lease_ttl=1.0, **kwargs
    )


def unsettled(cp: Any, thread_id: str) -> list[LedgerEntry]:
    return [
        e
        for e in cp.ledger(thread_id)
        if e.status in (LedgerStatus.INTENDED, LedgerStatus.UNCERTAIN)
    ]


def assert_all_valid(model: TravelModel) -> None:
    assert model.inputs, "the model was never asked"
    for conversation in model.inputs:
        assert_valid_conversation(conversation)


# -- the crash drill: the same command run again ------------------------------------------------


def _first_run(conn: str, desk_path: str, thread_id: str, durability: str) -> None:
    """A worker that runs the trip and is SIGKILLed by the desk's kill point."""
    code = 2
    try:
        with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
            cp.setup()
            graph = build(cp, TravelDesk(desk_path), TravelModel(plan=TRIP))
            tp.run(graph, thread_id, START, durability=durability)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def crash(conn: str, desk: TravelDesk, thread_id: str, durability: str, service: str) -> None:
    """Run the trip in a forked worker killed right after ``service``'s booking is made."""
    desk.plant_kill(service)
    worker = multiprocessing.get_context("fork").Process(
        target=_first_run, args=(conn, desk.path, thread_id, durability)
    )
    worker.start()
    worker.join(120)
    assert worker.exitcode == -signal.SIGKILL, f"the worker was not killed: {worker.exitcode}"
    assert desk.pending_kills() == 0
    assert desk.counts().get(service) == 1


@pytest.mark.parametrize("service", ["book_flight", "book_hotel"])
@pytest.mark.parametrize("durability", DURABILITIES)
def test_the_same_command_after_a_kill_books_each_item_once(
    conn_string: str, desk: TravelDesk, durability: str, service: str
) -> None:
    thread_id = f"trip-{durability}-{service}"
    crash(conn_string, desk, thread_id, durability, service)

    with tp.RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        model = TravelModel(plan=TRIP)
        graph = build(cp, desk, model)
        out = tp.run(graph, thread_id, START, durability=durability, wait=True)

        assert desk.counts() == {"book_flight": 1, "book_hotel": 1}
        assert unsettled(cp, thread_id) == []
        assert {e.tool for e in cp.ledger(thread_id)} == {"book_flight", "book_hotel"}
        assert all(e.status is LedgerStatus.COMMITTED for e in cp.ledger(thread_id))
        assert_all_valid(model)
        assert out["messages"][-1].content == "Your trip is booked."
        # The model was told the truth: the killed booking's confirmation, not a new one.
        answers = [m for m in out["messages"] if isinstance(m, ToolMessage) and m.name == service]
        assert answers
        assert all(m.status != "error" for m in answers)
        info = tp.thread_info(cp, thread_id)
        assert info.status == "closed"
        metrics = tp.recovery_metrics(cp, thread_ids=[thread_id])
        assert metrics.duplicates.duplicates == 0


@pytest.mark.parametrize("durability", ["async", "exit"])
def test_the_same_command_after_a_kill_under_a_small_context_budget(
    conn_string: str, desk: TravelDesk, durability: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget so small that only the latest turn stays in view: nothing is booked twice."""
    monkeypatch.setenv(BUDGET_ENV, "1")
    thread_id = f"trip-window-{durability}"
    crash(conn_string, desk, thread_id, durability, "book_hotel")
    with tp.RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        model = TravelModel(plan=TRIP)
        tp.run(build(cp, desk, model), thread_id, START, durability=durability, wait=True)
        assert desk.counts() == {"book_flight": 1, "book_hotel": 1}
        assert unsettled(cp, thread_id) == []
        assert_all_valid(model)
        # The budget did fold: some input carried earlier turns as lines, not messages.
        assert any(
            isinstance(m, SystemMessage) and "folded out of the conversation" in str(m.content)
            for shown in model.inputs
            for m in shown
        )


@pytest.mark.parametrize("service", ["book_flight", "book_hotel"])
def test_exit_durability_kill_then_resume_then_the_same_command(
    conn_string: str, desk: TravelDesk, service: str
) -> None:
    thread_id = f"trip-exit-resume-{service}"
    crash(conn_string, desk, thread_id, "exit", service)

    with tp.RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        assert cp.get_tuple({"configurable": {"thread_id": thread_id}}) is None
        assert [e.tool for e in cp.ledger(thread_id) if e.status is LedgerStatus.INTENDED] == [
            service
        ]
        info = tp.thread_info(cp, thread_id)
        assert info.status != "closed"
        assert info.unsettled_effects == 1
        assert tp.recovery_metrics(cp, thread_ids=[thread_id]).unreconciled_intents == 1

        model = TravelModel(plan=TRIP)
        graph = build(cp, desk, model)
        # No checkpoint, but the ledger knows the thread: resume reconciles, never raises
        # ThreadNotFound, and performs nothing.
        assert tp.resume(graph, thread_id, wait=True) == {}
        assert unsettled(cp, thread_id) == []
        assert model.inputs == []
        assert desk.counts()[service] == 1
        assert tp.recovery_metrics(cp, thread_ids=[thread_id]).unreconciled_intents == 0

        out = tp.run(graph, thread_id, START, durability="exit")
        assert desk.counts() == {"book_flight": 1, "book_hotel": 1}
        assert unsettled(cp, thread_id) == []
        assert_all_valid(model)
        assert out["messages"][-1].content == "Your trip is booked."


# -- a ledger-only thread: each outcome of the pre-check ------------------------------------


def _intent(thread_id: str, tool: str, args: dict[str, Any], key: str) -> LedgerEntry:
    now = datetime.now(UTC)
    return LedgerEntry(
        key=key,
        thread_id=thread_id,
        tool=tool,
        status=LedgerStatus.INTENDED,
        args=args,
        args_digest=args_digest(args),
        attempt=1,
        created_at=now,
        updated_at=now,
        tool_call_id="call_lost",
    )


def test_resume_of_a_ledger_only_thread_settles_not_done_and_names_the_uncertain(
    cp: Any, desk: TravelDesk
) -> None:
    thread_id = "trip-ledger-only"
    flight = _intent(thread_id, "book_flight", dict(TRIP[0][1]), "book_flight:never-sent")
    cp.write_ledger(flight, expect=None)
    graph = build(cp, desk, TravelModel(plan=TRIP))

    assert tp.resume(graph, thread_id) == {}
    (entry,) = cp.ledger(thread_id)
    assert entry.status is LedgerStatus.FAILED
    assert entry.error is not None
    assert entry.error["maybe_sent"] is False
    assert desk.counts() == {}

    charge = _intent(thread_id, "charge_card", {"traveller": "ana", "amount": 89}, "charge:lost")
    cp.write_ledger(charge, expect=None)
    with pytest.raises(tp.SideEffectUncertain) as raised:
        tp.resume(graph, thread_id)
    assert raised.value.tool == "charge_card"
    assert cp.ledger_entry("charge:lost").status is LedgerStatus.UNCERTAIN
    assert tp.thread_info(cp, thread_id).status == "awaiting_human"
    # New input would let the model decide the charge again: refused, nothing runs.
    with pytest.raises(tp.SideEffectUncertain):
        tp.run(graph, thread_id, START)
    assert desk.counts() == {}


def test_an_unknown_thread_is_still_not_found(cp: Any, desk: TravelDesk) -> None:
    with pytest.raises(ThreadNotFound):
        tp.resume(build(cp, desk, TravelModel(plan=TRIP)), "nobody")


# -- chat while the thread waits ---------------------------------------------------------------

FARES = [("find_fares", {"route": "OPO-LIS"})]
WAIT_POLICY = {"find_fares": tp.ToolPolicy(max_in_process_wait=0.0)}


def _rate_limited(desk: TravelDesk) -> list[Any]:
    tools = travel_tools(desk)
    return [testing.failing(tools[0], times=100, exc=RateLimited).tool, *tools[1:]]


def test_a_chat_message_while_a_tool_waits_answers_the_call_first(
    cp: Any, desk: TravelDesk
) -> None:
    model = TravelModel(plan=FARES)
    graph = tp.create_recovery_agent(
        model, _rate_limited(desk), checkpointer=cp, policies=WAIT_POLICY
    )
    with pytest.raises(ToolWaiting):
        tp.run(graph, "trip-wait", {"messages": [("user", "book fares OPO-LIS")]})
    assert tp.thread_info(cp, "trip-wait").status == "waiting_tool"

    out = tp.run(graph, "trip-wait", {"messages": [("user", "any news?")]})
    assert_all_valid(model)
    last_input = model.inputs[-1]
    answer = next(m for m in last_input if isinstance(m, ToolMessage))
    assert answer.content.startswith("Not done: find_fares was waiting to be retried at ")
    assert isinstance(last_input[-1], HumanMessage)
    assert out["messages"][-1].content.startswith("Noted: 'any news?'")
    info = tp.thread_info(cp, "trip-wait")
    assert info.status == "closed"
    assert info.current_step is None
    assert any(e.kind is tp.EventKind.CALLS_CLOSED for e in cp.events("trip-wait"))

    # The plain LangGraph call, twice in a row, stays valid too.
    graph.invoke({"messages": [("user", "and now?")]}, {"configurable": {"thread_id": "trip-wait"}})
    assert_all_valid(model)


def test_a_chat_message_while_a_tool_waits_in_the_middleware_form(
    cp: Any, desk: TravelDesk
) -> None:
    model = TravelModel(plan=FARES)
    agent = create_agent(
        model,
        _rate_limited(desk),
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp, policies=WAIT_POLICY)],
    )
    with pytest.raises(ToolWaiting):
        tp.run(agent, "trip-mw", {"messages": [("user", "book fares OPO-LIS")]})
    out = tp.run(agent, "trip-mw", {"messages": [("user", "any news?")]})
    assert_all_valid(model)
    answer = next(m for m in model.inputs[-1] if isinstance(m, ToolMessage))
    assert "waiting to be retried" in str(answer.content)
    assert out["messages"][-1].content.startswith("Noted")


def test_the_middleware_never_sends_an_unanswered_call(cp: Any, desk: TravelDesk) -> None:
    """Through plain ``agent.invoke`` (no runner), a call left open is answered in what
    the provider is sent."""
    model = TravelModel(plan=FARES)
    agent = create_agent(
        model,
        _rate_limited(desk),
        checkpointer=cp,
        middleware=[RecoveryMiddleware(cp, policies=WAIT_POLICY)],
    )
    config = {"configurable": {"thread_id": "trip-mw-plain"}}
    with pytest.raises(ToolWaiting):
        agent.invoke({"messages": [("user", "book fares OPO-LIS")]}, config)
    agent.invoke({"messages": [("user", "any news?")]}, config)
    assert_all_valid(model)
    assert any(m.content == NO_ANSWER for m in model.inputs[-1] if isinstance(m, ToolMessage))


def test_a_chat_message_while_a_takeover_is_pending_is_refused(cp: Any, desk: TravelDesk) -> None:
    tools = travel_tools(desk)
    charge = testing.fail_after_effect(tools[3])  # the card is charged, the reply lost
    plan = [("charge_card", {"traveller": "ana", "amount": 89})]
    model = TravelModel(plan=plan)
    graph = tp.create_recovery_agent(model, [*tools[:3], charge.tool], checkpointer=cp)
    config = {"configurable": {"thread_id": "trip-takeover"}}
    tp.run(graph, "trip-takeover", {"messages": [("user", "book the charge")]})
    assert [r.thread_id for r in tp.pending_takeovers(cp)] == ["trip-takeover"]

    for send in (
        lambda: tp.run(graph, "trip-takeover", {"messages": [("user", "any news?")]}),
        lambda: graph.invoke({"messages": [("user", "any news?")]}, config),
    ):
        with pytest.raises(tp.PendingTakeover) as refused:
            send()
        assert "tp.decide" in str(refused.value)
    assert tp.pending_takeovers(cp), "the question to the person was not dropped"
    assert_all_valid(model)
    assert desk.counts() == {"charge_card": 1}

    tp.decide(graph, "trip-takeover", tp.Decision(action="provide_result", result="C1"))
    out = tp.run(graph, "trip-takeover", {"messages": [("user", "any news?")]})
    assert_all_valid(model)
    assert out["messages"][-1].content.startswith("Noted")
    assert desk.counts() == {"charge_card": 1}
    assert unsettled(cp, "trip-takeover") == []


def test_async_runner_settles_the_same_way(sqlite_path: str, desk: TravelDesk) -> None:
    async def scenario() -> None:
        async with tp.AsyncRecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as acp:
            await acp.setup()
            model = TravelModel(plan=FARES)
            graph = tp.create_recovery_agent(
                model, _rate_limited(desk), checkpointer=acp, policies=WAIT_POLICY
            )
            with pytest.raises(ToolWaiting):
                await tp.arun(graph, "trip-async", {"messages": [("user", "book fares")]})
            out = await tp.arun(graph, "trip-async", {"messages": [("user", "any news?")]})
            assert_all_valid(model)
            assert out["messages"][-1].content.startswith("Noted")

            thread_id = "trip-async-ledger"
            intent = _intent(thread_id, "book_flight", dict(TRIP[0][1]), "book_flight:a")
            await acp.awrite_ledger(intent, expect=None)
            assert await tp.aresume(graph, thread_id) == {}
            (entry,) = await acp.aledger(thread_id)
            assert entry.status is LedgerStatus.FAILED

    asyncio.run(scenario())


# -- the model's view, whatever the state holds ---------------------------------------------


def test_valid_conversation_answers_open_calls_in_place() -> None:
    call = {"name": "book_flight", "args": {}, "id": "c1"}
    other = {"name": "book_hotel", "args": {}, "id": "c2"}
    messages = [
        HumanMessage("book"),
        AIMessage("", tool_calls=[call, other]),
        ToolMessage("ok", tool_call_id="c2"),
        HumanMessage("any news?"),
        ToolMessage("stray", tool_call_id="c9"),
    ]
    fixed = valid_conversation(messages)
    assert_valid_conversation(fixed)
    assert [type(m).__name__ for m in fixed] == [
        "HumanMessage",
        "AIMessage",
        "ToolMessage",
        "ToolMessage",
        "HumanMessage",
    ]
    assert fixed[3].content == NO_ANSWER
    valid = [*fixed[:3], ToolMessage("ok", tool_call_id="c1")]
    assert valid_conversation(valid) == valid


def test_the_fast_check_never_skips_a_repair(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole conversation goes through ``valid_conversation`` at every model call, so a
    valid one is recognised in one pass; on random conversations (answers missing, stray,
    duplicated, out of order, calls sharing an id) the result is the full repair's."""
    import taskpilots_graph.conversation as conversation

    rng = random.Random(7)

    def message() -> Any:
        kind = rng.choice(["human", "ai", "calls", "tool", "tool"])
        if kind == "human":
            return HumanMessage("hi")
        if kind == "ai":
            return AIMessage("ok")
        if kind == "calls":
            ids = [rng.choice("abcd") for _ in range(rng.randint(1, 3))]
            return AIMessage("", tool_calls=[{"name": "t", "args": {}, "id": i} for i in ids])
        return ToolMessage("r", tool_call_id=rng.choice("abcde"))

    conversations = [[message() for _ in range(rng.randint(0, 8))] for _ in range(3000)]
    # Growing conversations too (the same objects, one message more at each model call),
    # which is what the check remembers a valid prefix for.
    for _ in range(300):
        grown: list[Any] = []
        for _ in range(12):
            grown = [*grown, message()]
            conversations.append(grown)
    fast = [valid_conversation(m) for m in conversations]
    monkeypatch.setattr(conversation, "_answered", lambda messages: False)
    assert fast == [valid_conversation(m) for m in conversations]
    monkeypatch.undo()
    assert any(conversation._answered(m) and len(m) > 3 for m in conversations)


# -- nothing hidden -------------------------------------------------------------------------


def test_unsettled_effects_show_in_threads_metrics_cli_and_inbox(
    conn_string: str, desk: TravelDesk
) -> None:
    from starlette.testclient import TestClient
    from typer.testing import CliRunner

    from taskpilots_graph.cli import app
    from taskpilots_graph.web import create_app

    with tp.RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        cp.setup()
        model = TravelModel(plan=TRIP)
        graph = build(cp, desk, model)
        tp.run(graph, "trip-done", START)
        assert tp.thread_info(cp, "trip-done").status == "closed"
        # A run of the same thread that died after the intent (written as the executor does).
        lost = _intent("trip-done", "book_flight", {"traveller": "ana", "flight": "X"}, "bf:lost")
        cp.write_ledger(lost, expect=None)
        doubt = _intent("trip-doubt", "charge_card", {"traveller": "ana", "amount": 5}, "cc:doubt")
        cp.write_ledger(doubt, expect=None)
        cp.write_ledger(
            replace(doubt, status=LedgerStatus.UNCERTAIN), expect=(LedgerStatus.INTENDED, 1)
        )

        done = tp.thread_info(cp, "trip-done")
        assert done.status == "running"  # never "closed" while an intent is not reconciled
        assert (done.intended_effects, done.uncertain_effects) == (1, 0)
        assert "bf:lost" in (done.reason or "")
        listed = {i.thread_id: i for i in tp.list_threads(cp)}
        assert listed["trip-doubt"].status == "awaiting_human"  # found by its ledger alone
        assert listed["trip-doubt"].uncertain_effects == 1
        metrics = tp.recovery_metrics(cp)
        assert metrics.unreconciled_intents == 1
        assert metrics.uncertain_effects == 1
        assert metrics.runs.closed == 0
        assert "intended" in metrics.to_prometheus()

        result = CliRunner().invoke(app, ["threads", "--db", conn_string, "--json"], env={})
        assert result.exit_code == 0, result.output
        rows = {r["thread_id"]: r for r in json.loads(result.stdout)}
        assert rows["trip-done"]["intended_effects"] == 1
        assert rows["trip-doubt"]["uncertain_effects"] == 1
        table = CliRunner().invoke(app, ["threads", "--db", conn_string], env={"COLUMNS": "200"})
        assert "1 intended" in table.stdout
        assert "1 uncertain" in table.stdout

        with TestClient(create_app(graph), base_url="http://127.0.0.1") as client:
            page = client.get("/").text
        assert "Unsettled effects" in page
        assert "bf:lost" in page
        assert "cc:doubt" in page

        # Reconciling it (new input on the thread) settles it: closed again, nothing hidden.
        tp.run(graph, "trip-done", {"messages": [("user", "thanks")]})
        assert tp.thread_info(cp, "trip-done").status == "closed"
        assert cp.ledger_entry("bf:lost").status is LedgerStatus.FAILED  # pre-check: NotDone


# -- both agent forms, sync and async: a crash inside the process ---------------------------


class Crash(BaseException):
    """Stands in for the process dying right after the effect (it is no ``Exception``, so
    nothing in the library records it: the intent stays ``intended``)."""


def _crashing_trip(desk: TravelDesk) -> list[Any]:
    tools = travel_tools(desk)
    flight = testing.fail_after_effect(tools[1], exc=Crash)
    return [tools[0], flight.tool, *tools[2:]]


def _agent(form: str, cp: Any, model: TravelModel, tools: list[Any]) -> Any:
    if form == "recovery_agent":
        return tp.create_recovery_agent(model, tools, checkpointer=cp, memory_window=None)
    return create_agent(model, tools, checkpointer=cp, middleware=[RecoveryMiddleware(cp)])


def _run_through(entry: str, graph: Any, thread_id: str) -> Any:
    """The same command, as ``tp.run`` or as LangGraph's own ``invoke`` / ``stream``."""
    if entry == "tp.run":
        return tp.run(graph, thread_id, START, durability="sync")
    config = {"configurable": {"thread_id": thread_id}}
    if entry == "stream":
        *_, last = graph.stream(START, config, durability="sync", stream_mode="values")
        return last
    return graph.invoke(START, config, durability="sync")


@pytest.mark.parametrize("entry", ["tp.run", "invoke", "stream"])
@pytest.mark.parametrize("form", ["recovery_agent", "create_agent"])
def test_the_same_command_after_a_crash_in_both_forms(
    form: str, entry: str, sqlite_path: str, desk: TravelDesk
) -> None:
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as cp:
        cp.setup()
        model = TravelModel(plan=TRIP)
        graph = _agent(form, cp, model, _crashing_trip(desk))
        with pytest.raises(Crash):
            _run_through(entry, graph, "trip-crash")
        assert [e.status for e in cp.ledger("trip-crash")] == [LedgerStatus.INTENDED]

        out = _run_through(entry, graph, "trip-crash")
        assert desk.counts() == {"book_flight": 1, "book_hotel": 1}
        assert unsettled(cp, "trip-crash") == []
        assert_all_valid(model)
        assert out["messages"][-1].content == "Your trip is booked."


@pytest.mark.parametrize("entry", ["tp.arun", "ainvoke", "astream"])
@pytest.mark.parametrize("form", ["recovery_agent", "create_agent"])
def test_the_same_command_after_a_crash_async(
    form: str, entry: str, sqlite_path: str, desk: TravelDesk
) -> None:
    async def run(graph: Any) -> Any:
        if entry == "tp.arun":
            return await tp.arun(graph, "trip-acrash", START, durability="sync")
        config = {"configurable": {"thread_id": "trip-acrash"}}
        if entry == "astream":
            chunks = [
                c
                async for c in graph.astream(START, config, durability="sync", stream_mode="values")
            ]
            return chunks[-1]
        return await graph.ainvoke(START, config, durability="sync")

    async def scenario() -> None:
        conn = f"sqlite:///{sqlite_path}"
        async with tp.AsyncRecoveryCheckpointer.from_conn_string(conn) as acp:
            await acp.setup()
            model = TravelModel(plan=TRIP)
            graph = _agent(form, acp, model, _crashing_trip(desk))
            with pytest.raises(Crash):
                await run(graph)
            out = await run(graph)
            assert desk.counts() == {"book_flight": 1, "book_hotel": 1}
            left = [
                e
                for e in await acp.aledger("trip-acrash")
                if e.status is not LedgerStatus.COMMITTED
            ]
            assert left == []
            assert_all_valid(model)
            assert out["messages"][-1].content == "Your trip is booked."

    asyncio.run(scenario())
