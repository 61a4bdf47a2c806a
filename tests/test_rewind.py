"""Rewind to a business milestone: superseded events flagged, earlier effects not repeated."""

from __future__ import annotations

from typing import Any

import pytest
from _models import PlanModel
from test_drills import Effects, kinds, run

import taskpilots_graph as tp
from taskpilots_graph.errors import ThreadNotFound


def _ticket_created(state: Any) -> bool:
    return any(
        r.get("tool") == "create_ticket" and r.get("status") == "closed"
        for r in (state.get("steps") or {}).values()
    )


def _graph(cp: tp.RecoveryCheckpointer, effects: Effects) -> Any:
    model = PlanModel(plan=[("create_ticket", {"ref": "R"}), ("send_email", {"ref": "R"})])
    tools = [
        tp.side_effect(effects.tool("create_ticket")),
        tp.side_effect(effects.tool("send_email")),
    ]
    return tp.create_recovery_agent(
        model, tools, checkpointer=cp, milestones={"ticket_created": _ticket_created}
    )


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_rewind_to_milestone_supersedes_later_events_and_keeps_earlier_effects(
    cp: tp.RecoveryCheckpointer, durability: str
) -> None:
    """Rewinding to a milestone continues from it; effects before it are not repeated."""
    effects = Effects()
    graph = _graph(cp, effects)
    config = {"configurable": {"thread_id": "t"}}
    graph.invoke({"messages": [("user", "go")]}, config, durability=durability)
    assert effects.done == ["create_ticket:R", "send_email:R"]
    (milestone,) = [e for e in cp.events("t") if e.kind is tp.EventKind.MILESTONE_REACHED]
    assert milestone.payload["name"] == "ticket_created"

    result = tp.rewind(graph, "t", to="ticket_created", durability=durability)

    assert result["flow"]["stage"] == "closed"
    assert effects.done.count("create_ticket:R") == 1  # before the milestone: not repeated
    events = cp.events("t")
    (rewound,) = [e for e in events if e.kind is tp.EventKind.REWOUND]
    superseded = [e for e in events if e.superseded]
    assert superseded  # the first run's later steps, kept for audit
    assert all(
        rewound.payload["from_seq"] <= e.seq <= rewound.payload["to_seq"] for e in superseded
    )
    assert all(e.seq < rewound.seq for e in superseded)
    assert not any(e.superseded for e in events if e.seq > rewound.seq)
    assert "agent_finished" in [e.kind.value for e in events if e.seq > rewound.seq]


def test_rewind_to_unknown_target_is_a_clear_error(cp: tp.RecoveryCheckpointer) -> None:
    """A target that is neither a milestone nor a checkpoint raises and changes nothing."""
    effects = Effects()
    graph = _graph(cp, effects)
    run(graph)
    before = kinds(cp)
    with pytest.raises(tp.ConfigurationError, match="no milestone or checkpoint"):
        tp.rewind(graph, "t", to="no-such-milestone")
    with pytest.raises(ThreadNotFound):
        tp.rewind(graph, "nobody", to="ticket_created")
    assert kinds(cp) == before
