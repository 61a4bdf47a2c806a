"""Bounded state in the agent: large results as artifacts, checkpoint density and retention,
on real SQLite files and PostgreSQL (the ``cp`` fixture). What the model sees of a long
conversation (the context budget) is tested in ``test_context_budget.py``."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from _models import ScriptedChatModel, tool_call
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    ToolMessage,
)
from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph.checkpointers.density import CheckpointDensity
from taskpilots_graph.checkpointers.retention import PruneReport
from taskpilots_graph.errors import ConfigurationError, ThreadNotFound
from taskpilots_graph.events import EventKind
from taskpilots_graph.leases import thread_lease_name
from taskpilots_graph.locks.memory import MemoryLeaseBackend
from taskpilots_graph.window import ObservationPolicy

BIG = 10 * 1024 * 1024


def big_payload() -> str:
    """10 MB of JSON records (deterministic, not a repeated filler)."""
    rows = []
    size = 0
    n = 0
    while size < BIG:
        row = {"id": n, "digest": hashlib.sha256(str(n).encode()).hexdigest()}
        rows.append(row)
        size += len(json.dumps(row)) + 2
        n += 1
    return json.dumps(rows)


class CountingModel(ScriptedChatModel):
    """Calls ``tool`` with ``{"n": k}`` for k = 0 .. steps-1 reading only the last answer."""

    tool: str = "page"
    steps: int = 1

    def decide(self, messages: list[BaseMessage]) -> AIMessage:
        last = next((m for m in reversed(messages) if isinstance(m, ToolMessage)), None)
        done = 0 if last is None else int(json.loads(str(last.content))["n"]) + 1
        if done >= self.steps:
            return AIMessage(f"done after {done}")
        return tool_call(self.tool, {"n": done})


def page_tool(calls: list[int]) -> BaseTool:
    def page(n: int) -> str:
        """Return page ``n``."""
        calls.append(n)
        return json.dumps({"n": n, "text": f"page {n} " * 50})

    return StructuredTool.from_function(page)


def _config(thread_id: str) -> Any:
    return {"configurable": {"thread_id": thread_id}}


# --- observations as artifacts ----------------------------------------------------------------


def test_a_10_mb_result_becomes_an_artifact_and_a_summary(cp: tp.RecoveryCheckpointer) -> None:
    payload = big_payload()

    def export_rows() -> str:
        """Export every row."""
        return payload

    class OnceModel(ScriptedChatModel):
        def decide(self, messages: list[BaseMessage]) -> AIMessage:
            if any(isinstance(m, ToolMessage) for m in messages):
                return AIMessage("exported")
            return tool_call("export_rows", {})

    model = OnceModel()
    graph = tp.create_recovery_agent(
        model, [StructuredTool.from_function(export_rows)], checkpointer=cp
    )
    graph.invoke({"messages": [HumanMessage("export")]}, _config("t-big"))

    state = graph.get_state(_config("t-big")).values
    answer = next(m for m in state["messages"] if isinstance(m, ToolMessage))
    observation = answer.artifact
    assert observation["size"] == len(payload.encode())
    assert observation["media_type"] == "application/json"
    artifact_id = observation["artifact_id"]
    assert artifact_id == "sha256:" + hashlib.sha256(payload.encode()).hexdigest()
    # The state (and so every checkpoint) holds the bounded summary and the id, not 10 MB.
    assert len(str(answer.content)) <= ObservationPolicy().summary_chars + 200
    assert artifact_id in str(answer.content)
    # The model saw the summary.
    seen = [m for m in model.inputs[-1] if isinstance(m, ToolMessage)]
    assert len(seen) == 1
    assert seen[0].content == answer.content
    # The raw payload is retrievable byte for byte.
    assert cp.artifact(artifact_id) == payload.encode()
    # The event log holds a bounded summary too.
    succeeded = [e for e in cp.events("t-big") if e.kind is EventKind.TOOL_SUCCEEDED]
    assert len(json.dumps(dict(succeeded[0].payload))) < 4096


def test_small_results_stay_whole_and_none_policy_keeps_everything(
    cp: tp.RecoveryCheckpointer,
) -> None:
    calls: list[int] = []
    model = CountingModel(steps=1)
    graph = tp.create_recovery_agent(model, [page_tool(calls)], checkpointer=cp, observations=None)
    graph.invoke({"messages": [HumanMessage("go")]}, _config("t-small"))
    answer = next(
        m
        for m in graph.get_state(_config("t-small")).values["messages"]
        if isinstance(m, ToolMessage)
    )
    assert answer.artifact is None
    assert json.loads(str(answer.content))["n"] == 0


def test_observation_policy_and_density_validate() -> None:
    with pytest.raises(ConfigurationError):
        ObservationPolicy(threshold_bytes=-1)
    with pytest.raises(ConfigurationError):
        CheckpointDensity("sometimes")  # type: ignore[arg-type]


# --- checkpoint density ---------------------------------------------------------------------------


def _stored_checkpoints(cp: tp.RecoveryCheckpointer, thread_id: str) -> int:
    return sum(1 for _ in cp.list(_config(thread_id)))


@pytest.mark.parametrize("density", ["every_step", "tool_boundary", "milestones"])
def test_density_stores_fewer_checkpoints_and_the_run_ends_stored(
    cp: tp.RecoveryCheckpointer, density: str
) -> None:
    calls: list[int] = []
    effects: list[int] = []

    def record(n: int) -> str:
        """Record ``n`` somewhere else (a side effect)."""
        effects.append(n)
        return json.dumps({"n": n})

    class Mixed(ScriptedChatModel):
        def decide(self, messages: list[BaseMessage]) -> AIMessage:
            answers = [m for m in messages if isinstance(m, ToolMessage)]
            last = json.loads(str(answers[-1].content))["n"] if answers else -1
            if last + 1 >= 6:
                return AIMessage("done")
            name = "record" if last + 1 == 3 else "page"
            return tool_call(name, {"n": last + 1})

    graph = tp.create_recovery_agent(
        Mixed(),
        [page_tool(calls), tp.side_effect(StructuredTool.from_function(record), idempotent=True)],
        checkpointer=cp,
        checkpoint_density=density,  # type: ignore[arg-type]
    )
    graph.invoke({"messages": [HumanMessage("go")]}, _config(f"t-{density}"))
    stored = _stored_checkpoints(cp, f"t-{density}")
    # Every step: the input and one per super-step (6 x think + act, the answer, and the
    # routing step after the last observation). Tool boundary: the input, before and after
    # the one side effect, and the end. Milestones (none declared): the input and the end.
    expected = {"every_step": 15, "tool_boundary": 4, "milestones": 2}[density]
    assert stored == expected
    # Whatever the density, the stored end state is the final one.
    final = graph.get_state(_config(f"t-{density}")).values
    assert final["flow"]["stage"] == "closed"
    assert str(final["messages"][-1].content) == "done"
    assert effects == [3]


def test_density_stores_the_checkpoint_an_interrupt_stops_on(cp: tp.RecoveryCheckpointer) -> None:
    class Forever(ScriptedChatModel):
        def decide(self, messages: list[BaseMessage]) -> AIMessage:
            return tool_call("page", {"n": 0})

    calls: list[int] = []
    graph = tp.create_recovery_agent(
        Forever(), [page_tool(calls)], checkpointer=cp, max_steps=3, checkpoint_density="milestones"
    )
    graph.invoke({"messages": [HumanMessage("go")]}, _config("t-int"))
    # Stopped for a person: the stop is stored and visible from any process.
    requests = tp.pending_takeovers(cp, thread_ids=["t-int"])
    assert [r.thread_id for r in requests] == ["t-int"]
    tp.decide(graph, "t-int", tp.Decision(action="abandon"))
    flow = graph.get_state(_config("t-int")).values["flow"]
    assert flow["stage"] == "closed"
    assert flow["reason"] == "abandoned by a person"


# --- retention ----------------------------------------------------------------------------------


def _run_pages(cp: tp.RecoveryCheckpointer, thread_id: str, steps: int, **kwargs: Any) -> Any:
    calls: list[int] = []
    graph = tp.create_recovery_agent(
        CountingModel(steps=steps), [page_tool(calls)], checkpointer=cp, **kwargs
    )
    graph.invoke({"messages": [HumanMessage("go")]}, _config(thread_id))
    return graph


def test_prune_keeps_the_latest_and_every_recovery_fact(cp: tp.RecoveryCheckpointer) -> None:
    graph = _run_pages(cp, "t-prune", 4)
    before = graph.get_state(_config("t-prune")).values
    events = cp.events("t-prune")
    assert _stored_checkpoints(cp, "t-prune") > 5

    report = cp.prune(["t-prune"])
    assert report.pruned == ("t-prune",)
    assert not report.refused
    assert report.checkpoints_removed > 4
    assert _stored_checkpoints(cp, "t-prune") == 1
    after = graph.get_state(_config("t-prune")).values
    assert after["messages"] == before["messages"]
    assert after["flow"] == before["flow"]
    assert cp.events("t-prune") == events
    # Pruning again finds nothing more to delete.
    assert cp.prune(["t-prune"]).checkpoints_removed == 0


def test_prune_milestones_keeps_rewind_targets(cp: tp.RecoveryCheckpointer) -> None:
    def two_pages(state: Any) -> bool:
        return sum(isinstance(m, ToolMessage) for m in state["messages"]) >= 2

    _run_pages(cp, "t-mile", 4, milestones={"two pages": two_pages})
    reached = [e for e in cp.events("t-mile") if e.kind is EventKind.MILESTONE_REACHED]
    assert len(reached) == 1
    target = reached[0].payload["checkpoint_id"]
    cp.prune(["t-mile"], keep="milestones")
    ids = [t.config["configurable"]["checkpoint_id"] for t in cp.list(_config("t-mile"))]
    assert len(ids) == 2
    assert target in ids


def test_prune_refuses_pending_uncertain_and_leased_threads(cp: tp.RecoveryCheckpointer) -> None:
    class Forever(ScriptedChatModel):
        def decide(self, messages: list[BaseMessage]) -> AIMessage:
            return tool_call("page", {"n": 0})

    calls: list[int] = []
    graph = tp.create_recovery_agent(Forever(), [page_tool(calls)], checkpointer=cp, max_steps=2)
    graph.invoke({"messages": [HumanMessage("go")]}, _config("t-pending"))
    pending_count = _stored_checkpoints(cp, "t-pending")

    # An intent without an outcome: the effect may or may not have happened.
    cp.write_ledger(_intent_entry(), expect=None)
    _run_pages(cp, "t-uncertain", 2)
    uncertain_count = _stored_checkpoints(cp, "t-uncertain")

    _run_pages(cp, "t-leased", 2)
    leases = MemoryLeaseBackend()
    leases.acquire(thread_lease_name("t-leased"), "worker-7", 30.0)

    report = cp.prune(["t-pending", "t-uncertain", "t-leased"], leases=leases)
    assert report.pruned == ()
    assert "takeover" in report.refused["t-pending"]
    assert "refund:o-1" in report.refused["t-uncertain"]
    assert "worker-7" in report.refused["t-leased"]
    assert _stored_checkpoints(cp, "t-pending") == pending_count
    assert _stored_checkpoints(cp, "t-uncertain") == uncertain_count

    with pytest.raises(ThreadNotFound):
        cp.prune(["t-leased", "no-such-thread"])
    with pytest.raises(ConfigurationError):
        cp.prune(["t-leased"], keep="everything")  # type: ignore[arg-type]


def _intent_entry() -> tp.LedgerEntry:
    from taskpilots_graph.ledger import LedgerStatus

    now = datetime.now(UTC)
    return tp.LedgerEntry(
        key="refund:o-1",
        thread_id="t-uncertain",
        tool="refund",
        status=LedgerStatus.INTENDED,
        args={"order": "o-1"},
        args_digest="0" * 64,
        attempt=1,
        created_at=now,
        updated_at=now,
    )


def test_sweep_deletes_idle_threads_except_those_needing_a_person(
    cp: tp.RecoveryCheckpointer,
) -> None:
    _run_pages(cp, "t-old", 1)

    class Forever(ScriptedChatModel):
        def decide(self, messages: list[BaseMessage]) -> AIMessage:
            return tool_call("page", {"n": 0})

    calls: list[int] = []
    graph = tp.create_recovery_agent(Forever(), [page_tool(calls)], checkpointer=cp, max_steps=1)
    graph.invoke({"messages": [HumanMessage("go")]}, _config("t-waiting"))

    assert cp.sweep(older_than=3600) == PruneReport()
    report = cp.sweep(older_than=0)
    assert report.deleted == ("t-old",)
    assert "takeover" in report.refused["t-waiting"]
    assert cp.get_tuple(_config("t-old")) is None
    assert cp.events("t-old") == []
    assert cp.get_tuple(_config("t-waiting")) is not None


async def test_async_prune_and_sweep(tmp_path: Path) -> None:
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(
        f"sqlite:///{tmp_path / 'a.db'}"
    ) as acp:
        await acp.setup()
        calls: list[int] = []
        graph = tp.create_recovery_agent(
            CountingModel(steps=3), [page_tool(calls)], checkpointer=acp
        )
        await graph.ainvoke({"messages": [HumanMessage("go")]}, _config("t-async"))
        report = await acp.aprune(["t-async"])
        assert report.pruned == ("t-async",)
        assert report.checkpoints_removed > 0
        assert len([t async for t in acp.alist(_config("t-async"))]) == 1
        swept = await acp.asweep(older_than=0)
        assert swept.deleted == ("t-async",)


def test_model_summarizer_bounds_and_falls_back() -> None:
    from taskpilots_graph.window import model_summarizer

    class Summarizing(ScriptedChatModel):
        def decide(self, messages: list[BaseMessage]) -> AIMessage:
            return AIMessage("rows 0..n, digests; " * 100)

    class Broken(ScriptedChatModel):
        def decide(self, messages: list[BaseMessage]) -> AIMessage:
            raise TimeoutError("model down")

    rows = [{"id": i} for i in range(1000)]
    model = Summarizing()
    summary = model_summarizer(model, max_input_chars=500)(rows, max_chars=300)
    assert summary.startswith("rows 0..n")
    assert len(summary) == 300
    shown = str(model.inputs[0][-1].content)
    assert len(shown) < 500 + 1000  # the outline plus at most 500 characters of the result
    fallback = model_summarizer(Broken())(rows, max_chars=300)
    assert fallback.startswith("JSON array: 1,000 items")  # the structural summary
    # Plugged into the agent's observation policy.
    assert ObservationPolicy(summarizer=model_summarizer(model)).summarizer is not None
