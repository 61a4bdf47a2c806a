"""A ``create_agent`` agent with one side-effecting tool, for the middleware tests.

Run as ``python tests/_middleware_worker.py MODE ACTION DB SERVICES THREAD`` where ``MODE``
is ``recovery`` (``RecoveryMiddleware``) or ``retry`` (langchain's ``ToolRetryMiddleware``
only) and ``ACTION`` is ``start`` or ``resume``. It prints one JSON line: the last message
of the run.

The tool opens a help-desk ticket in the simulated services (their own SQLite file), and on
its first call the answer is lost after the ticket was created: ``TimeoutError``. A kill
point planted in the services SIGKILLs the worker right after the ticket is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ToolRetryMiddleware
from langchain_core.tools import BaseTool, tool

import taskpilots_graph as tp
from taskpilots_graph.demo.services import Services
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.middleware import RecoveryMiddleware
from taskpilots_graph.tools import SideEffectTool

sys.path.insert(0, str(Path(__file__).parent))
from _models import PlanModel

FAST = tp.ToolPolicy(max_attempts=3, backoff=tp.Backoff(initial=0.01, jitter=False))


def ticket_tool(services: Services, *, precheck: bool = True) -> BaseTool:
    """``open_ticket``: not idempotent; with ``precheck``, searchable by request key."""

    def find(key: str, args: dict[str, Any]) -> tp.Done | tp.NotDone:
        found = services.find_ticket(key)
        return tp.NotDone() if found is None else tp.Done(found["id"], proof=found)

    @tool
    def open_ticket(subject: str) -> str:
        """Open a help-desk ticket."""
        try:
            key: str | None = tp.current_invocation().key
        except ConfigurationError:
            key = None  # run without the ledger (the ToolRetryMiddleware comparison)
        ticket = services.create_ticket(subject, subject, key)
        if sum(e["identity"] == subject for e in services.effects()) == 1:
            raise TimeoutError("the help desk did not answer in time")
        return ticket

    return tp.side_effect(open_ticket, precheck=find if precheck else None)


def build_agent(mode: str, cp: Any, services: Services, *, precheck: bool = True) -> Any:
    """The agent under test: same model, tool and checkpointer; only the middleware differs."""
    middleware: list[AgentMiddleware[Any, Any, Any]]
    if mode == "recovery":
        middleware = [RecoveryMiddleware(cp, default_policy=FAST)]
    elif mode == "retry":
        middleware = [ToolRetryMiddleware(max_retries=2, initial_delay=0.01, jitter=False)]
    else:
        raise SystemExit(f"unknown mode {mode!r}; use 'recovery' or 'retry'")
    model = PlanModel(plan=[("open_ticket", {"subject": "$msg"})])
    ticket = ticket_tool(services, precheck=precheck)
    if mode == "retry" and isinstance(ticket, SideEffectTool):
        # Without the ledger a declared tool refuses to run: the comparison gets the tool as
        # a create_agent user without taskpilots has it, undeclared.
        ticket = ticket.tool
    return create_agent(model, [ticket], checkpointer=cp, middleware=middleware)


def main(argv: list[str]) -> int:
    mode, action, db, services_path, thread_id = argv
    services = Services(services_path, latency_s=0)
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{db}") as cp:
        agent = build_agent(mode, cp, services)
        config = {"configurable": {"thread_id": thread_id}}
        if action == "start":
            out = agent.invoke({"messages": [("user", thread_id)]}, config)
        else:
            out = tp.resume(agent, thread_id)
    last = out["messages"][-1]
    print(json.dumps({"type": last.type, "content": str(last.content)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
