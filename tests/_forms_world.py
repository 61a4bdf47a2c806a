"""A simulated external service for the differential test of the two agent forms.

The service keeps its state in a SQLite file of its own, outside the agent's process and
database: every call it receives is a row (tool, arguments, request key, what it did), so
calls can be counted after the agent's process is gone, and a SIGKILLed process leaves
behind exactly what a real service would have done. Each scenario *scripts* the service
per tool and call number, before the run starts:

* ``"ok"``: answer normally;
* ``"reset"``, ``"refused"``, ``"jammed"``, ``"garbled"``: fail before acting (a reset
  connection, a carrier API that is down, a label printer that jammed, an answer the tool
  cannot read);
* ``"lost"``: act, then lose the reply (``TimeoutError``: the effect happened, the caller
  cannot know it);
* ``"crash"``: act, then raise :class:`Crash` (the process dying, in process);
* ``"kill"``: act, then SIGKILL the calling process before it can hear the answer.

A read answers with the current value of a named entry (:meth:`World.set_value`), so a test
can make the same call answer differently when it runs again (drift).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any

from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph.errors import ConfigurationError

__all__ = ["Crash", "Jammed", "Unreadable", "World", "world_tools"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY AUTOINCREMENT, tool TEXT NOT NULL, args TEXT NOT NULL,
    request_key TEXT, outcome TEXT NOT NULL, answered INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS script (
    tool TEXT NOT NULL, at_call INTEGER NOT NULL, action TEXT NOT NULL,
    PRIMARY KEY (tool, at_call)
);
CREATE TABLE IF NOT EXISTS undos (
    id INTEGER PRIMARY KEY AUTOINCREMENT, tool TEXT NOT NULL, request_key TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS vals (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class Crash(BaseException):
    """The agent's process dies here: not an ``Exception``, so nothing in the agent handles
    it, and the run stops as a dying process would leave it."""


class Jammed(Exception):
    """The label printer jammed before printing; the user's rules call this fatal."""


class Unreadable(Exception):
    """The service answered in a shape the tool does not understand (the user's rules call
    this a contract failure: retrying the same call cannot help)."""


_FAILURES: dict[str, Callable[[str], BaseException]] = {
    "reset": lambda tool: ConnectionResetError(f"{tool}: connection reset by peer"),
    "refused": lambda tool: ConnectionRefusedError(f"{tool}: the API is down"),
    "jammed": lambda tool: Jammed(f"{tool}: the printer jammed"),
    "garbled": lambda tool: Unreadable(f"{tool}: the answer is not JSON"),
}


def _reference(db: sqlite3.Connection, tool: str, row_id: int) -> str:
    """The reference the service gives the effect of call ``row_id``: numbered per tool, so
    that it does not depend on the order in which calls of other tools arrived (the
    middleware form runs one message's calls concurrently)."""
    query = "SELECT COUNT(*) FROM calls WHERE tool = ? AND id <= ?"
    return f"{tool}-{db.execute(query, (tool, row_id)).fetchone()[0]}"


