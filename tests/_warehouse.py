"""A warehouse the picker, packer and shipper sub-agents work for, over one order.

The warehouse is a simulated external service on its own SQLite file, outside the agents'
process and database: what it did stays done when a process is SIGKILLed, and every effect
and every undo can be counted afterwards (the "World counts"). Each effect is recorded with
the request key it was asked under; an undo is recorded once per key (the services dedup a
repeated undo, as a real one would by its request id).

* ``reserve_stock`` (undone by ``release_stock``), ``pack_order`` (cannot be undone: the
  parcel is sealed), ``book_carrier`` (undone by ``cancel_booking``), ``print_label``;
  each has a pre-check by request key and a ``lock=`` on the order, so the coordinator
  knows which shared object each effect changed; each undo has a pre-check too
  (``compensate_precheck``: was the effect under this key undone?).
* *Faults* make the next call of a service refuse before acting (the label printer jams);
  *kill points* SIGKILL the calling process at a given call of a service, before or after
  its effect is written.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import Any, Literal

from langchain_core.messages import HumanMessage
from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp

__all__ = [
    "ORDER",
    "PLANS",
    "SUBAGENTS",
    "PrinterJam",
    "Warehouse",
    "order_inputs",
    "warehouse_tools",
]

Phase = Literal["before", "after"]

ORDER = "order-1"
SUBAGENTS = ("picker", "packer", "shipper")
PLANS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "picker": [("reserve_stock", {"order_id": ORDER, "sku": "SKU-7", "qty": 2})],
    "packer": [("pack_order", {"order_id": ORDER, "box": "M"})],
    "shipper": [
        ("book_carrier", {"order_id": ORDER, "carrier": "DHL"}),
        ("print_label", {"order_id": ORDER}),
    ],
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    id INTEGER PRIMARY KEY AUTOINCREMENT, service TEXT NOT NULL, request_key TEXT NOT NULL,
    payload TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS undos (
    id INTEGER PRIMARY KEY AUTOINCREMENT, service TEXT NOT NULL, request_key TEXT NOT NULL,
    UNIQUE (service, request_key)
);
CREATE TABLE IF NOT EXISTS calls (service TEXT PRIMARY KEY, n INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS faults (id INTEGER PRIMARY KEY AUTOINCREMENT, service TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS kill_points (
    id INTEGER PRIMARY KEY AUTOINCREMENT, service TEXT NOT NULL, phase TEXT NOT NULL,
    at_call INTEGER NOT NULL
);
"""

_UNDO_OF = {"release_stock": "reserve_stock", "cancel_booking": "book_carrier"}


class PrinterJam(Exception):
    """The label printer refused the job before printing: nothing happened, and retrying
    this run will not clear the jam."""

    failure_kind = "fatal"
    maybe_sent = False


