"""Simulated external services for the ticket-batch demo and the crash drills.

They keep their own state in a SQLite file of their own, outside the agent's process and
database, exactly like a real CRM or help desk would: when the agent process is killed, what
the services did stays done, and duplicates can be counted afterwards.

Every performed effect is a row in ``effects`` with an *identity* (what the effect is about,
e.g. "ticket for order 17 of thread t-3"): two rows with one identity are a duplicate side
effect. ``crm_tag`` is idempotent by nature and ``issue_refund`` ignores a repeated
idempotency key, as payment APIs do; the others perform every call they receive.

Crash drills plant *kill points*: the next call of an operation kills the calling process
with SIGKILL, either before the effect is written or right after it (before the agent can
record the result): the window every at-least-once system repeats effects in.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Services"]

Phase = Literal["before", "after"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS customers (
    customer_id TEXT PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL, tier TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tags (customer_id TEXT NOT NULL, tag TEXT NOT NULL,
    PRIMARY KEY (customer_id, tag));
CREATE TABLE IF NOT EXISTS effects (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    service TEXT NOT NULL,
    identity TEXT NOT NULL,
    request_key TEXT,
    payload TEXT NOT NULL,
    ts REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS effects_key ON effects (service, request_key);
CREATE TABLE IF NOT EXISTS kill_points (
    id INTEGER PRIMARY KEY AUTOINCREMENT, service TEXT NOT NULL, phase TEXT NOT NULL, about TEXT
);
CREATE TABLE IF NOT EXISTS kills_fired (
    id INTEGER PRIMARY KEY AUTOINCREMENT, service TEXT NOT NULL, phase TEXT NOT NULL,
    identity TEXT NOT NULL, ts REAL NOT NULL
);
"""


@dataclass(frozen=True, slots=True)
class EffectCount:
    """How often one service performed effects, and how many of them were duplicates."""

    service: str
    performed: int
    duplicates: int


