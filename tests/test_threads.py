"""Thread listing: the status of real runs in every state the agent can leave them in.

Real ``create_recovery_agent`` runs on a SQLite file and a PostgreSQL database (the ``cp``
fixture) end closed, waiting on a person, waiting for a tool, and failed; a run whose process
is killed with SIGKILL mid side effect is ``running`` until it is resumed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _models import PlanModel
from langchain_core.messages import HumanMessage
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.checkpoint.memory import InMemorySaver

import taskpilots_graph as tp
from taskpilots_graph import testing
from taskpilots_graph.errors import ThreadNotFound, ToolWaiting
from taskpilots_graph.policy import Backoff, ToolPolicy
from taskpilots_graph.thread_listing import alist_threads, list_threads
from taskpilots_graph.threads import ThreadInfo, athread_info, status_from_events, thread_info

FAST = Backoff(initial=1.0, multiplier=2.0, max_delay=8.0, jitter=False)
TESTS = Path(__file__).parent


def effect_tool(name: str, done: list[str]) -> BaseTool:
    def perform(ref: str) -> str:
        done.append(f"{name}:{ref}")
        return f"{name} {ref} ok"

    return StructuredTool.from_function(perform, name=name, description=f"perform {name}")


def go(graph: Any, thread_id: str) -> Any:
    return graph.invoke(
        {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": thread_id}}
    )


def run_each_status(cp: Any) -> dict[str, Any]:
    """Leave one thread in each status the agent can stop in; returns what was observed."""
    done: list[str] = []
    seen: dict[str, Any] = {}
    closed = tp.create_recovery_agent(
        PlanModel(plan=[("book", {"ref": "A"})]),
        [tp.side_effect(effect_tool("book", done))],
        checkpointer=cp,
    )
    go(closed, "closed")

    charge = testing.fail_after_effect(tp.side_effect(effect_tool("charge", done)), times=1)
    waits = tp.create_recovery_agent(
        PlanModel(plan=[("charge", {"ref": "C"})]), [charge.tool], checkpointer=cp
    )
    seen["interrupt"] = go(waits, "person")["__interrupt__"]

    mail = testing.down_for(effect_tool("mail", done), 500, exc=ConnectionRefusedError())
    later = tp.create_recovery_agent(
        PlanModel(plan=[("mail", {"ref": "M"})]),
        [tp.side_effect(mail.tool, idempotent=True)],
        checkpointer=cp,
        default_policy=ToolPolicy(backoff=Backoff(initial=60, jitter=False), wait_window=3600),
    )
    search = testing.down_for(effect_tool("search", done), 10_000, exc=ConnectionRefusedError())
    policy = ToolPolicy(backoff=FAST, max_attempts=2, wait_window=1_000, on_exhausted="fail")
    broken = tp.create_recovery_agent(
        PlanModel(plan=[("search", {"ref": "S"})]),
        [search.tool],
        checkpointer=cp,
        policies={"search": policy},
    )
    with testing.fake_clock():
        with pytest.raises(ToolWaiting) as waiting:
            go(later, "tool")
        seen["retry_at"] = waiting.value.retry_at
        go(broken, "failed")
    return seen


def test_status_of_real_runs(cp: tp.RecoveryCheckpointer) -> None:
    """closed, awaiting_human (with the takeover), waiting_tool (with retry_at) and failed."""
    seen = run_each_status(cp)

    infos = {i.thread_id: i for i in list_threads(cp)}
    assert list(infos) == ["closed", "failed", "person", "tool"]  # sorted by id
    assert {t: i.status for t, i in infos.items()} == {
        "closed": "closed",
        "failed": "failed",
        "person": "awaiting_human",
        "tool": "waiting_tool",
    }
    closed, person, tool, failed = (infos[t] for t in ("closed", "person", "tool", "failed"))
    assert (closed.current_step, closed.takeover_pending, closed.effects) == (None, False, 1)
    assert (closed.last_event, closed.tool_calls, closed.tool_failures) == ("agent_finished", 1, 0)

    assert person.takeover_pending
    assert person.current_step is not None
    assert (person.current_step.tool, person.current_step.status) == ("charge", "awaiting_human")
    assert (
        person.current_step.tool_call_id == seen["interrupt"][0].value["pending"][0]["tool_call_id"]
    )
    assert (person.takeovers, person.effects) == (1, 1)
    assert person.reason is not None

    assert tool.retry_at == seen["retry_at"]
    assert tool.current_step is not None
    assert (tool.current_step.using, tool.current_step.status) == ("mail", "waiting_tool")
    assert tool.retries == 1
    assert not tool.takeover_pending

    assert failed.stage == "failed"
    assert (failed.tool_calls, failed.tool_failures, failed.retries) == (2, 2, 1)

    for info in infos.values():
        assert info.checkpoint_id is not None
        assert info.updated_at is not None
        assert info.last_event_at is not None
        assert info.superstep is not None
        assert json.loads(json.dumps(info.as_dict()))["thread_id"] == info.thread_id

    assert [i.thread_id for i in list_threads(cp, thread_ids=["tool", "closed", "tool"])] == [
        "closed",
        "tool",
    ]
    assert thread_info(cp, "person") == infos["person"]


def test_answered_takeover_and_resumed_wait_close_the_threads(cp: tp.RecoveryCheckpointer) -> None:
    """After ``decide`` the waiting thread is closed; the status follows the checkpoint."""
    done: list[str] = []
    charge = testing.fail_after_effect(tp.side_effect(effect_tool("charge", done)), times=1)
    graph = tp.create_recovery_agent(
        PlanModel(plan=[("charge", {"ref": "C"})]), [charge.tool], checkpointer=cp
    )
    go(graph, "t")
    assert thread_info(cp, "t").status == "awaiting_human"
    tp.decide(graph, "t", "skip")
    info = thread_info(cp, "t")
    assert (info.status, info.takeover_pending, info.current_step) == ("closed", False, None)


def test_unknown_threads_events_only_threads_and_newer_turns(cp: tp.RecoveryCheckpointer) -> None:
    """Unknown id: ThreadNotFound; events without checkpoint: status from the log."""
    with pytest.raises(ThreadNotFound):
        thread_info(cp, "nobody")
    with pytest.raises(ThreadNotFound):
        list_threads(cp, thread_ids=["nobody"])
    with pytest.raises(tp.ConfigurationError):
        thread_info(cp, "")
    with pytest.raises(tp.ConfigurationError, match="RecoveryCheckpointer"):
        thread_info(InMemorySaver(), "t")

    cp.append_event("only-events", "agent_started", {"goal": "go"})
    cp.append_event("only-events", "takeover_requested", {"tool": "x"})
    info = thread_info(cp, "only-events")
    assert (info.status, info.checkpoint_id, info.events, info.takeovers) == (
        "awaiting_human",
        None,
        2,
        1,
    )
    assert list_threads(cp) == []  # the scan sees checkpoints only

    done: list[str] = []
    graph = tp.create_recovery_agent(
        PlanModel(plan=[]), [effect_tool("noop", done)], checkpointer=cp
    )
    go(graph, "two-turns")
    assert thread_info(cp, "two-turns").status == "closed"
    # A new turn started after the last agent_finished while the flow still says closed
    # (a process that died before the turn's first checkpoint): not closed any more.
    cp.append_event("two-turns", "agent_started", {"goal": "and now?"})
    assert thread_info(cp, "two-turns").status == "running"


def test_status_from_events_alone() -> None:
    """The log-only rules: finished, waiting on a person, waiting for a tool, running."""

    def log(*kinds: tuple[str, dict[str, Any]]) -> list[tp.Event]:
        from datetime import UTC, datetime

        now = datetime.now(UTC)
        return [
            tp.Event("t", i, tp.EventKind(k), now, p) for i, (k, p) in enumerate(kinds, start=1)
        ]

    assert status_from_events([]) == "running"
    assert status_from_events(log(("agent_started", {}), ("retry_scheduled", {}))) == (
        "waiting_tool"
    )
    assert (
        status_from_events(
            log(
                ("retry_scheduled", {}),
                ("tool_invoked", {}),
                ("agent_finished", {"status": "failed"}),
            )
        )
        == "failed"
    )
    assert (
        status_from_events(log(("takeover_requested", {}), ("decision_recorded", {}))) == "running"
    )
    assert (
        status_from_events(
            log(
                ("agent_finished", {}),
            )
        )
        == "closed"
    )


BOOK_KEY = lambda args: f"book:{args['ref']}"  # noqa: E731 - the key CHILD declares

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    from _models import PlanModel
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import StructuredTool
    import taskpilots_graph as tp

    def book(ref: str) -> str:
        os.kill(os.getpid(), signal.SIGKILL)  # the worker dies inside the side effect
        return "never"

    tool = StructuredTool.from_function(book, name="book", description="book")
    with tp.RecoveryCheckpointer.from_conn_string(sys.argv[1]) as cp:
        cp.setup()
        graph = tp.create_recovery_agent(
            PlanModel(plan=[("book", {"ref": "A"})]),
            # A business key keeps the intent on record before the effect (under its
            # default key an idempotent effect whose step is stored writes none).
            [tp.side_effect(tool, idempotent=True, key=lambda args: f"book:{args['ref']}")],
            checkpointer=cp,
        )
        graph.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "t"}})
    """
)


