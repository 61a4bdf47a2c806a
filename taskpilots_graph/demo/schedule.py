"""Where the demo's worker dies: a kill schedule drawn from a seed and placed by business step.

A kill is planted on one service call about one order (or, for ``crm_tag``, one customer):
"right after the help desk opened the ticket of order o003". Both runs of the demo (the
recovery agent and plain LangGraph) get the same schedule, so they are killed at the same
steps; and since nothing depends on wall time, one seed gives the same figures on a fast
laptop and on a loaded CI machine.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from taskpilots_graph.demo.services import Phase

__all__ = ["KILL_KINDS", "kill_schedule"]

KILL_KINDS: tuple[tuple[str, Phase], ...] = (
    ("create_ticket", "after"),
    ("send_email", "after"),
    ("issue_refund", "after"),
    ("crm_tag", "after"),
    ("send_email", "before"),
    ("create_ticket", "after"),
    ("issue_refund", "after"),
)
"""The kills of one demo run: inside the effect window of every service that can be checked
or deduplicated (the effect is done, the agent has not recorded it yet), and once before an
effect is sent. ``request_approval`` is left out: an approval request can be neither
searched nor repeated safely, so every kill there stops its ticket for a person, which the
drills in ``tests/`` cover."""


def kill_schedule(tickets: Sequence[dict[str, Any]], *, seed: int) -> list[tuple[str, Phase, str]]:
    """``(service, phase, about)`` for each of :data:`KILL_KINDS`, in the batch's order.

    ``about`` is drawn with ``seed`` among the tickets that make that call: any ticket for
    ``create_ticket`` and ``send_email``, a ticket with a refund for ``issue_refund``, and a
    customer for ``crm_tag`` (only a customer's first ticket tags it). No service is killed
    twice on one order. A kind with no ticket left to place it on is dropped (tiny batches).

    Example:
        >>> from taskpilots_graph.demo.batch import make_batch
        >>> _, tickets = make_batch(12, seed=7)
        >>> kill_schedule(tickets, seed=7) == kill_schedule(tickets, seed=7)
        True
    """
    rng = random.Random(seed)
    position: dict[str, int] = {}
    for index, ticket in enumerate(tickets):
        position.setdefault(ticket["order_id"], index)
        position.setdefault(ticket["customer_id"], index)
    candidates = {
        "create_ticket": [t["order_id"] for t in tickets],
        "send_email": [t["order_id"] for t in tickets],
        "issue_refund": [t["order_id"] for t in tickets if t.get("refund", 0) > 0],
        "crm_tag": list(dict.fromkeys(t["customer_id"] for t in tickets)),
    }
    schedule: list[tuple[str, Phase, str]] = []
    for service, phase in KILL_KINDS:
        used = {about for s, _, about in schedule if s == service}
        free = [about for about in candidates[service] if about not in used]
        if free:
            schedule.append((service, phase, rng.choice(free)))
    # In the order the batch reaches them, so the progress reads as a story.
    schedule.sort(key=lambda point: position[point[2]])
    return schedule
