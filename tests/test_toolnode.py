"""``tp.ToolNode`` gives a graph you build yourself the ledger; LangGraph's own refuses.

The graphs are real ``StateGraph`` loops (model node + tool node, ``tests/_toolnode_worker.py``)
on a real SQLite recovery checkpointer; the help desk is the simulated services on their own
SQLite file, so tickets can be counted after the agent's process is gone.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import taskpilots_graph as tp
from taskpilots_graph.demo.services import Services
from taskpilots_graph.events import EventKind
from taskpilots_graph.ledger import LedgerStatus
from taskpilots_graph.locks import default_lease_backend

sys.path.insert(0, str(Path(__file__).parent))
from _middleware_worker import FAST, ticket_tool
from _models import PlanModel
from _toolnode_worker import build_graph, ticket_tools

WORKER = Path(__file__).parent / "_toolnode_worker.py"


@pytest.fixture
def services(tmp_path: Path) -> Services:
    return Services(str(tmp_path / "services.db"), latency_s=0)


@pytest.fixture
def cp(sqlite_path: str) -> Iterator[tp.RecoveryCheckpointer]:
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as saver:
        saver.setup()
        yield saver


def _config(thread_id: str) -> Any:
    return {"configurable": {"thread_id": thread_id}}


def _tickets(services: Services) -> int:
    return sum(e["service"] == "create_ticket" for e in services.effects())


# --- the acceptance test: SIGKILL between the effect and its commit ---------------------------


def _worker(mode: str, action: str, db: str, services: Services) -> Any:
    return subprocess.run(
        [sys.executable, str(WORKER), mode, action, db, services.path, "t-kill"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "expected"), [("ours", 1), ("plain", 2)])
def test_sigkill_after_effect_then_resume(
    mode: str, expected: int, sqlite_path: str, services: Services
) -> None:
    """Killed right after the help desk wrote the ticket: tp.ToolNode resumes in a fresh
    process without opening it again; LangGraph's ToolNode opens a second one."""
    services.plant_kill("create_ticket", "after")
    started = _worker(mode, "start", sqlite_path, services)
    assert started.returncode == -signal.SIGKILL, started.stderr
    assert services.pending_kills() == 0
    assert _tickets(services) == 1

    resumed = _worker(mode, "resume", sqlite_path, services)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[-1]) == {"type": "ai", "content": "done"}
    assert _tickets(services) == expected
    if mode == "ours":
        with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as saver:
            (entry,) = saver.ledger("t-kill")
            assert entry.status is LedgerStatus.COMMITTED
            assert entry.extra["reconciled"] == "precheck_done"
            assert entry.key == services.effects()[0]["request_key"]
            kinds = [e.kind for e in saver.events("t-kill")]
            assert EventKind.EFFECT_RECONCILED in kinds


# --- in process, sync and async ---------------------------------------------------------------


