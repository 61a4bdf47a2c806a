"""What the inbox says about a takeover, from the tool's declaration and the ledger.

A warning "may perform it twice" belongs to answers that may repeat an effect nobody can
confirm, and only there: a pre-check that could not tell is named with its reason, and a
read-only tool that failed carries no warning and a low risk. Real graphs on the test's
database; the takeovers come from real runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _inbox_scenario import FileService
from langchain_core.messages import HumanMessage
from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph import testing
from taskpilots_graph.tool_tables import graph_tools
from taskpilots_graph.web.view import TWICE, TakeoverView, takeover_view

THREAD = "t-view"


def stopped_view(cp: tp.RecoveryCheckpointer, tools: list[BaseTool], **agent: Any) -> TakeoverView:
    """Run a one-call plan until it waits on a person; the inbox's view of that takeover."""
    model = testing.ScriptedModel(plan=[(tools[0].name, {"order": "o-1"})])
    graph = tp.create_recovery_agent(model, tools, checkpointer=cp, **agent)
    result = graph.invoke(
        {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": THREAD}}
    )
    assert "__interrupt__" in result
    (request,) = tp.pending_takeovers(cp, thread_ids=[THREAD])
    return takeover_view(
        request, tools=graph_tools(graph), ledger=cp.ledger(THREAD), events=cp.events(THREAD)
    )


def option(view: TakeoverView, action: str) -> tuple[str, str | None]:
    (found,) = [o for o in view.options if o.action == action]
    return found.consequence, found.warning


def test_a_precheck_that_cannot_tell_is_named_and_retry_is_warned(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    """Pre-checked, non-idempotent, the pre-check says Unknown: the view gives its reason,
    warns on retry and edit_args, and rates the takeover high."""
    service = FileService(tmp_path / "carrier.db")

    def ship_parcel(order: str) -> str:
        service.record("ship_parcel", order)
        return "shipped"

    def carrier_down(key: str, args: dict[str, Any]) -> tp.Unknown:
        return tp.Unknown("the carrier's tracking API is down")

    carrier = testing.fail_after_effect(
        tp.side_effect(
            StructuredTool.from_function(ship_parcel, description="Ship."), precheck=carrier_down
        )
    )
    view = stopped_view(cp, [carrier.tool])

    (effect,) = view.effects
    assert effect.uncertain
    assert effect.kind == "pre-checked"
    assert "tracking API is down" in effect.precheck
    assert effect.verify is None
    retry, warning = option(view, "retry")
    assert "same key" in retry
    assert warning is not None
    assert TWICE in warning
    assert "tracking API is down" in warning
    assert TWICE in (option(view, "edit_args")[1] or "")
    assert option(view, "provide_result")[1] is None
    assert view.risk == "high"
    assert service.count("ship_parcel") == 1


def test_a_failed_read_carries_no_warning(cp: tp.RecoveryCheckpointer) -> None:
    """A read-only tool out of attempts: retry just calls it again, no option carries a
    warning, the risk is low, and abandon has nothing to undo."""

    def track(order: str) -> str:
        raise ConnectionResetError("tracking service reset the connection")

    view = stopped_view(
        cp,
        [StructuredTool.from_function(track, description="Track an order.")],
        policies={"track": tp.ToolPolicy(max_attempts=1)},
    )

    (effect,) = view.effects
    assert not effect.uncertain
    assert effect.kind == "read"
    assert effect.status == "not recorded"  # a read has no ledger entry
    retry, warning = option(view, "retry")
    assert warning is None
    assert "no side effect" in retry
    assert all(o.warning is None for o in view.options)
    assert view.risk == "low"
    assert option(view, "abandon")[0] == "stops the run: undoes nothing, then closes it"
