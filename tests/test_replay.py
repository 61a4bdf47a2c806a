"""Replay of a run from its event log: the step sequence, and nothing called again.

Real ``create_recovery_agent`` runs on a SQLite file and a PostgreSQL database (the ``cp``
fixture). The replay is read through a second checkpointer opened on the same database with
no graph at all, and the tools', services' and model's call counters must not move.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from _models import PlanModel
from langchain_core.messages import HumanMessage
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.checkpoint.memory import InMemorySaver

import taskpilots_graph as tp
from taskpilots_graph import testing
from taskpilots_graph.errors import ThreadNotFound
from taskpilots_graph.events import EventKind
from taskpilots_graph.policy import Backoff, ToolPolicy
from taskpilots_graph.replay import Replay, areplay, replay

FAST = Backoff(initial=1.0, multiplier=2.0, max_delay=8.0, jitter=False)

TRANSIENT_RUN = [
    ("agent_started", "user"),
    ("llm_decided", "model"),  # create_ticket
    ("tool_invoked", "tool"),
    ("tool_succeeded", "tool"),
    ("step_completed", "engine"),
    ("llm_decided", "model"),  # kb_search
    ("tool_invoked", "tool"),
    ("tool_failed", "tool"),
    ("step_completed", "engine"),
    ("retry_scheduled", "engine"),
    ("tool_invoked", "tool"),
    ("tool_failed", "tool"),
    ("step_completed", "engine"),
    ("retry_scheduled", "engine"),
    ("tool_invoked", "tool"),
    ("tool_succeeded", "tool"),
    ("step_completed", "engine"),
    ("llm_decided", "model"),  # the answer
    ("agent_finished", "engine"),
]


class Service:
    """A simulated service recording each executed effect."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def tool(self, name: str) -> BaseTool:
        def perform(ref: str) -> str:
            self.done.append(f"{name}:{ref}")
            return f"{name} {ref} ok"

        return StructuredTool.from_function(perform, name=name, description=f"perform {name}")


def read_tool(name: str) -> BaseTool:
    def read(q: str) -> str:
        return f"found: {q}"

    return StructuredTool.from_function(read, name=name, description=f"read {name}")


