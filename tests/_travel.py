"""A travel desk the agent books for, and a model that reads only its conversation.

The travel desk is a simulated external service on its own SQLite file, outside the agent's
process and database: a booking made right before the agent process is SIGKILLed stays
made, and every booking can be counted afterwards. *Kill points* make the next booking of a
service SIGKILL its caller right after the booking is written, before the agent can record
it: the window in which an agent that runs the same command again books twice.

:class:`TravelModel` stands in for a chat model that decides *only* from the messages it
is handed (never from the library's summaries or state): for a booking request it books
each planned item whose booking has no successful answer in the conversation yet, then
confirms; any other message gets a plain answer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from typing import Any

from _models import RESUME_MESSAGE, ScriptedChatModel, tool_call
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import BaseTool, tool

import taskpilots_graph as tp

__all__ = [
    "REQUEST",
    "TRIP",
    "RateLimited",
    "TravelDesk",
    "TravelModel",
    "assert_valid_conversation",
    "travel_tools",
]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS bookings (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    service TEXT NOT NULL,
    request_key TEXT,
    args TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS kill_points (
    id INTEGER PRIMARY KEY AUTOINCREMENT, service TEXT NOT NULL
);
"""

REQUEST = "book my trip to Lisbon"
TRIP: list[tuple[str, dict[str, Any]]] = [
    ("book_flight", {"traveller": "ana", "flight": "TP1351"}),
    ("book_hotel", {"traveller": "ana", "city": "Lisbon", "nights": 3}),
]


class RateLimited(Exception):
    """The fare search answers HTTP 429 and asks for an hour: the run waits for it."""

    status_code = 429
    retry_after = 3600.0
    maybe_sent = False


class TravelDesk:
    """The simulated airline and hotel booking back office, on one SQLite file."""

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

    def plant_kill(self, service: str) -> None:
        """The next booking of ``service`` SIGKILLs its caller right after it is written."""
        with self._db() as db:
            db.execute("INSERT INTO kill_points (service) VALUES (?)", (service,))

    def pending_kills(self) -> int:
        with self._db() as db:
            return int(db.execute("SELECT COUNT(*) FROM kill_points").fetchone()[0])

    def book(self, service: str, key: str, args: dict[str, Any]) -> int:
        """Write one booking; returns its confirmation number."""
        with self._db() as db:
            cur = db.execute(
                "INSERT INTO bookings (service, request_key, args) VALUES (?, ?, ?)",
                (service, key, json.dumps(args, sort_keys=True)),
            )
            seq = int(cur.lastrowid or 0)
            row = db.execute(
                "SELECT id FROM kill_points WHERE service = ? ORDER BY id LIMIT 1", (service,)
            ).fetchone()
            if row is not None:
                # Consumed first, so the process that runs again does not die again.
                db.execute("DELETE FROM kill_points WHERE id = ?", row)
                os.kill(os.getpid(), signal.SIGKILL)
        return seq

    def find(self, service: str, key: str) -> int | None:
        with self._db() as db:
            row = db.execute(
                "SELECT seq FROM bookings WHERE service = ? AND request_key = ?", (service, key)
            ).fetchone()
        return None if row is None else int(row[0])

    def counts(self) -> dict[str, int]:
        """Bookings made, by service."""
        with self._db() as db:
            rows = db.execute("SELECT service, COUNT(*) FROM bookings GROUP BY service").fetchall()
        return {str(s): int(n) for s, n in rows}


def travel_tools(desk: TravelDesk) -> list[BaseTool]:
    """``find_fares`` (pure), ``book_flight`` and ``book_hotel`` (pre-check: the desk is
    searched by the invocation key), ``charge_card`` (neither: a person decides)."""

    @tool
    def find_fares(route: str) -> str:
        """Search fares for a route."""
        return f"{route}: TP1351 at 89 EUR"

    def flight_booked(key: str, args: dict[str, Any]) -> tp.Done | tp.NotDone:
        seq = desk.find("book_flight", key)
        return tp.NotDone() if seq is None else tp.Done(f"flight booked, PNR F{seq}", proof=seq)

    @tool
    def book_flight(traveller: str, flight: str) -> str:
        """Book a seat on a flight."""
        seq = desk.book("book_flight", tp.current_invocation().key, {"t": traveller, "f": flight})
        return f"flight booked, PNR F{seq}"

    def hotel_booked(key: str, args: dict[str, Any]) -> tp.Done | tp.NotDone:
        seq = desk.find("book_hotel", key)
        return tp.NotDone() if seq is None else tp.Done(f"hotel booked, ref H{seq}", proof=seq)

    @tool
    def book_hotel(traveller: str, city: str, nights: int) -> str:
        """Book a hotel room."""
        seq = desk.book(
            "book_hotel", tp.current_invocation().key, {"t": traveller, "c": city, "n": nights}
        )
        return f"hotel booked, ref H{seq}"

    @tool
    def charge_card(traveller: str, amount: int) -> str:
        """Charge the traveller's card."""
        seq = desk.book("charge_card", tp.current_invocation().key, {"t": traveller, "a": amount})
        return f"charged {amount} EUR, receipt C{seq}"

    return [
        find_fares,
        tp.side_effect(book_flight, precheck=flight_booked),
        tp.side_effect(book_hotel, precheck=hotel_booked),
        tp.side_effect(charge_card),
    ]


_FOLDED_OK = re.compile(r"^- (\w+)\((\{.*\})\) -> ok: ", re.MULTILINE)


def _succeeded(messages: Sequence[BaseMessage]) -> list[tuple[str, dict[str, Any]]]:
    """The tool calls of the conversation that got a successful answer, including those a
    context budget folded into the system message as ``- tool({args}) -> ok: ...`` lines."""
    answers = {
        m.tool_call_id: m for m in messages if isinstance(m, ToolMessage) and m.status != "error"
    }
    folded = [
        (name, json.loads(args))
        for m in messages
        if isinstance(m, SystemMessage)
        for name, args in _FOLDED_OK.findall(str(m.content))
    ]
    return folded + [
        (c["name"], dict(c["args"]))
        for m in messages
        if isinstance(m, AIMessage)
        for c in m.tool_calls
        if c["id"] in answers
    ]


class TravelModel(ScriptedChatModel):
    """Books the planned items for a booking request, deciding only from its messages."""

    plan: list[tuple[str, dict[str, Any]]]

    def decide(self, messages: list[BaseMessage]) -> AIMessage:
        users = [m for m in messages if isinstance(m, HumanMessage) and m.name != RESUME_MESSAGE]
        request = str(users[-1].content) if users else ""
        if not request.startswith("book"):
            return AIMessage(f"Noted: {request!r}. Nothing new to report.")
        done = _succeeded(messages)
        for name, args in self.plan:
            if (name, args) not in done:
                return tool_call(name, args)
        return AIMessage("Your trip is booked.")


def assert_valid_conversation(messages: Sequence[BaseMessage]) -> None:
    """Each tool call answered exactly once, before the next human or AI message."""
    open_calls: set[str] = set()
    for index, message in enumerate(messages):
        if isinstance(message, ToolMessage):
            assert message.tool_call_id in open_calls, (
                f"message {index} answers no open call: {message!r} in {messages!r}"
            )
            open_calls.discard(message.tool_call_id)
            continue
        assert not open_calls, f"calls {open_calls} unanswered before message {index}: {messages!r}"
        if isinstance(message, AIMessage):
            open_calls = {c["id"] or "" for c in message.tool_calls}
    assert not open_calls, f"calls {open_calls} unanswered at the end: {messages!r}"
