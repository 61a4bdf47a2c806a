"""An idempotent effect whose step is already on disk writes no intent: its commit is its
first ledger write (``engine._protocol.writes_intent``).

Under ``durability="sync"`` the checkpoint holding the model's call is stored before the
call runs; under the default ``"async"`` the step waits for that checkpoint's put, already
on its way, before its first side effect. The checkpoint names the call (tool-call id, hence
the default key); an idempotent service answers a repeated key with the first outcome. The
intent would add a durable write and tell nothing the resumed run cannot find out by running
the call again. The tests look from a separate connection while the tool runs, through both
agent forms and every entry point, then run the same command again; the cases that keep the
intent (a checkpoint that does not reach the disk in time, a ``key=`` other threads may
share) are checked the same way, and a SIGKILL inside the effect is resumed in a fresh
process. Real SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _slow_puts import slow_puts
from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph.events import EventKind
from taskpilots_graph.ledger import LedgerStatus
from taskpilots_graph.nodes._context import messages_digest
from taskpilots_graph.testing import ScriptedModel

FORMS = ("recovery agent", "middleware")
ENTRY_POINTS = ("invoke", "stream", "run")


def _rows(conn_string: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    """One query on a connection of its own (``?`` placeholders): what another process sees."""
    if conn_string.startswith("postgresql://"):
        with psycopg.connect(conn_string, autocommit=True) as pg:
            return pg.execute(statement.replace("?", "%s"), params).fetchall()
    with closing(sqlite3.connect(conn_string.removeprefix("sqlite:///"))) as lite:
        return lite.execute(statement, params).fetchall()


class Desk:
    """An idempotent payment desk: a repeated request key gets the first charge back. While
    a charge runs it notes what another connection sees of the call's ledger entry."""

    def __init__(self, conn_string: str) -> None:
        self.conn_string = conn_string
        self.charges: dict[str, str] = {}
        self.requests: list[str] = []
        self.on_record: list[list[tuple[Any, ...]]] = []
        self.call_stored: list[bool] = []
        self.events_stored: list[list[str]] = []

    def tool(self, *, key: Callable[[dict[str, Any]], str] | None = None) -> BaseTool:
        def charge(order: str) -> str:
            """Charge an order."""
            invocation = tp.current_invocation()
            request_key = invocation.key
            self.call_stored.append(_call_stored(self.conn_string, invocation))
            self.on_record.append(
                _rows(
                    self.conn_string,
                    "SELECT status FROM taskpilots_ledger WHERE key = ?",
                    request_key,
                )
            )
            self.events_stored.append(
                [
                    kind
                    for (kind,) in _rows(
                        self.conn_string,
                        "SELECT kind FROM taskpilots_events WHERE thread_id = ? ORDER BY seq",
                        invocation.thread_id,
                    )
                ]
            )
            self.requests.append(request_key)
            return self.charges.setdefault(request_key, f"charge-{len(self.charges) + 1}")

        made = StructuredTool.from_function(charge)
        return tp.side_effect(made, idempotent=True, key=key)


def _call_stored(conn_string: str, invocation: tp.Invocation) -> bool:
    """Whether a checkpointer of its own finds the call in the thread's stored checkpoint."""
    config = {"configurable": {"thread_id": invocation.thread_id, "checkpoint_ns": ""}}
    with tp.RecoveryCheckpointer.from_conn_string(conn_string) as other:
        stored = other.get_tuple(config)  # type: ignore[arg-type]
    messages = stored.checkpoint["channel_values"].get("messages", []) if stored else []
    return any(
        call["id"] == invocation.tool_call_id
        for message in messages
        for call in getattr(message, "tool_calls", None) or ()
    )


def _agent(form: str, cp: tp.RecoveryCheckpointer, tool: BaseTool) -> Any:
    model = ScriptedModel(plan=[("charge", {"order": "o-1"})])
    if form == "recovery agent":
        return tp.create_recovery_agent(model, [tool], checkpointer=cp)
    from taskpilots_graph.middleware import RecoveryMiddleware

    return create_agent(model, [tool], checkpointer=cp, middleware=[RecoveryMiddleware(cp)])


def _go(graph: Any, how: str, thread_id: str, **kwargs: Any) -> None:
    start = {"messages": [HumanMessage("charge order o-1")]}
    config = {"configurable": {"thread_id": thread_id}}
    if how == "invoke":
        graph.invoke(start, config, **kwargs)
    elif how == "stream":
        for _ in graph.stream(start, config, **kwargs):
            pass
    else:
        tp.run(graph, thread_id, start, **kwargs)


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("how", ENTRY_POINTS)
@pytest.mark.parametrize("form", FORMS)
def test_with_its_step_stored_the_commit_is_the_first_ledger_write(
    form: str, how: str, durability: str, cp: tp.RecoveryCheckpointer, conn_string: str
) -> None:
    """Nothing is on record while the tool runs; afterwards one committed entry carries
    the call's ``tool_invoked`` and ``tool_succeeded``. The same command again charges
    nothing more."""
    desk = Desk(conn_string)
    graph = _agent(form, cp, desk.tool())
    thread_id = f"free-{form.replace(' ', '-')}-{how}-{durability}"

    _go(graph, how, thread_id, durability=durability)

    assert desk.on_record == [[]]  # no intent before the effect
    assert desk.call_stored == [True]  # what the resumed run needs is on disk: the call
    digest = messages_digest([HumanMessage("charge order o-1")])
    assert cp.decision(thread_id, "", digest) is None  # so no decision record either
    (entry,) = cp.ledger(thread_id)
    assert (entry.status, entry.result) == (LedgerStatus.COMMITTED, "charge-1")
    kinds = [e.kind for e in cp.events(thread_id) if e.payload.get("key") == entry.key]
    assert kinds == [EventKind.TOOL_INVOKED, EventKind.TOOL_SUCCEEDED]

    _go(graph, how, thread_id, durability=durability)  # the same command, run twice
    assert desk.requests == [entry.key]
    assert [e.status for e in cp.ledger(thread_id)] == [LedgerStatus.COMMITTED]


