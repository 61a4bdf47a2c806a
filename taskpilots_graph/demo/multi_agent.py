"""Three sub-agents over shared customer records, under one coordinator.

* **crm**: syncs the customer's tier into the CRM (a write on the shared record, undone by
  a compensator, taken under the business lock ``<customer>:crm_sync``);
* **ticketing**: opens the onboarding tickets, once the CRM is in sync;
* **notify**: tells the customer, once the tickets exist.

The simulated services keep their own state in a SQLite file outside the agents' process
and database (like a real CRM or help desk): what they did stays done when a worker is
killed, and every call and effect can be counted afterwards. Every effect has an
*identity* (what it is about); two effects with one identity are a duplicate.

Run it::

    python -m taskpilots_graph.demo.multi_agent
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, Literal

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import HumanMessage
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.graph.state import CompiledStateGraph

from taskpilots_graph.agent import create_recovery_agent
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.coordinator import Coordinator, create_coordinator
from taskpilots_graph.demo.workflow import _found
from taskpilots_graph.leases import LeaseBackend
from taskpilots_graph.testing import ScriptedModel
from taskpilots_graph.tools import invocation_key, side_effect

__all__ = [
    "SUBAGENTS",
    "CustomerServices",
    "build_coordinator",
    "build_subagents",
    "customer_tools",
    "inputs_for",
    "main",
]

Phase = Literal["before", "after"]

SUBAGENTS = ("crm", "ticketing", "notify")
DEPENDS_ON = {"ticketing": ["crm"], "notify": ["ticketing"]}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS customers (customer_id TEXT PRIMARY KEY, tier TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS effects (
    id INTEGER PRIMARY KEY AUTOINCREMENT, service TEXT NOT NULL, identity TEXT NOT NULL,
    request_key TEXT, payload TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS calls (service TEXT PRIMARY KEY, n INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS kill_points (
    id INTEGER PRIMARY KEY AUTOINCREMENT, service TEXT NOT NULL, phase TEXT NOT NULL
);
"""