def go(graph: Any, thread_id: str = "t") -> Any:
    return graph.invoke(
        {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": thread_id}}
    )


def test_replay_of_a_real_run_calls_no_tool_and_no_model(
    cp: tp.RecoveryCheckpointer, conn_string: str
) -> None:
    """Steps, calls and failures come back in order; no tool, service or model is called."""
    service = Service()
    search = testing.failing(read_tool("kb_search"), times=2, exc=TimeoutError("timed out"))
    model = PlanModel(plan=[("create_ticket", {"ref": "A"}), ("kb_search", {"q": "refund"})])
    graph = tp.create_recovery_agent(
        model,
        [search.tool, tp.side_effect(service.tool("create_ticket"), idempotent=True)],
        checkpointer=cp,
        default_policy=ToolPolicy(backoff=FAST),
    )
    with testing.fake_clock():
        go(graph)
    counters = (search.calls, list(service.done), len(model.inputs))

    with tp.RecoveryCheckpointer.from_conn_string(conn_string) as fresh:  # no graph here
        run = replay(fresh, "t")

    assert (search.calls, service.done, len(model.inputs)) == counters
    assert [(s.kind.value, s.actor) for s in run.steps] == TRANSIENT_RUN
    assert [s.index for s in run.steps] == list(range(1, len(TRANSIENT_RUN) + 1))
    assert [s.seq for s in run.steps] == [e.seq for e in cp.events("t")]
    assert [(s.tool, dict(s.args or {})) for s in run.tool_calls] == [
        ("create_ticket", {"ref": "A"}),
        *[("kb_search", {"q": "refund"})] * 3,
    ]
    assert run.tool_calls[0].key == cp.ledger("t")[0].key
    assert run.tool_calls[0].attempt == 1
    failures = run.failures
    assert [(f.tool, (f.failure or {}).get("kind")) for f in failures] == [
        ("kb_search", "transient"),
        ("kb_search", "transient"),
    ]
    decisions = [s for s in run.steps if s.kind is EventKind.LLM_DECIDED]
    assert [[c["name"] for c in d.calls] for d in decisions] == [
        ["create_ticket"],
        ["kb_search"],
        [],
    ]
    assert decisions[0].saw == ("user: go",)
    assert decisions[1].saw == ("create_ticket → create_ticket A ok",)
    assert decisions[2].saw == ("kb_search → found: refund",)  # retried attempts: not shown
    assert decisions[2].summary == "answers: done"
    succeeded = [s for s in run.steps if s.kind is EventKind.TOOL_SUCCEEDED]
    assert [s.result for s in succeeded] == ["create_ticket A ok", "found: refund"]

    text = str(run)
    assert text == run.render()
    lines = text.splitlines()
    assert lines[0] == "Replay of thread 't': 19 steps, 4 tool calls, 2 failures"
    assert "decides: kb_search" in text
    assert 'call kb_search({"q": "refund"})' in text
    assert "kb_search failed (attempt 1): transient TimeoutError: timed out" in text
    assert "run closed: done" in lines[-1]
    data = json.loads(json.dumps(run.as_dict()))
    assert [s["kind"] for s in data["steps"]] == [k for k, _ in TRANSIENT_RUN]


def test_replay_shows_the_takeover_and_the_persons_decision(cp: tp.RecoveryCheckpointer) -> None:
    """Uncertain effect → a person is asked → ``retry`` → attempt 2 → resumed model."""
    service = Service()
    charge = testing.fail_after_effect(tp.side_effect(service.tool("charge")), times=1)
    graph = tp.create_recovery_agent(
        PlanModel(plan=[("charge", {"ref": "C"})]), [charge.tool], checkpointer=cp
    )
    go(graph)
    tp.decide(graph, "t", tp.Decision(action="retry", decided_by="ana", note="checked the bank"))
    calls = charge.calls

    run = replay(cp, "t")

    assert charge.calls == calls
    kinds = [s.kind.value for s in run.steps]
    for earlier, later in [
        ("tool_failed", "effect_uncertain"),
        ("effect_uncertain", "takeover_requested"),
        ("takeover_requested", "run_resumed"),
        ("run_resumed", "decision_recorded"),
        ("decision_recorded", "resume_context"),
    ]:
        assert kinds.index(earlier) < kinds.index(later)
    (decision,) = [s for s in run.steps if s.kind is EventKind.DECISION_RECORDED]
    assert decision.actor == "person"
    assert decision.summary == "ana decided retry: checked the bank"
    assert [s.attempt for s in run.tool_calls] == [1, 2]
    (uncertain,) = [s for s in run.steps if s.kind is EventKind.EFFECT_UNCERTAIN]
    assert uncertain.key == cp.ledger("t")[0].key
    final = [s for s in run.steps if s.kind is EventKind.LLM_DECIDED][-1]
    assert "person: retry" in final.saw
    assert any(seen.startswith("resume prompt: You are resuming") for seen in final.saw)


def test_superseded_steps_are_flagged(cp: tp.RecoveryCheckpointer) -> None:
    """Steps a rewind superseded stay in the replay, flagged, and out of what the model saw."""
    cp.append_event("t", "agent_started", {"goal": "go"})
    cp.append_event("t", "step_completed", {"observations": [{"tool": "a", "status": "ok"}]})
    cp.append_event("t", "step_completed", {"observations": [{"tool": "b", "status": "ok"}]})
    cp.append_event("t", "rewound", {"from_seq": 3, "to_seq": 3, "to": "m1"})
    cp.append_event("t", "llm_decided", {"content": "done"})

    run = replay(cp, "t")

    assert [s.superseded for s in run.steps] == [False, False, True, False, False]
    assert run.steps[-1].saw == ("user: go", "a → ")
    assert "[superseded]" in run.render().splitlines()[3]


def test_unknown_thread_and_wrong_checkpointer(cp: tp.RecoveryCheckpointer) -> None:
    """No event and no checkpoint: ThreadNotFound; a plain saver has no log to replay."""
    with pytest.raises(ThreadNotFound):
        replay(cp, "nobody")
    with pytest.raises(tp.ConfigurationError, match="RecoveryCheckpointer"):
        replay(InMemorySaver(), "t")


async def test_areplay_matches_replay(sqlite_path: str) -> None:
    """``areplay`` on the async checkpointer gives the replay the sync one reads."""
    conn = f"sqlite:///{sqlite_path}"
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(conn) as acp:
        await acp.setup()
        graph = tp.create_recovery_agent(
            PlanModel(plan=[("kb_search", {"q": "x"})]), [read_tool("kb_search")], checkpointer=acp
        )
        await graph.ainvoke(
            {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "a"}}
        )
        got = await areplay(acp, "a")
        with pytest.raises(ThreadNotFound):
            await areplay(acp, "b")
    with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
        assert replay(cp, "a") == got
    assert isinstance(got, Replay)
    assert [s.kind.value for s in got.steps][-2:] == ["llm_decided", "agent_finished"]
    assert len(got.tool_calls) == 1
