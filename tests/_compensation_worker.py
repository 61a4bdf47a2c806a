"""A worker process for the compensation crash drills (``tests/test_compensation.py``).

Run as ``python tests/_compensation_worker.py FORM PRECHECK ACTION DB SERVICES THREAD`` where

* ``FORM`` is ``agent`` (``tp.create_recovery_agent``), ``middleware`` (langchain
  ``create_agent`` with ``RecoveryMiddleware``) or ``coordinator`` (the coordinator's
  entry point ``compensate_effect``, undoing a sub-agent's effect on behalf of the parent
  thread ``THREAD/parent``);
* ``PRECHECK`` is ``precheck`` (the compensator has an undo pre-check) or ``none``;
* ``ACTION`` is ``start`` (run the goal until the takeover: the ticket is committed, the
  charge is uncertain), ``decide:<action>`` (answer the pending takeover with ``tp.decide``),
  ``resume`` (``tp.resume``) or, for ``coordinator``, ``undo`` (compensate the ticket).

The agent opens a help-desk ticket (``open_ticket``, compensator: a cancellation e-mail, not
idempotent: every call sends one more), then charges a card (``charge``: acts, then times
out; no pre-check, so its outcome is uncertain and the run stops for a person). The
simulated services live in their own SQLite file: a kill point planted on ``send_email``
SIGKILLs the worker right after the cancellation reached the service, before the ledger
could record the undo. The undo pre-check searches the sent mailbox for that cancellation.

Prints one JSON line describing where the thread stands.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from langchain_core.tools import BaseTool, tool

import taskpilots_graph as tp
from taskpilots_graph.demo.services import Services
from taskpilots_graph.ledger import CompensationUncertain
from taskpilots_graph.nodes.compensate import compensate_effect
from taskpilots_graph.tools import spec_of

sys.path.insert(0, str(Path(__file__).parent))
from _models import PlanModel

CANCEL_TO = "desk@example.com"
FAST = tp.ToolPolicy(max_attempts=2, backoff=tp.Backoff(initial=0.01, jitter=False))


def cancellations(services: Services, ticket: str) -> int:
    """Cancellation e-mails the help desk received for ``ticket``."""
    return sum(
        e["service"] == "send_email" and e["identity"] == f"{ticket}:cancel"
        for e in services.effects()
    )


def ticket_tool(services: Services, *, precheck: bool) -> BaseTool:
    """``open_ticket``: compensated by a cancellation e-mail (one more per call)."""

    def cancel(key: str, args: dict[str, Any], result: Any) -> str:
        undo = tp.current_invocation().key  # "undo:<key>": the undo's own idempotency key
        return services.send_email(f"{result}:cancel", CANCEL_TO, f"cancel {result}", undo)

    def cancelled(key: str, args: dict[str, Any], result: Any) -> tp.Done | tp.NotDone:
        # Asked by the effect's identity (its ticket id), as a help desk would be.
        sent = cancellations(services, str(result))
        return tp.Done(f"cancelled {result}", proof=sent) if sent else tp.NotDone()

    @tool
    def open_ticket(subject: str) -> str:
        """Open a help-desk ticket."""
        return services.create_ticket(subject, subject, tp.current_invocation().key)

    return tp.side_effect(
        open_ticket, compensate=cancel, compensate_precheck=cancelled if precheck else None
    )


def charge_tool(services: Services) -> BaseTool:
    """``charge``: reaches the card processor, then times out (no pre-check: uncertain)."""

    @tool
    def charge(amount: float) -> str:
        """Charge the customer's card."""
        inv = tp.current_invocation()
        services.request_approval(f"{inv.thread_id}:charge", amount, inv.key)
        raise TimeoutError("the card processor did not answer")

    return tp.side_effect(charge)


def build(form: str, cp: Any, services: Services, *, precheck: bool) -> Any:
    """The graph under test; the same model, tools and services for every form."""
    tools = [ticket_tool(services, precheck=precheck), charge_tool(services)]
    model = PlanModel(plan=[("open_ticket", {"subject": "$msg"}), ("charge", {"amount": 5.0})])
    if form in ("agent", "coordinator"):
        return tp.create_recovery_agent(model, tools, checkpointer=cp)
    if form == "middleware":
        from langchain.agents import create_agent

        from taskpilots_graph.middleware import RecoveryMiddleware

        return create_agent(
            model, tools, checkpointer=cp, middleware=[RecoveryMiddleware(cp, default_policy=FAST)]
        )
    raise SystemExit(f"unknown form {form!r}")


def _where(graph: Any, cp: Any, thread: str) -> dict[str, Any]:
    state = graph.get_state({"configurable": {"thread_id": thread}})
    messages = state.values.get("messages") or []
    return {
        "stage": (state.values.get("flow") or {}).get("stage"),
        "last": str(messages[-1].content) if messages else None,
        "takeovers": [
            t.model_dump(mode="json") for t in tp.pending_takeovers(cp, thread_ids=[thread])
        ],
    }


def _undo(cp: Any, graph: Any, thread: str, services: Services, precheck: bool) -> dict[str, Any]:
    """The coordinator's step: undo the sub-agent's committed ticket for the parent."""
    (entry,) = [e for e in cp.ledger(thread) if e.tool == "open_ticket"]
    spec = spec_of(ticket_tool(services, precheck=precheck))
    assert spec is not None
    try:
        outcome = compensate_effect(cp, entry, spec, thread_id=f"{thread}/parent", by="coordinator")
    except CompensationUncertain as exc:
        return {"uncertain": exc.effect_key, "undo_key": exc.key}
    return {"status": outcome.status, "replayed": outcome.replayed}


def main(argv: list[str]) -> int:
    form, precheck, action, db, services_path, thread = argv
    services = Services(services_path, latency_s=0)
    with_precheck = precheck == "precheck"
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{db}") as cp:
        graph = build(form, cp, services, precheck=with_precheck)
        config = {"configurable": {"thread_id": thread}}
        if action == "start":
            graph.invoke({"messages": [("user", thread)]}, config, durability="sync")
        elif action.startswith("decide:"):
            decision: dict[str, Any] = {"action": action.split(":", 1)[1]}
            if decision["action"] == "provide_result":
                decision["result"] = "cancelled by phone"
            tp.decide(graph, thread, decision, durability="sync")
        elif action == "resume":
            tp.resume(graph, thread, durability="sync")
        elif action == "undo":
            print(json.dumps(_undo(cp, graph, thread, services, with_precheck)))
            return 0
        else:
            raise SystemExit(f"unknown action {action!r}")
        print(json.dumps(_where(graph, cp, thread)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