@pytest.mark.parametrize("form", FORMS)
def test_the_intent_stays_where_it_is_needed(
    form: str, cp: tp.RecoveryCheckpointer, conn_string: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For a ``key=`` other threads may share, and under ``"async"`` durability when the
    step's checkpoint is not on disk in time, the intent is on record before the effect
    runs."""
    shared = Desk(conn_string)
    tool = shared.tool(key=lambda args: f"charge:{args['order']}")
    _go(_agent(form, cp, tool), "invoke", f"keyed-{form}", durability="sync")
    assert shared.on_record == [[("intended",)]]

    slow_puts(monkeypatch, cp)
    late = Desk(conn_string)
    _go(_agent(form, cp, late.tool()), "invoke", f"late-{form}")
    assert late.call_stored == [False]
    assert late.on_record == [[("intended",)]]  # the intent carries the model's decision
    digest = messages_digest([HumanMessage("charge order o-1")])
    assert cp.decision(f"late-{form}", "", digest) is not None


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("how", ENTRY_POINTS)
@pytest.mark.parametrize("form", FORMS)
def test_the_model_steps_events_ride_the_first_durable_write(
    form: str, how: str, durability: str, cp: tp.RecoveryCheckpointer, conn_string: str
) -> None:
    """The model's step writes nothing of its own on the way to a tool step: its events wait
    in memory for the thread's first durable write after it. For a keyed call that is the
    intent, so they are on disk before the effect; for an intent-free call, the commit,
    which puts them before the call's own events. The same command again charges nothing
    and logs a second, complete run."""
    keyed = Desk(conn_string)
    tool = keyed.tool(key=lambda args: f"charge:{args['order']}")
    thread_id = f"ride-{form.replace(' ', '-')}-{how}-{durability}"
    _go(_agent(form, cp, tool), how, f"{thread_id}-keyed", durability=durability)
    assert keyed.events_stored[0][0] == "agent_started"

    free = Desk(conn_string)
    graph = _agent(form, cp, free.tool())
    _go(graph, how, thread_id, durability=durability)
    assert free.events_stored == [[]]  # no write of the run before its effect
    kinds = [e.kind for e in cp.events(thread_id)]
    assert kinds[0] is EventKind.AGENT_STARTED
    assert kinds.index(EventKind.TOOL_INVOKED) < kinds.index(EventKind.TOOL_SUCCEEDED)
    assert kinds[-1] is EventKind.AGENT_FINISHED

    _go(graph, how, thread_id, durability=durability)  # the same command, run twice
    assert len(free.requests) == 1
    kinds = [e.kind for e in cp.events(thread_id)]
    assert kinds.count(EventKind.AGENT_STARTED) == kinds.count(EventKind.AGENT_FINISHED) == 2
    assert kinds[-1] is EventKind.AGENT_FINISHED


_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import StructuredTool
    import taskpilots_graph as tp
    from taskpilots_graph.testing import ScriptedModel

    conn, desk, action, durability = sys.argv[1:5]

    def charge(order: str) -> str:
        \"\"\"Charge an order.\"\"\"
        key = tp.current_invocation().key
        path = Path(desk)
        charges = json.loads(path.read_text()) if path.exists() else {}
        first = key not in charges
        charges.setdefault(key, f"charge-{len(charges) + 1}")
        path.write_text(json.dumps(charges))
        if first and action == "start":
            os.kill(os.getpid(), signal.SIGKILL)  # after the charge, before its commit
        return charges[key]

    tool = tp.side_effect(StructuredTool.from_function(charge), idempotent=True)
    with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
        cp.setup()
        graph = tp.create_recovery_agent(
            ScriptedModel(plan=[("charge", {"order": "o-1"})]), [tool], checkpointer=cp
        )
        if action == "start":
            start = {"messages": [HumanMessage("charge order o-1")]}
            tp.run(graph, "t", start, durability=durability)
        else:
            tp.resume(graph, "t", durability=durability)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("durability", ["sync", "async"])
def test_sigkill_after_the_effect_is_settled_by_running_it_again(
    durability: str, sqlite_path: str, tmp_path: Path
) -> None:
    """Killed after the desk charged, before anything of the call was on record: the
    resumed run asks again under the same key and gets the same charge; one charge, one
    committed entry holding it."""
    conn, desk = f"sqlite:///{sqlite_path}", tmp_path / "desk.json"

    def child(action: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-c", _CHILD, conn, str(desk), action, durability]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)

    started = child("start")
    assert started.returncode == -signal.SIGKILL, started.stderr[-2000:]
    with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
        assert cp.ledger("t") == []
    resumed = child("resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    charges = json.loads(desk.read_text())
    assert list(charges.values()) == ["charge-1"]
    with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
        (entry,) = cp.ledger("t")
        assert (entry.status, entry.result) == (LedgerStatus.COMMITTED, "charge-1")
        assert entry.key in charges