def test_effect_runs_once_with_its_key_and_is_committed(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """The tool gets its invocation key, the ledger commits the result, and the tool events
    are written by the end of the run (the model node is the user's, not ours)."""
    _, declared = ticket_tools(services)
    graph = build_graph(tp.ToolNode([declared]), cp)
    out = graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"))
    assert out["messages"][-1].content == "done"
    (effect,) = services.effects()
    (entry,) = cp.ledger("t-1")
    assert entry.status is LedgerStatus.COMMITTED
    assert entry.key == effect["request_key"]
    assert entry.result == effect["payload"]["id"]
    kinds = [e.kind for e in cp.events("t-1")]
    assert kinds[-2:] == [EventKind.TOOL_INVOKED, EventKind.TOOL_SUCCEEDED]


async def test_async_graph_on_the_async_checkpointer(sqlite_path: str, services: Services) -> None:
    """The same through ``ainvoke`` on ``AsyncRecoveryCheckpointer``: the node's async hook
    drives the ledger."""
    _, declared = ticket_tools(services)
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as acp:
        await acp.setup()
        graph = build_graph(tp.ToolNode([declared]), acp)
        out = await graph.ainvoke({"messages": [("user", "t-1")]}, _config("t-1"))
        assert out["messages"][-1].content == "done"
        (entry,) = await acp.aledger("t-1")
    assert entry.status is LedgerStatus.COMMITTED
    assert _tickets(services) == 1


def test_timeout_after_the_effect_is_reconciled_not_repeated(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """The ticket is written, then the answer times out: the policy retries, the pre-check
    finds the ticket, and the model gets its id; one ticket."""
    graph = build_graph(tp.ToolNode([ticket_tool(services)], default_policy=FAST), cp)
    out = graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"))
    assert _tickets(services) == 1
    answer = next(m for m in out["messages"] if isinstance(m, ToolMessage))
    assert answer.status == "success"
    assert answer.content == services.effects()[0]["payload"]["id"]
    (entry,) = cp.ledger("t-1")
    assert entry.extra["reconciled"] == "precheck_done"


async def test_timeout_after_the_effect_is_reconciled_async(
    sqlite_path: str, services: Services
) -> None:
    """The same through the node's async hook, on ``AsyncRecoveryCheckpointer``."""
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as acp:
        await acp.setup()
        graph = build_graph(tp.ToolNode([ticket_tool(services)], default_policy=FAST), acp)
        out = await graph.ainvoke({"messages": [("user", "t-1")]}, _config("t-1"))
        (entry,) = await acp.aledger("t-1")
    assert _tickets(services) == 1
    answer = next(m for m in out["messages"] if isinstance(m, ToolMessage))
    assert answer.content == services.effects()[0]["payload"]["id"]
    assert entry.extra["reconciled"] == "precheck_done"


def test_unconfirmable_effect_goes_to_a_person(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """No pre-check, not idempotent, timed out: the run stops for a person instead of
    opening the ticket again; tp.decide records the answer and the run goes on."""
    graph = build_graph(tp.ToolNode([ticket_tool(services, precheck=False)]), cp)
    out = graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"))
    assert "__interrupt__" in out
    (request,) = tp.pending_takeovers(cp, thread_ids=["t-1"])
    assert [e["tool"] for e in request.uncertain_effects] == ["open_ticket"]
    done = tp.decide(graph, "t-1", tp.Decision(action="provide_result", result="T-9"))
    assert done["messages"][-1].content == "done"
    assert _tickets(services) == 1
    (entry,) = cp.ledger("t-1")
    assert (entry.status, entry.result) == (LedgerStatus.COMMITTED, "T-9")


def test_a_replanned_effect_returns_the_recorded_result(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """A model that plans the same ticket twice (new call id, same arguments) gets the first
    result back; the repeat guard is the shared middleware's."""
    _, declared = ticket_tools(services)
    graph = build_graph(tp.ToolNode([declared]), cp, tickets=2)
    out = graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"))
    answers = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert len(answers) == 2
    assert _tickets(services) == 1
    assert "already done" in str(answers[1].content)
    assert EventKind.REPEAT_CAUGHT in [e.kind for e in cp.events("t-1")]


# --- where the ledger cannot reach: refused, with what to use instead -------------------------


def test_langgraphs_own_toolnode_refuses_a_side_effect_tool(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """A @side_effect tool in LangGraph's ToolNode would run unrecorded: it is refused before
    its body runs, with an error naming tp.ToolNode, RecoveryExecutor and RecoveryMiddleware."""
    _, declared = ticket_tools(services)
    graph = build_graph(ToolNode([declared]), cp)
    with pytest.raises(tp.ConfigurationError) as caught:
        graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"))
    message = str(caught.value)
    for fix in ("tp.ToolNode", "RecoveryExecutor", "tp.RecoveryMiddleware"):
        assert fix in message
    assert "'open_ticket'" in message
    assert _tickets(services) == 0
    assert cp.ledger("t-1") == []


async def test_direct_invoke_is_refused_sync_and_async(services: Services) -> None:
    """Calling the declared tool by hand records nothing, so it does not run."""
    _, declared = ticket_tools(services)
    with pytest.raises(tp.ConfigurationError, match="outside the side-effect ledger"):
        declared.invoke({"subject": "x"})
    with pytest.raises(tp.ConfigurationError, match="outside the side-effect ledger"):
        await declared.ainvoke({"subject": "x"})
    assert _tickets(services) == 0


def test_current_invocation_outside_the_ledger_names_the_fix() -> None:
    """The error a tool body meets says what to run it with."""
    with pytest.raises(tp.ConfigurationError, match=r"tp\.ToolNode\(tools\)"):
        tp.current_invocation()


def test_graph_without_a_recovery_checkpointer_is_refused(services: Services) -> None:
    """tp.ToolNode on a plain saver has no ledger: refused at the first call, nothing runs."""
    _, declared = ticket_tools(services)
    graph = build_graph(tp.ToolNode([declared]), InMemorySaver())
    with pytest.raises(tp.ConfigurationError, match="RecoveryCheckpointer"):
        graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"))
    assert _tickets(services) == 0


def test_options_are_checked_at_construction(cp: tp.RecoveryCheckpointer) -> None:
    """A policy that is not a ToolPolicy, or a bad lease TTL, fails where the node is built."""
    with pytest.raises(tp.ConfigurationError, match=r"policies\['x'\]"):
        tp.ToolNode([], policies={"x": {"max_attempts": 3}})  # type: ignore[dict-item]
    with pytest.raises(tp.ConfigurationError, match="lease_ttl"):
        tp.ToolNode([], lease_ttl=0)
    with pytest.raises(tp.ConfigurationError, match="RecoveryCheckpointer"):
        tp.ToolNode([], checkpointer=InMemorySaver())  # type: ignore[arg-type]


def test_named_checkpointer_gives_runners_its_lease_backend(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """tp.resume and tp.run hold the thread lease where the node's calls do."""
    from taskpilots_graph.agent import lease_source

    _, declared = ticket_tools(services)
    graph = build_graph(tp.ToolNode([declared], checkpointer=cp, lease_ttl=12), cp)
    source = lease_source(graph)
    assert source is not None
    assert source.ttl == 12


def test_a_second_runner_of_the_thread_gets_thread_busy(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """While another worker holds the thread's lease, the node's call refuses to run: no
    ticket, no ledger entry, a typed error instead of a lost write."""
    from taskpilots_graph.leases import thread_lease_name
    from taskpilots_graph.locks.hold import hold

    _, declared = ticket_tools(services)
    graph = build_graph(tp.ToolNode([declared]), cp)
    with (
        hold(default_lease_backend(cp), thread_lease_name("t-1"), ttl=30, owner="other-worker"),
        pytest.raises(tp.ThreadBusy),
    ):
        graph.invoke({"messages": [("user", "t-1")]}, _config("t-1"))
    assert _tickets(services) == 0
    assert cp.ledger("t-1") == []


def test_a_locked_effect_runs_under_its_business_lock(
    cp: tp.RecoveryCheckpointer, services: Services
) -> None:
    """A ``lock=`` tool runs holding its business lock: the fencing token the tool sees is the
    one on its ledger entry."""
    seen: list[int | None] = []

    @tool
    def refund(order_id: str) -> str:
        """Refund an order."""
        seen.append(tp.current_invocation().fencing)
        return services.create_ticket(order_id, "refund", tp.current_invocation().key)

    locked = tp.side_effect(refund, idempotent=True, lock=lambda args: f"{args['order_id']}:refund")
    model = PlanModel(plan=[("refund", {"order_id": "$msg"})])
    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", tp.ToolNode([locked]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    graph = builder.compile(checkpointer=cp)
    graph.invoke({"messages": [("user", "order-42")]}, _config("t-1"))
    (entry,) = cp.ledger("t-1")
    assert entry.lock == "order-42:refund"
    assert seen == [entry.extra["fencing"]]
    assert seen[0] is not None