class Services:
    """The simulated CRM, help desk, mailer, approvals and payments, on one SQLite file.

    Args:
        path: The services' own database file.
        latency_s: Upper bound of the random delay of each call (spreads timed kills).
    """

    def __init__(self, path: str, *, latency_s: float = 0.004) -> None:
        self.path = path
        self.latency_s = latency_s
        with self._db() as db:
            db.executescript(_SCHEMA)

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path, timeout=30, isolation_level=None)) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            yield db

    # -- set-up and inspection ---------------------------------------------------------------

    def seed_customers(self, customers: list[dict[str, str]]) -> None:
        """Insert the customers the CRM knows."""
        with self._db() as db:
            db.executemany(
                "INSERT OR REPLACE INTO customers VALUES (:customer_id, :name, :email, :tier)",
                customers,
            )

    def plant_kill(self, service: str, phase: Phase, *, about: str | None = None) -> None:
        """Make the next call of ``service`` SIGKILL its caller, before or after the effect.

        Args:
            service: The operation whose call dies (``create_ticket``, ``crm_tag``, ...).
            phase: ``"before"`` the effect is written, or right ``"after"`` it.
            about: Only a call about this business object dies: an order id (``o003``) or,
                for ``crm_tag``, a customer id. Placing kills by business step, not by call
                count or wall time, makes a drill land on the same steps in every run and
                in every mode, whatever the machine's load.
        """
        with self._db() as db:
            db.execute(
                "INSERT INTO kill_points (service, phase, about) VALUES (?, ?, ?)",
                (service, phase, about),
            )

    def pending_kills(self) -> int:
        """Kill points not yet triggered."""
        with self._db() as db:
            return int(db.execute("SELECT COUNT(*) FROM kill_points").fetchone()[0])

    def kills_fired(self) -> list[tuple[str, Phase, str]]:
        """``(service, phase, identity)`` of every kill point that fired, oldest first."""
        with self._db() as db:
            rows = db.execute("SELECT service, phase, identity FROM kills_fired ORDER BY id")
            return [(service, phase, identity) for service, phase, identity in rows]

    def effect_counts(self) -> list[EffectCount]:
        """Per service: effects performed and duplicates (same identity more than once)."""
        with self._db() as db:
            rows = db.execute(
                "SELECT service, COUNT(*), COUNT(*) - COUNT(DISTINCT identity) "
                "FROM effects GROUP BY service ORDER BY service"
            ).fetchall()
        return [EffectCount(service, performed, dups) for service, performed, dups in rows]

    def effects(self) -> list[dict[str, Any]]:
        """Every effect row, oldest first."""
        with self._db() as db:
            rows = db.execute(
                "SELECT service, identity, request_key, payload FROM effects ORDER BY id"
            ).fetchall()
        return [
            {"service": s, "identity": i, "request_key": k, "payload": json.loads(p)}
            for s, i, k, p in rows
        ]

    # -- the calls an agent makes --------------------------------------------------------------

    def _maybe_die(self, db: sqlite3.Connection, service: str, phase: Phase, identity: str) -> None:
        # An identity is "<order or customer id>:<what>"; substr, not LIKE, so that an id
        # holding "%" or "_" matches only itself.
        row = db.execute(
            "SELECT id FROM kill_points WHERE service = ? AND phase = ? "
            "AND (about IS NULL OR substr(?, 1, length(about) + 1) = about || ':') "
            "ORDER BY id LIMIT 1",
            (service, phase, identity),
        ).fetchone()
        if row is not None:
            # Consume the kill point first, so the process that resumes does not die again;
            # the record of where it fired lets the drill say where its worker died.
            db.execute("DELETE FROM kill_points WHERE id = ?", row)
            db.execute(
                "INSERT INTO kills_fired (service, phase, identity, ts) VALUES (?, ?, ?, ?)",
                (service, phase, identity, time.time()),
            )
            os.kill(os.getpid(), signal.SIGKILL)

    def _pause(self) -> None:
        if self.latency_s > 0:
            time.sleep(random.uniform(0, self.latency_s))

    def _perform(
        self, service: str, identity: str, request_key: str | None, payload: dict[str, Any]
    ) -> str:
        self._pause()
        with self._db() as db:
            self._maybe_die(db, service, "before", identity)
            effect_id = f"{service}-{uuid.uuid4().hex[:10]}"
            db.execute(
                "INSERT INTO effects (service, identity, request_key, payload, ts) "
                "VALUES (?, ?, ?, ?, ?)",
                (
                    service,
                    identity,
                    request_key,
                    json.dumps({"id": effect_id, **payload}),
                    time.time(),
                ),
            )
            self._maybe_die(db, service, "after", identity)
        return effect_id

    def _find(self, service: str, request_key: str) -> dict[str, Any] | None:
        with self._db() as db:
            row = db.execute(
                "SELECT payload FROM effects WHERE service = ? AND request_key = ? "
                "ORDER BY id LIMIT 1",
                (service, request_key),
            ).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def crm_lookup(self, customer_id: str) -> dict[str, str]:
        """Read a customer record (no side effect)."""
        self._pause()
        with self._db() as db:
            row = db.execute(
                "SELECT customer_id, name, email, tier FROM customers WHERE customer_id = ?",
                (customer_id,),
            ).fetchone()
        if row is None:
            raise LookupError(f"no customer {customer_id!r}")
        return dict(zip(("customer_id", "name", "email", "tier"), row, strict=True))

    def crm_tag(self, customer_id: str, tag: str, request_key: str | None) -> str:
        """Tag a customer; tagging twice changes nothing (idempotent by nature)."""
        identity = f"{customer_id}:{tag}"
        with self._db() as db:
            row = db.execute(
                "SELECT payload FROM effects WHERE service = 'crm_tag' AND identity = ?",
                (identity,),
            ).fetchone()
        if row is not None:
            return str(json.loads(row[0])["id"])
        return self._perform(
            "crm_tag", identity, request_key, {"customer_id": customer_id, "tag": tag}
        )

    def create_ticket(self, identity: str, subject: str, request_key: str | None) -> str:
        """Open a help-desk ticket (not idempotent)."""
        return self._perform("create_ticket", identity, request_key, {"subject": subject})

    def find_ticket(self, request_key: str) -> dict[str, Any] | None:
        """Search tickets by the request key they were created with."""
        return self._find("create_ticket", request_key)

    def send_email(self, identity: str, to: str, subject: str, request_key: str | None) -> str:
        """Send an email (not idempotent)."""
        return self._perform("send_email", identity, request_key, {"to": to, "subject": subject})

    def find_email(self, request_key: str) -> dict[str, Any] | None:
        """Search the sent mailbox by request key."""
        return self._find("send_email", request_key)

    def request_approval(self, identity: str, amount: float, request_key: str | None) -> str:
        """Ask a manager to approve a refund (not idempotent, cannot be searched)."""
        return self._perform("request_approval", identity, request_key, {"amount": amount})

    def issue_refund(self, identity: str, amount: float, request_key: str | None) -> str:
        """Refund an order; a repeated idempotency key is ignored, as payment APIs do."""
        if request_key is not None and (found := self._find("issue_refund", request_key)):
            return str(found["id"])
        return self._perform("issue_refund", identity, request_key, {"amount": amount})