class World:
    """The service, on one SQLite file of its own (WAL, synchronous: survives SIGKILL)."""

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

    def script(self, tool: str, *actions: str) -> None:
        """The first calls of ``tool`` do ``actions`` in order; later calls answer normally."""
        with self._db() as db:
            db.executemany(
                "INSERT OR REPLACE INTO script (tool, at_call, action) VALUES (?, ?, ?)",
                [(tool, n, action) for n, action in enumerate(actions, start=1)],
            )

    def set_value(self, name: str, value: Any) -> None:
        """What a read of ``name`` answers from now on."""
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO vals (name, value) VALUES (?, ?)", (name, json.dumps(value))
            )

    # -- what the service saw ----------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Calls received per tool (failed and killed ones included) and undos per tool."""
        with self._db() as db:
            rows = db.execute("SELECT tool, COUNT(*) FROM calls GROUP BY tool").fetchall()
            undone = db.execute("SELECT tool, COUNT(*) FROM undos GROUP BY tool").fetchall()
        return {str(t): int(n) for t, n in rows} | {f"undo {t}": int(n) for t, n in undone}

    def outcomes(self, tool: str) -> list[str]:
        """What each call of ``tool`` did, oldest first."""
        with self._db() as db:
            rows = db.execute("SELECT outcome FROM calls WHERE tool = ? ORDER BY id", (tool,))
            return [str(r[0]) for r in rows.fetchall()]

    def find(self, tool: str, key: str) -> str | None:
        """The reference of the effect ``tool`` made under request ``key``, if any."""
        with self._db() as db:
            row = db.execute(
                "SELECT id FROM calls WHERE tool = ? AND request_key = ? "
                "AND outcome IN ('ok', 'lost', 'crash', 'kill') ORDER BY id LIMIT 1",
                (tool, key),
            ).fetchone()
            return None if row is None else _reference(db, tool, int(row[0]))

    # -- the calls the tools make ------------------------------------------------------------

    def call(self, tool: str, args: dict[str, Any], key: str | None) -> str:
        """One call of ``tool``: recorded first, then done as the script says."""
        with self._db() as db:
            n = 1 + int(
                db.execute("SELECT COUNT(*) FROM calls WHERE tool = ?", (tool,)).fetchone()[0]
            )
            row = db.execute(
                "SELECT action FROM script WHERE tool = ? AND at_call = ?", (tool, n)
            ).fetchone()
            action = "ok" if row is None else str(row[0])
            cur = db.execute(
                "INSERT INTO calls (tool, args, request_key, outcome) VALUES (?, ?, ?, ?)",
                (tool, json.dumps(args, sort_keys=True), key, action),
            )
            ref = _reference(db, tool, int(cur.lastrowid or 0))
        if action in _FAILURES:
            raise _FAILURES[action](tool)
        if action == "lost":
            raise TimeoutError(f"{tool}: the reply never came")
        if action == "crash":
            self._others_answered(ref)
            raise Crash(f"{tool}: the process died")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        with self._db() as db:
            db.execute("UPDATE calls SET answered = 1 WHERE id = ?", (cur.lastrowid,))
        return ref

    def _others_answered(self, ref: str) -> None:
        """Wait until every other call received so far was answered, and a moment more.

        The agent may run the calls of one model message concurrently; a crash is meant to
        come after the other calls' answers reached the agent, in every form, so what the
        resumed run finds does not depend on thread timing.
        """
        deadline = time.monotonic() + 10
        with self._db() as db:
            while db.execute(
                "SELECT COUNT(*) FROM calls WHERE answered = 0 AND outcome = 'ok'"
            ).fetchone()[0]:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{ref}: the other calls were never answered")
                time.sleep(0.01)
        time.sleep(0.5)  # the agent records the answers it got (a tool task's write)

    def read(self, tool: str, name: str) -> Any:
        """A read: recorded like any call, answers the current value of ``name``."""
        self.call(tool, {"name": name}, None)
        with self._db() as db:
            row = db.execute("SELECT value FROM vals WHERE name = ?", (name,)).fetchone()
        return None if row is None else json.loads(row[0])

    def undo(self, tool: str, key: str) -> None:
        """Undo the effect ``tool`` made under request ``key`` (counted per tool)."""
        with self._db() as db:
            db.execute("INSERT INTO undos (tool, request_key) VALUES (?, ?)", (tool, key))


def _key() -> str | None:
    try:
        return tp.current_invocation().key
    except ConfigurationError:  # no invocation in view: the call goes without a request key
        return None


def world_tools(world: World) -> dict[str, BaseTool]:
    """Every tool a scenario may give the model, each a thin client of ``world``."""

    def lookup(sku: str) -> str:
        """Look a product up."""
        return world.call("lookup", {"sku": sku}, _key())

    def quote_primary(weight: int) -> str:
        """Quote a carrier price."""
        return world.call("quote_primary", {"weight": weight}, _key())

    def quote_backup(weight: int) -> str:
        """Quote a carrier price from the backup carrier."""
        return world.call("quote_backup", {"weight": weight}, _key())

    def print_label(order: str) -> str:
        """Print a shipping label."""
        return world.call("print_label", {"order": order}, _key())

    def read_feed(feed: str) -> str:
        """Read a supplier's stock feed."""
        return world.call("read_feed", {"feed": feed}, _key())

    def get_price(sku: str) -> Any:
        """The current price of a product."""
        return world.read("get_price", f"price:{sku}")

    def book_courier(order: str) -> str:
        """Book a courier for an order."""
        return world.call("book_courier", {"order": order}, _key())

    def refund(order: str, amount: int) -> str:
        """Refund an order."""
        return world.call("refund", {"order": order, "amount": amount}, _key())

    def checked_refund(order: str, amount: int) -> str:
        """Refund an order (the payment service can be searched by request key)."""
        return world.call("checked_refund", {"order": order, "amount": amount}, _key())

    def found(tool: str) -> Callable[[str, dict[str, Any]], tp.Done | tp.NotDone]:
        # The service can be asked whether an effect under a request key happened: what a
        # resumed run uses to settle an effect it cannot remember the answer to.
        def check(key: str, _args: dict[str, Any]) -> tp.Done | tp.NotDone:
            ref = world.find(tool, key)
            return tp.NotDone() if ref is None else tp.Done(ref, proof=ref)

        return check

    plain = {
        fn.__name__: StructuredTool.from_function(fn)
        for fn in (lookup, quote_primary, quote_backup, print_label, read_feed, get_price)
    }
    return {
        **plain,
        "book_courier": tp.side_effect(
            StructuredTool.from_function(book_courier),
            compensate=lambda key, _args, _result: world.undo("book_courier", key),
        ),
        "refund": tp.side_effect(StructuredTool.from_function(refund)),
        "checked_refund": tp.side_effect(
            StructuredTool.from_function(checked_refund),
            precheck=found("checked_refund"),
        ),
    }