class CustomerServices:
    """The simulated CRM, help desk and mailer, on one SQLite file of their own.

    Args:
        path: The services' database file.
        latency_s: How long each effect call takes (widens race windows in tests).
    """

    def __init__(self, path: str, *, latency_s: float = 0.0) -> None:
        self.path = path
        self.latency_s = latency_s
        with self._db() as db:
            db.executescript(_SCHEMA)

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path, timeout=30, isolation_level=None)) as db:
            db.execute("PRAGMA journal_mode=WAL")
            yield db

    # -- set-up and inspection ---------------------------------------------------------------

    def seed(self, customers: Mapping[str, str]) -> None:
        """Create customer records: ``{customer_id: tier}``."""
        with self._db() as db:
            db.executemany("INSERT OR REPLACE INTO customers VALUES (?, ?)", customers.items())

    def tier(self, customer_id: str) -> str:
        """The customer's tier in the CRM now."""
        with self._db() as db:
            row = db.execute(
                "SELECT tier FROM customers WHERE customer_id = ?", (customer_id,)
            ).fetchone()
        if row is None:
            raise LookupError(f"no customer {customer_id!r}")
        return str(row[0])

    def plant_kill(self, service: str, phase: Phase) -> None:
        """The next call of ``service`` SIGKILLs its process, before or after the effect."""
        with self._db() as db:
            db.execute("INSERT INTO kill_points (service, phase) VALUES (?, ?)", (service, phase))

    def pending_kills(self) -> int:
        """Kill points not yet triggered."""
        with self._db() as db:
            return int(db.execute("SELECT COUNT(*) FROM kill_points").fetchone()[0])

    def calls(self, service: str) -> int:
        """Calls ``service`` received (killed ones included)."""
        with self._db() as db:
            row = db.execute("SELECT n FROM calls WHERE service = ?", (service,)).fetchone()
        return int(row[0]) if row else 0

    def effects(self, service: str | None = None) -> list[dict[str, Any]]:
        """Performed effects, oldest first (of one service, or all)."""
        with self._db() as db:
            rows = db.execute(
                "SELECT service, identity, request_key, payload FROM effects "
                "WHERE ? IS NULL OR service = ? ORDER BY id",
                (service, service),
            ).fetchall()
        return [
            {"service": s, "identity": i, "request_key": k, **json.loads(p)} for s, i, k, p in rows
        ]

    def duplicates(self) -> int:
        """Effects performed more than once (same service and identity)."""
        with self._db() as db:
            row = db.execute(
                "SELECT COUNT(*) - COUNT(DISTINCT service || '|' || identity) FROM effects"
            ).fetchone()
        return int(row[0])

    # -- the calls the agents make -------------------------------------------------------------

    def _maybe_die(self, db: sqlite3.Connection, service: str, phase: Phase) -> None:
        row = db.execute(
            "SELECT id FROM kill_points WHERE service = ? AND phase = ? ORDER BY id LIMIT 1",
            (service, phase),
        ).fetchone()
        if row is not None:
            db.execute("DELETE FROM kill_points WHERE id = ?", row)  # fires once
            os.kill(os.getpid(), signal.SIGKILL)

    def _perform(
        self,
        service: str,
        identity: str,
        request_key: str | None,
        payload: dict[str, Any],
        update: tuple[str, tuple[Any, ...]] | None = None,
    ) -> str:
        with self._db() as db:
            db.execute(
                "INSERT INTO calls VALUES (?, 1) ON CONFLICT (service) DO UPDATE SET n = n + 1",
                (service,),
            )
            self._maybe_die(db, service, "before")
        if self.latency_s:
            time.sleep(self.latency_s)
        effect_id = f"{service}-{uuid.uuid4().hex[:8]}"
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            if update is not None:
                db.execute(*update)
            db.execute(
                "INSERT INTO effects (service, identity, request_key, payload) VALUES (?,?,?,?)",
                (service, identity, request_key, json.dumps({"id": effect_id, **payload})),
            )
            db.execute("COMMIT")
            self._maybe_die(db, service, "after")
        return effect_id

    def find(self, service: str, request_key: str) -> dict[str, Any] | None:
        """The effect a service performed under a request key, if any."""
        found = [e for e in self.effects(service) if e["request_key"] == request_key]
        return found[0] if found else None

    def crm_sync(self, customer_id: str, tier: str, request_key: str | None) -> str:
        """Write the customer's tier into the CRM record (remembers the previous one)."""
        previous = self.tier(customer_id)
        return self._perform(
            "crm_sync",
            f"{customer_id}:{tier}:{request_key}",
            request_key,
            {"customer_id": customer_id, "tier": tier, "previous": previous},
            ("UPDATE customers SET tier = ? WHERE customer_id = ?", (tier, customer_id)),
        )

    def crm_revert(self, request_key: str) -> None:
        """Undo the ``crm_sync`` made under ``request_key`` (a repeated undo does nothing)."""
        done = self.find("crm_sync", request_key)
        if done is None or self.find("crm_revert", request_key) is not None:
            return
        self._perform(
            "crm_revert",
            request_key,
            request_key,
            {"customer_id": done["customer_id"], "tier": done["previous"]},
            (
                "UPDATE customers SET tier = ? WHERE customer_id = ?",
                (done["previous"], done["customer_id"]),
            ),
        )

    def open_ticket(self, customer_id: str, subject: str, request_key: str | None) -> str:
        """Open a help-desk ticket (not idempotent)."""
        return self._perform(
            "open_ticket", f"{customer_id}:{subject}", request_key, {"subject": subject}
        )

    def notify(self, customer_id: str, message: str, request_key: str | None) -> str:
        """Email the customer; a repeated request key is ignored (idempotent service)."""
        if request_key is not None and (found := self.find("notify", request_key)):
            return str(found["id"])
        tier = self.tier(customer_id)
        return self._perform(
            "notify",
            f"{customer_id}:{message}:{tier}",
            request_key,
            {"message": message, "tier": tier},
        )

    def send_contract(self, customer_id: str, request_key: str | None) -> str:
        """Send the customer their contract (not idempotent: two would be a real incident)."""
        return self._perform("send_contract", customer_id, request_key, {})


def customer_tools(services: CustomerServices) -> dict[str, BaseTool]:
    """The tools of the three sub-agents, each effect declared with what makes it safe."""

    def crm_sync(customer_id: str, tier: str) -> str:
        """Write the customer's tier into the CRM."""
        return services.crm_sync(customer_id, tier, invocation_key())

    def read_customer(customer_id: str) -> str:
        """Read the customer's CRM record."""
        return services.tier(customer_id)

    def open_ticket(customer_id: str, subject: str) -> str:
        """Open a help-desk ticket for the customer."""
        return services.open_ticket(customer_id, subject, invocation_key())

    def notify(customer_id: str, message: str) -> str:
        """Email the customer."""
        return services.notify(customer_id, message, invocation_key())

    def send_contract(customer_id: str) -> str:
        """Send the customer their contract."""
        return services.send_contract(customer_id, invocation_key())

    def tool(fn: Any) -> BaseTool:
        return StructuredTool.from_function(fn)

    return {
        "crm_sync": side_effect(
            tool(crm_sync),
            precheck=lambda key, _a: _found(services.find("crm_sync", key)),
            compensate=lambda key, _a, _r: services.crm_revert(key),
            lock=lambda a: f"{a['customer_id']}:crm_sync",
        ),
        "read_customer": tool(read_customer),
        "open_ticket": side_effect(
            tool(open_ticket),
            precheck=lambda key, _a: _found(services.find("open_ticket", key)),
        ),
        "notify": side_effect(tool(notify), idempotent=True),
        # One contract per customer, whichever sub-agent gets there first: a business key
        # (global across threads) and a business lock on the customer.
        "send_contract": side_effect(
            tool(send_contract),
            key=lambda a: f"contract:{a['customer_id']}",
            lock=lambda a: f"{a['customer_id']}:contract",
            precheck=lambda key, _a: _found(services.find("send_contract", key)),
        ),
    }


