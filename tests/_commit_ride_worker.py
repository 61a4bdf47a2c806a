"""A tool-node graph killed while a tool's commit waits for its task's writes.

Run as ``python tests/_commit_ride_worker.py KIND ACTION DB SERVICES THREAD``. ``KIND`` is
``precheck`` (``open_ticket`` declared with a pre-check by request key) or ``idempotent``
(the help desk hands back the ticket already opened under the request key). With
``ACTION`` ``start`` the worker SIGKILLs itself at the moment LangGraph asks the checkpointer
to write the thread while the tool task's ledger commit is held: the tool returned, and
neither its writes nor its commit are durable. ``resume`` continues the
thread. It prints one JSON line: the last message of the run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from langchain_core.tools import BaseTool, tool

import taskpilots_graph as tp
from taskpilots_graph.demo.services import Services

sys.path.insert(0, str(Path(__file__).parent))
from _toolnode_worker import build_graph, ticket_tools


def idempotent_ticket(services: Services) -> BaseTool:
    """``open_ticket`` on a help desk that deduplicates by the request key."""

    @tool
    def open_ticket(subject: str) -> str:
        """Open a help-desk ticket."""
        key = tp.current_invocation().key
        found = services.find_ticket(key)
        return (
            str(found["id"]) if found is not None else services.create_ticket(subject, subject, key)
        )

    return tp.side_effect(open_ticket, idempotent=True)


def die_before_riding(cp: tp.RecoveryCheckpointer) -> None:
    """SIGKILL this process when a write of the thread is about to carry (or go after) a
    held commit: LangGraph's put_writes of the tool's task, or the put of the checkpoint
    after it, whichever its background executor runs first."""
    put_writes, put = cp.put_writes, cp.put

    def die_if_held(config: Any) -> None:
        if cp._held_commits().get(config["configurable"]["thread_id"]):
            os.kill(os.getpid(), signal.SIGKILL)

    def killing_put_writes(config: Any, *args: Any) -> None:
        die_if_held(config)
        put_writes(config, *args)

    def killing_put(config: Any, *args: Any) -> Any:
        die_if_held(config)
        return put(config, *args)

    cp.put_writes = killing_put_writes  # type: ignore[method-assign]
    cp.put = killing_put  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    kind, action, db, services_path, thread_id = argv
    services = Services(services_path, latency_s=0)
    if kind == "precheck":
        declared = ticket_tools(services)[1]
    elif kind == "idempotent":
        declared = idempotent_ticket(services)
    else:
        raise SystemExit(f"unknown kind {kind!r}; use 'precheck' or 'idempotent'")
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{db}") as cp:
        cp.setup()
        graph = build_graph(tp.ToolNode([declared]), cp)
        if action == "start":
            die_before_riding(cp)
            config = {"configurable": {"thread_id": thread_id}}
            out = graph.invoke({"messages": [("user", thread_id)]}, config, durability="sync")
        else:
            out = tp.resume(graph, thread_id)
    last = out["messages"][-1]
    print(json.dumps({"type": last.type, "content": str(last.content)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