class Warehouse:
    """Stock, packing, carriers and labels, on one SQLite file of their own."""

    def __init__(self, path: str) -> None:
        self.path = path
        with self._db() as db:
            db.executescript(_SCHEMA)

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path, timeout=30, isolation_level=None)) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            yield db

    # -- set-up ------------------------------------------------------------------------------

    def plant_fault(self, service: str) -> None:
        """The next call of ``service`` is refused before it acts (:class:`PrinterJam`)."""
        with self._db() as db:
            db.execute("INSERT INTO faults (service) VALUES (?)", (service,))

    def plant_kill(self, service: str, phase: Phase, *, at_call: int = 1) -> None:
        """Call number ``at_call`` of ``service`` SIGKILLs its caller, before or after the
        effect is written (fires once)."""
        with self._db() as db:
            db.execute(
                "INSERT INTO kill_points (service, phase, at_call) VALUES (?, ?, ?)",
                (service, phase, at_call),
            )

    def pending_kills(self) -> int:
        with self._db() as db:
            return int(db.execute("SELECT COUNT(*) FROM kill_points").fetchone()[0])

    def maybe_die(self, service: str, phase: Phase = "before") -> None:
        """SIGKILL this process if a kill point of ``service`` is due (also a test hook)."""
        with self._db() as db:
            self._die_if_due(db, service, phase)

    # -- World counts ------------------------------------------------------------------------

    def calls(self, service: str) -> int:
        """Calls ``service`` received (refused and killed ones included)."""
        with self._db() as db:
            row = db.execute("SELECT n FROM calls WHERE service = ?", (service,)).fetchone()
        return int(row[0]) if row else 0

    def performed(self, service: str) -> list[str]:
        """Request keys of the effects ``service`` performed, oldest first."""
        with self._db() as db:
            rows = db.execute(
                "SELECT request_key FROM effects WHERE service = ? ORDER BY id", (service,)
            ).fetchall()
        return [str(r[0]) for r in rows]

    def undone(self, service: str) -> list[str]:
        """Request keys of ``service``'s effects that were undone, in undo order."""
        undo = {v: k for k, v in _UNDO_OF.items()}[service]
        with self._db() as db:
            rows = db.execute(
                "SELECT request_key FROM undos WHERE service = ? ORDER BY id", (undo,)
            ).fetchall()
        return [str(r[0]) for r in rows]

    def active(self, service: str) -> int:
        """Effects of ``service`` that stand (performed and not undone)."""
        undone = set(self.undone(service)) if service in _UNDO_OF.values() else set()
        return sum(1 for key in self.performed(service) if key not in undone)

    def repeated_keys(self) -> int:
        """Effects performed twice under one request key, over every service."""
        with self._db() as db:
            row = db.execute(
                "SELECT COUNT(*) - COUNT(DISTINCT service || '|' || request_key) FROM effects"
            ).fetchone()
        return int(row[0])

    # -- the calls the agents make -----------------------------------------------------------

    def _die_if_due(self, db: sqlite3.Connection, service: str, phase: Phase) -> None:
        row = db.execute("SELECT n FROM calls WHERE service = ?", (service,)).fetchone()
        n = int(row[0]) if row else 0
        due = db.execute(
            "SELECT id FROM kill_points WHERE service = ? AND phase = ? AND at_call <= ? "
            "ORDER BY id LIMIT 1",
            (service, phase, max(n, 1)),
        ).fetchone()
        if due is not None:
            # Consumed first, so the process that runs again does not die again.
            db.execute("DELETE FROM kill_points WHERE id = ?", due)
            os.kill(os.getpid(), signal.SIGKILL)

    def _call(self, service: str) -> None:
        with self._db() as db:
            db.execute(
                "INSERT INTO calls VALUES (?, 1) ON CONFLICT (service) DO UPDATE SET n = n + 1",
                (service,),
            )
            self._die_if_due(db, service, "before")
            fault = db.execute(
                "SELECT id FROM faults WHERE service = ? ORDER BY id LIMIT 1", (service,)
            ).fetchone()
            if fault is not None:
                db.execute("DELETE FROM faults WHERE id = ?", fault)
                raise PrinterJam(f"{service}: the printer jammed before printing")

    def _perform(self, service: str, key: str, payload: dict[str, Any]) -> str:
        self._call(service)
        with self._db() as db:
            cur = db.execute(
                "INSERT INTO effects (service, request_key, payload) VALUES (?, ?, ?)",
                (service, key, json.dumps(payload, sort_keys=True)),
            )
            ref = f"{service.split('_')[0].upper()}-{cur.lastrowid}"
            self._die_if_due(db, service, "after")
        return ref

    def _undo(self, service: str, key: str) -> None:
        self._call(service)
        with self._db() as db:
            # Deduplicated by request key: undoing one effect twice undoes it once.
            db.execute(
                "INSERT INTO undos (service, request_key) VALUES (?, ?) ON CONFLICT DO NOTHING",
                (service, key),
            )
            self._die_if_due(db, service, "after")

    def find(self, service: str, key: str) -> str | None:
        """The reference of the effect ``service`` performed under ``key``, if any."""
        with self._db() as db:
            row = db.execute(
                "SELECT id FROM effects WHERE service = ? AND request_key = ?", (service, key)
            ).fetchone()
        return None if row is None else f"{service.split('_')[0].upper()}-{row[0]}"

    def was_undone(self, undo: str, key: str) -> bool:
        """Whether ``undo`` (``release_stock``, ``cancel_booking``) undid the effect ``key``."""
        with self._db() as db:
            row = db.execute(
                "SELECT 1 FROM undos WHERE service = ? AND request_key = ?", (undo, key)
            ).fetchone()
        return row is not None

    def reserve_stock(self, order_id: str, sku: str, qty: int, key: str) -> str:
        return self._perform("reserve_stock", key, {"order": order_id, "sku": sku, "qty": qty})

    def release_stock(self, key: str) -> None:
        self._undo("release_stock", key)

    def pack_order(self, order_id: str, box: str, key: str) -> str:
        return self._perform("pack_order", key, {"order": order_id, "box": box})

    def book_carrier(self, order_id: str, carrier: str, key: str) -> str:
        return self._perform("book_carrier", key, {"order": order_id, "carrier": carrier})

    def cancel_booking(self, key: str) -> None:
        self._undo("cancel_booking", key)

    def print_label(self, order_id: str, key: str) -> str:
        return self._perform("print_label", key, {"order": order_id})


