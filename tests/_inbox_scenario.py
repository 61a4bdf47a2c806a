"""A thread stopped on an uncertain effect, for the takeover inbox tests.

The plan: ``lookup`` (a read whose answer comes from the customer record and may hold
markup), ``reserve`` A (commits), then ``charge`` C, which performs its effect and times
out: non-idempotent and without a pre-check, it becomes uncertain and the run asks a
person. The simulated service keeps its executions in a SQLite file of its own, so the
tests count them apart from the agent's store.
"""

from __future__ import annotations

import os
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


# --- the warehouse: a shipping agent whose uncertain ship_parcel goes to the inbox ----------

SHIPMENTS = ("ship-1", "ship-2")
SHIP_GOAL = "reserve the stock of order o-7, print its label, ship the parcel, notify the customer"
SHIP_PLAN: list[tuple[str, dict[str, Any]]] = [
    ("reserve_stock", {"order": "o-7"}),
    ("print_label", {"order": "o-7"}),
    ("ship_parcel", {"order": "o-7"}),
    ("notify_customer", {"order": "o-7"}),
]
SHIP_ANSWER = "The parcel is on its way and the customer was notified."
CARRIER_PORTAL = "search the carrier portal for the order id; a parcel there was shipped"


def warehouse_tools(service: FileService) -> list[BaseTool]:
    """Stock (undo: release), label (no undo), the carrier (times out after shipping on its
    first two calls) and the mailer (times out before sending on its first call). Neither
    the carrier nor the mailer has a pre-check or deduplicates: both become uncertain."""

    def reserve_stock(order: str) -> str:
        service.record("reserve_stock", order)
        return f"stock reserved for {order}"

    def print_label(order: str) -> str:
        service.record("print_label", order)
        return f"label printed for {order}"

    def ship_parcel(order: str) -> str:
        service.record("ship_parcel", order)
        return f"parcel for {order} handed to the carrier"

    def notify_customer(order: str) -> str:
        service.record("notify_customer", order)
        return f"email sent about {order}"

    def release(key: str, args: dict[str, Any], result: Any) -> None:
        service.record("release_stock", key)

    carrier = testing.FaultyTool(
        tp.side_effect(
            StructuredTool.from_function(
                ship_parcel,
                description=f"Hand the order's parcel to the carrier.\nVerify: {CARRIER_PORTAL}",
            )
        ),
        lambda n: (False, n <= 2),
        TimeoutError,
    )
    mailer = testing.FaultyTool(
        tp.side_effect(
            StructuredTool.from_function(notify_customer, description="Email the customer.")
        ),
        lambda n: (n == 1, False),
        TimeoutError,
    )
    return [
        tp.side_effect(
            StructuredTool.from_function(reserve_stock, description="Reserve the stock."),
            compensate=release,
        ),
        tp.side_effect(StructuredTool.from_function(print_label, description="Print a label.")),
        carrier.tool,
        mailer.tool,
    ]


def build_warehouse(cp: Any, service: FileService) -> Any:
    """The shipping agent on ``cp``."""
    model = testing.ScriptedModel(plan=SHIP_PLAN, answer=SHIP_ANSWER)
    return tp.create_recovery_agent(model, warehouse_tools(service), checkpointer=cp)


def stop_on_shipping(graph: Any, thread_id: str) -> None:
    """Run a shipment until it waits on a person about ``ship_parcel``."""
    result = graph.invoke(
        {"messages": [HumanMessage(SHIP_GOAL)]}, {"configurable": {"thread_id": thread_id}}
    )
    assert "__interrupt__" in result


WAREHOUSE_DB = "TASKPILOTS_TEST_WAREHOUSE_DB"
"""Environment variable naming the warehouse's service file for :func:`make_warehouse`."""


def make_warehouse(checkpointer: Any) -> Any:
    """The shipping agent as a ``--graph`` factory for the CLI (service file from the env)."""
    return build_warehouse(checkpointer, FileService(Path(os.environ[WAREHOUSE_DB])))
