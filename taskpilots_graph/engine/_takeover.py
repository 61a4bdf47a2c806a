"""Applying a person's takeover decision to the ledger (who decided, the entry's move, the
``decision_recorded`` event), for the takeover node, the middleware and an undo alike."""

from __future__ import annotations

import getpass
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from taskpilots_graph.engine._records import step_event
from taskpilots_graph.events import EventKind, EventRecord
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus
from taskpilots_graph.takeover import Decision

__all__ = ["decided_by", "decision_recorded", "ledger_move"]


def decided_by(decision: Decision) -> str:
    """Who made ``decision``: as it says, else the user running this process."""
    if decision.decided_by:
        return decision.decided_by
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return "unknown"


def decision_recorded(
    thread_id: str,
    checkpoint_ns: str,
    decision: Decision,
    who: str,
    steps: Sequence[Any],
    **extra: Any,
) -> EventRecord:
    """The ``decision_recorded`` event of ``decision`` about ``steps`` (tool-call ids)."""
    payload = {
        **extra,
        "decision": decision.model_dump(mode="json", exclude_none=True),
        "decided_by": who,
        "steps": list(steps),
    }
    return step_event(thread_id, checkpoint_ns, EventKind.DECISION_RECORDED, **payload)


def ledger_move(
    entry: LedgerEntry, decision: Decision, who: str, now: datetime
) -> LedgerEntry | None:
    """The entry a step's decision is about, after the decision; ``None``: no change."""
    if entry.status not in (LedgerStatus.UNCERTAIN, LedgerStatus.FAILED, LedgerStatus.INTENDED):
        return None  # committed / compensated: the decision was applied already
    action = decision.action
    if action == "provide_result":
        return replace(
            entry,
            status=LedgerStatus.COMMITTED,
            result=decision.result,
            error=None,
            proof={"manual": True, "decided_by": who, "note": decision.note},
            updated_at=now,
        )
    if action in ("abandon", "accept"):
        return None
    # retry: released for one more execution (not sent, so the ledger executes it);
    # skip / edit_args: closed for good, the step goes on without this key.
    reason = {"retry": "retry_approved", "skip": "skipped_by_person", "edit_args": "superseded"}
    return replace(
        entry,
        status=LedgerStatus.FAILED,
        error={
            "type": reason[action],
            "message": f"{action} decided by {who}",
            "maybe_sent": action != "retry",
        },
        updated_at=now,
    )
