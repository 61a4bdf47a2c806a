"""A pharmacy the agent works for, and a model that reads only its conversation.

The pharmacy is a simulated external service on its own SQLite file (outside the agent's
process and database), so every dispensed dose, charge and patient message can be counted
after the agent is gone. Its tools are a domain the rest of the suite does not use.

:class:`ConversationModel` is a scripted stand-in for a chat model that, like LangGraph's
prebuilt agent style and most real models in long loops, decides *only* from the messages it
is handed: the next planned step is the first one whose tool has no answer (a
``ToolMessage`` of that tool) after the last user message. It never parses the library's
summaries, and never looks at the library's state.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import Any

from _models import RESUME_MESSAGE, ScriptedChatModel, tool_call
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, tool

import taskpilots_graph as tp

__all__ = ["PLAN", "ConversationModel", "Pharmacy", "pharmacy_tools"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    service TEXT NOT NULL,
    request_key TEXT,
    args TEXT NOT NULL
);
"""


class Pharmacy:
    """The simulated pharmacy back office: stock, dispensing, billing, patient messages."""

    def __init__(self, path: str) -> None:
        self.path = path
        with self._db() as db:
            db.executescript(_SCHEMA)

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path, timeout=30, isolation_level=None)) as db:
            db.execute("PRAGMA journal_mode=WAL")
            yield db

    def perform(self, service: str, key: str | None, args: dict[str, Any]) -> int:
        """Record one performed effect; returns its sequence number (the receipt)."""
        with self._db() as db:
            cur = db.execute(
                "INSERT INTO effects (service, request_key, args) VALUES (?, ?, ?)",
                (service, key, repr(sorted(args.items()))),
            )
            return int(cur.lastrowid or 0)

    def count(self, service: str) -> int:
        with self._db() as db:
            return int(
                db.execute("SELECT COUNT(*) FROM effects WHERE service = ?", (service,)).fetchone()[
                    0
                ]
            )

    def find(self, service: str, key: str) -> int | None:
        with self._db() as db:
            row = db.execute(
                "SELECT seq FROM effects WHERE service = ? AND request_key = ?", (service, key)
            ).fetchone()
        return None if row is None else int(row[0])


def pharmacy_tools(pharmacy: Pharmacy) -> list[BaseTool]:
    """``check_stock`` (pure), ``dispense`` (pre-check), ``charge_patient`` (business key,
    idempotent service) and ``message_patient`` (neither: a person decides if unsure)."""

    @tool
    def check_stock(drug: str) -> str:
        """How many packs of a drug are on the shelf."""
        return f"{drug}: 12 packs on the shelf"

    def dispensed(key: str, args: dict[str, Any]) -> tp.Done | tp.NotDone:
        seq = pharmacy.find("dispense", key)
        return tp.NotDone() if seq is None else tp.Done(f"dispensed, label #{seq}", proof=seq)

    @tool
    def dispense(patient: str, drug: str) -> str:
        """Dispense one pack of a drug to a patient."""
        seq = pharmacy.perform("dispense", tp.current_invocation().key, {"p": patient, "d": drug})
        return f"dispensed, label #{seq}"

    @tool
    def charge_patient(patient: str, amount: int) -> str:
        """Charge the patient's account."""
        seq = pharmacy.perform("charge", tp.current_invocation().key, {"p": patient, "a": amount})
        return f"charged {amount}, receipt #{seq}"

    @tool
    def message_patient(patient: str, text: str) -> str:
        """Send the patient a text message."""
        seq = pharmacy.perform("message", tp.current_invocation().key, {"p": patient, "t": text})
        return f"message #{seq} sent"

    return [
        check_stock,
        tp.side_effect(dispense, precheck=dispensed),
        tp.side_effect(
            charge_patient, key=lambda a: f"charge:{a['patient']}:{a['amount']}", idempotent=True
        ),
        tp.side_effect(message_patient),
    ]


PLAN: list[tuple[str, dict[str, Any]]] = [
    ("check_stock", {"drug": "amoxicillin"}),
    ("dispense", {"patient": "p-7", "drug": "amoxicillin"}),
    ("charge_patient", {"patient": "p-7", "amount": 18}),
    ("message_patient", {"patient": "p-7", "text": "your prescription is ready"}),
]


class ConversationModel(ScriptedChatModel):
    """Calls the planned tools in order, deciding only from the messages it receives."""

    plan: list[tuple[str, dict[str, Any]]]

    def decide(self, messages: list[BaseMessage]) -> AIMessage:
        # A resume note is context, not a new request (a real model reads it that way).
        last_user = max(
            (
                i
                for i, m in enumerate(messages)
                if isinstance(m, HumanMessage) and m.name != RESUME_MESSAGE
            ),
            default=-1,
        )
        answered = {m.name for m in messages[last_user + 1 :] if isinstance(m, ToolMessage)}
        for name, args in self.plan:
            if name not in answered:
                return tool_call(name, args)
        return AIMessage("all done")


def tool_answers(messages: list[BaseMessage]) -> dict[str, list[str]]:
    """The tool answers in one conversation, by tool name."""
    found: dict[str, list[str]] = {}
    for m in messages:
        if isinstance(m, ToolMessage):
            found.setdefault(str(m.name), []).append(str(m.content))
    return found
