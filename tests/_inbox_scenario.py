"""A thread stopped on an uncertain effect, for the takeover inbox tests.

The plan: ``lookup`` (a read whose answer comes from the customer record and may hold
markup), ``reserve`` A (commits), then ``charge`` C, which performs its effect and times
out: non-idempotent and without a pre-check, it becomes uncertain and the run asks a
person. The simulated service keeps its executions in a SQLite file of its own, so the
tests count them apart from the agent's store.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

from langchain_core.messages import HumanMessage
from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph import testing

THREAD = "order-7"
GOAL = "look up the customer, reserve A, then charge C"
PLAN: list[tuple[str, dict[str, Any]]] = [
    ("lookup", {"customer": "c-1"}),
    ("reserve", {"ref": "A"}),
    ("charge", {"ref": "C"}),
]


class FileService:
    """Executions per tool, in a SQLite file that outlives the agent's process."""

    def __init__(self, path: Path, note: str = "VIP customer") -> None:
        self.path = str(path)
        self.note = note
        with closing(sqlite3.connect(self.path)) as conn, conn:
            conn.execute("CREATE TABLE IF NOT EXISTS calls (tool TEXT, ref TEXT)")

    def record(self, tool: str, ref: str) -> None:
        with closing(sqlite3.connect(self.path)) as conn, conn:
            conn.execute("INSERT INTO calls VALUES (?, ?)", (tool, ref))

    def count(self, tool: str) -> int:
        with closing(sqlite3.connect(self.path)) as conn:
            (n,) = conn.execute("SELECT count(*) FROM calls WHERE tool = ?", (tool,)).fetchone()
            return int(n)

    def tools(self) -> list[BaseTool]:
        def lookup(customer: str) -> str:
            self.record("lookup", customer)
            return f"{customer}: {self.note}"

        def reserve(ref: str) -> str:
            self.record("reserve", ref)
            return f"reserved {ref}"

        def charge(ref: str) -> str:
            self.record("charge", ref)
            return f"charged {ref}"

        def undo(key: str, args: dict[str, Any], result: Any) -> None:
            self.record("undo", key)

        charging = testing.fail_after_effect(
            tp.side_effect(StructuredTool.from_function(charge, description="charge an order")),
            times=1,
        )
        return [
            StructuredTool.from_function(lookup, description="read the customer record"),
            tp.side_effect(
                StructuredTool.from_function(reserve, description="reserve stock"),
                compensate=undo,
            ),
            charging.tool,
        ]


def build(cp: tp.RecoveryCheckpointer, service: FileService) -> Any:
    """The agent of the scenario, on ``cp``."""
    return tp.create_recovery_agent(
        testing.ScriptedModel(plan=PLAN, answer="all done"), service.tools(), checkpointer=cp
    )


def stop_on_takeover(graph: Any) -> None:
    """Run the thread until it waits on a person about ``charge``."""
    result = graph.invoke(
        {"messages": [HumanMessage(GOAL)]}, {"configurable": {"thread_id": THREAD}}
    )
    assert "__interrupt__" in result