def _plans(customer_id: str, tier: str) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    c = {"customer_id": customer_id}
    return {
        "crm": [("crm_sync", {**c, "tier": tier})],
        "ticketing": [
            ("read_customer", c),
            ("open_ticket", {**c, "subject": "Upgrade"}),
            ("open_ticket", {**c, "subject": "Welcome pack"}),
        ],
        "notify": [("notify", {**c, "message": "Your account was upgraded"})],
    }


def build_subagents(
    services: CustomerServices,
    checkpointer: RecoveryAPI,
    customer_id: str,
    *,
    tier: str = "gold",
    leases: LeaseBackend | None = None,
    lease_ttl: float = 30.0,
    models: Mapping[str, BaseChatModel] | None = None,
) -> dict[str, CompiledStateGraph[Any, Any, Any, Any]]:
    """The crm, ticketing and notify agents for one customer (scripted models by default)."""
    tools = customer_tools(services)
    plans = _plans(customer_id, tier)
    graphs = {}
    for name in SUBAGENTS:
        model = (models or {}).get(name) or ScriptedModel(plan=plans[name], answer=f"{name} done")
        used = [tools[t] for t in dict.fromkeys(step for step, _ in plans[name])]
        graphs[name] = create_recovery_agent(
            model, used, checkpointer=checkpointer, leases=leases, lease_ttl=lease_ttl, name=name
        )
    return graphs


def inputs_for(customer_id: str) -> dict[str, Any]:
    """Each sub-agent's input for one customer."""
    return {
        name: {"messages": [HumanMessage(f"{name} for customer {customer_id}")]}
        for name in SUBAGENTS
    }


def build_coordinator(
    services: CustomerServices,
    checkpointer: RecoveryAPI,
    customer_id: str,
    *,
    leases: LeaseBackend | None = None,
    lease_ttl: float = 30.0,
    **options: Any,
) -> Coordinator:
    """crm → ticketing → notify over the shared record of ``customer_id``."""
    graphs = build_subagents(
        services, checkpointer, customer_id, leases=leases, lease_ttl=lease_ttl
    )
    return create_coordinator(
        graphs,
        checkpointer=checkpointer,
        leases=leases,
        depends_on=DEPENDS_ON,
        shares={name: [customer_id] for name in SUBAGENTS},
        lease_ttl=lease_ttl,
        **options,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the coordination for one customer in a temporary folder and print the outcome."""
    import taskpilots_graph as tp
    from taskpilots_graph.locks import lease_backend_from_url

    del argv
    with tempfile.TemporaryDirectory() as tmp:
        services = CustomerServices(str(Path(tmp) / "services.db"))
        services.seed({"cust-1": "standard"})
        conn = f"sqlite:///{Path(tmp) / 'runs.db'}"
        with (
            tp.RecoveryCheckpointer.from_conn_string(conn) as cp,
            lease_backend_from_url(conn) as leases,
        ):
            cp.setup()
            coordinator = build_coordinator(services, cp, "cust-1", leases=leases)
            report = coordinator.run("onboarding-cust-1", inputs_for("cust-1"))
            for sub in report.subagents.values():
                print(f"{sub.name:<10} {sub.state:<8} thread={sub.thread_id}")
            print("parent log:")
            for event in cp.events("onboarding-cust-1"):
                detail = event.payload.get("subagent") or ""
                print(f"  {event.seq:>3} {event.kind:<16} {detail}")
        print("effects:", [f"{e['service']}:{e['identity']}" for e in services.effects()])
        print("duplicates:", services.duplicates(), "| crm tier now:", services.tier("cust-1"))
    return 0 if report.done else 1


if __name__ == "__main__":
    sys.exit(main())