def warehouse_tools(world: Warehouse, *, undo_prechecks: bool = True) -> dict[str, BaseTool]:
    """The sub-agents' tools, each effect declared with a pre-check and a lock on its order
    (default invocation keys: no business key helps a re-run here); without
    ``undo_prechecks`` nothing can tell whether an interrupted undo happened."""

    def key() -> str:
        return tp.current_invocation().key

    def reserve_stock(order_id: str, sku: str, qty: int) -> str:
        """Reserve stock for an order."""
        return world.reserve_stock(order_id, sku, qty, key())

    def pack_order(order_id: str, box: str) -> str:
        """Pack and seal an order's parcel."""
        return world.pack_order(order_id, box, key())

    def book_carrier(order_id: str, carrier: str) -> str:
        """Book a carrier pick-up for an order."""
        return world.book_carrier(order_id, carrier, key())

    def print_label(order_id: str) -> str:
        """Print the shipping label of an order."""
        return world.print_label(order_id, key())

    def precheck(service: str) -> Any:
        def check(k: str, _args: dict[str, Any]) -> tp.Done | tp.NotDone:
            ref = world.find(service, k)
            return tp.NotDone() if ref is None else tp.Done(ref, proof=ref)

        return check

    def undo_precheck(undo: str) -> Any:
        # Asked when an undo was interrupted (a crash inside the compensator): the World
        # says whether it happened, so the undo is neither lost nor run twice.
        if not undo_prechecks:
            return None

        def check(k: str, _args: dict[str, Any], _result: Any) -> tp.Done | tp.NotDone:
            return tp.Done(None, proof=undo) if world.was_undone(undo, k) else tp.NotDone()

        return check

    def lock(operation: str) -> Any:
        return lambda a: f"{a['order_id']}:{operation}"

    def declare(fn: Any, operation: str, **kw: Any) -> BaseTool:
        tool = StructuredTool.from_function(fn)
        return tp.side_effect(tool, precheck=precheck(fn.__name__), lock=lock(operation), **kw)

    return {
        "reserve_stock": declare(
            reserve_stock,
            "reserve",
            compensate=lambda k, _a, _r: world.release_stock(k),
            compensate_precheck=undo_precheck("release_stock"),
        ),
        "pack_order": declare(pack_order, "pack"),
        "book_carrier": declare(
            book_carrier,
            "ship",
            compensate=lambda k, _a, _r: world.cancel_booking(k),
            compensate_precheck=undo_precheck("cancel_booking"),
        ),
        "print_label": declare(print_label, "label"),
    }


def order_inputs() -> dict[str, Any]:
    """Each sub-agent's input for the order."""
    return {n: {"messages": [HumanMessage(f"{n}: handle {ORDER}")]} for n in SUBAGENTS}