def test_killed_run_is_running_until_resumed(sqlite_path: str) -> None:
    """SIGKILL inside a side effect: ``running`` (resumable); ``resume`` closes it."""
    conn = f"sqlite:///{sqlite_path}"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, conn, str(TESTS)], capture_output=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]

    with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
        info = thread_info(cp, "t")
        assert (info.status, info.last_event, info.takeover_pending) == (
            "running",
            "tool_invoked",
            False,
        )
        done: list[str] = []
        graph = tp.create_recovery_agent(
            PlanModel(plan=[("book", {"ref": "A"})]),
            [tp.side_effect(effect_tool("book", done), idempotent=True, key=BOOK_KEY)],
            checkpointer=cp,
        )
        tp.resume(graph, "t")
        assert done == ["book:A"]
        assert thread_info(cp, "t").status == "closed"


async def test_async_listing(sqlite_path: str) -> None:
    """``alist_threads`` / ``athread_info`` on an ``AsyncRecoveryCheckpointer``."""
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as acp:
        await acp.setup()
        done: list[str] = []
        charge = testing.fail_after_effect(tp.side_effect(effect_tool("charge", done)), times=1)
        graph = tp.create_recovery_agent(
            PlanModel(plan=[("charge", {"ref": "C"})]), [charge.tool], checkpointer=acp
        )
        await graph.ainvoke(
            {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "a"}}
        )
        (info,) = await alist_threads(acp)
        assert isinstance(info, ThreadInfo)
        assert (info.thread_id, info.status, info.takeover_pending) == ("a", "awaiting_human", True)
        assert await athread_info(acp, "a") == info
        with pytest.raises(ThreadNotFound):
            await athread_info(acp, "b")
