"""Known runs for the notebook views and plots, on a real SQLite file with a scripted model.

* ``t-retry``: ``kb_search`` times out twice and is retried (only that step), then
  ``create_ticket`` (a side effect with a pre-check) returns a result holding ``<script>``.
* ``t-degrade``: ``kb_search`` stays down; after two attempts the run degrades to
  ``kb_backup``, which answers.
* ``t-takeover``: ``reserve`` commits, then ``charge`` (non-idempotent, no pre-check) acts
  and times out: the run stops on a takeover naming the uncertain effect.

The backoff waits run on a virtual clock, so building all three takes well under a second
after the imports.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph import testing

SCRIPT_RESULT = "T-1 <script>alert(1)</script>"


@dataclass
class Runs:
    """The store and the graph of ``t-takeover`` (still waiting on a person)."""

    cp: tp.RecoveryCheckpointer
    takeover_graph: Any


def _tool(name: str, result: str) -> BaseTool:
    def perform(ref: str) -> str:
        return result.format(ref=ref)

    return StructuredTool.from_function(perform, name=name, description=f"perform {name}")


def _ticket_tool(tickets: list[str]) -> BaseTool:
    def find(key: str, args: dict[str, Any]) -> tp.Done | tp.NotDone:
        return (
            tp.Done(result=SCRIPT_RESULT, proof={"found": key}) if key in tickets else tp.NotDone()
        )

    def create_ticket(ref: str) -> str:
        tickets.append(tp.current_invocation().key)
        return SCRIPT_RESULT

    base = StructuredTool.from_function(create_ticket, description="open a ticket")
    return tp.side_effect(base, precheck=find)


def _invoke(graph: Any, thread_id: str, goal: str) -> Any:
    return graph.invoke({"messages": [("user", goal)]}, {"configurable": {"thread_id": thread_id}})


def build_runs(cp: tp.RecoveryCheckpointer) -> Runs:
    """Run the three known threads on ``cp``."""
    kb_plan = [("kb_search", {"ref": "refund"}), ("create_ticket", {"ref": "refund"})]
    tickets: list[str] = []
    with testing.fake_clock():
        flaky = testing.failing(
            _tool("kb_search", "article {ref}"), times=2, exc=TimeoutError("read timed out")
        )
        graph = tp.create_recovery_agent(
            testing.ScriptedModel(plan=kb_plan),
            [flaky.tool, _ticket_tool(tickets)],
            checkpointer=cp,
            rng=random.Random(1),
        )
        _invoke(graph, "t-retry", "find the refund article and open a ticket")

        down = testing.down_for(_tool("kb_search", "article {ref}"), 1e9)
        graph = tp.create_recovery_agent(
            testing.ScriptedModel(plan=[("kb_search", {"ref": "refund"})]),
            [down.tool, _tool("kb_backup", "backup article {ref}")],
            checkpointer=cp,
            policies={
                "kb_search": tp.ToolPolicy(max_attempts=2, wait_window=0, fallback=["kb_backup"])
            },
            rng=random.Random(1),
        )
        _invoke(graph, "t-degrade", "find the refund article")

        charge = testing.fail_after_effect(tp.side_effect(_tool("charge", "charged {ref}")))
        takeover_graph = tp.create_recovery_agent(
            testing.ScriptedModel(plan=[("reserve", {"ref": "A"}), ("charge", {"ref": "C"})]),
            [tp.side_effect(_tool("reserve", "reserved {ref}")), charge.tool],
            checkpointer=cp,
            rng=random.Random(1),
        )
        _invoke(takeover_graph, "t-takeover", "reserve A, then charge C")
    return Runs(cp=cp, takeover_graph=takeover_graph)
