"""The three fault drills of the source documents, a stuck loop, and a property test.

* Drill A: a transient failure in a pure tool step: only that step is retried.
* Drill B: a side effect committed, then the next tool dies: nothing is repeated.
* Drill C: a tool down longer than its wait window: waiting → degraded, or → a person /
  failed, within the attempt budget, never an endless replay.

Every drill runs a real graph on a real SQLite file and PostgreSQL database, with the
library's clock replaced (``testing.fake_clock``) so backoffs take no real time.
"""

from __future__ import annotations

from typing import Any

import pytest
from _models import PlanModel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, StructuredTool

import taskpilots_graph as tp
from taskpilots_graph import testing
from taskpilots_graph.agent import check_retry_owner
from taskpilots_graph.errors import ToolWaiting
from taskpilots_graph.nodes import RecoveryExecutor
from taskpilots_graph.policy import Backoff, ToolPolicy
from taskpilots_graph.state import RecoveryState

FAST = Backoff(initial=1.0, multiplier=2.0, max_delay=8.0, jitter=False)


class Effects:
    """A simulated service that keeps what it did (the duplicates counter of the drills)."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def tool(self, name: str) -> BaseTool:
        def perform(ref: str) -> str:
            self.done.append(f"{name}:{ref}")
            return f"{name} {ref} ok"

        return StructuredTool.from_function(perform, name=name, description=f"perform {name}")


def read_tool(name: str, answer: str = "found") -> BaseTool:
    def read(q: str) -> str:
        return f"{answer}: {q}"

    return StructuredTool.from_function(read, name=name, description=f"read {name}")


def run(graph: Any, thread_id: str = "t") -> dict[str, Any]:
    config = {"configurable": {"thread_id": thread_id}}
    result: dict[str, Any] = graph.invoke({"messages": [HumanMessage("go")]}, config)
    return result


def kinds(cp: tp.RecoveryCheckpointer, thread_id: str = "t") -> list[str]:
    return [e.kind.value for e in cp.events(thread_id)]


def test_drill_a_transient_failure_retries_only_that_step(cp: tp.RecoveryCheckpointer) -> None:
    """Drill A: a read tool times out twice, then answers; only that step is re-invoked."""
    effects = Effects()
    search = testing.failing(read_tool("kb_search"), times=2, exc=TimeoutError("read timed out"))
    ticket = effects.tool("create_ticket")
    model = PlanModel(plan=[("create_ticket", {"ref": "A"}), ("kb_search", {"q": "refund"})])
    graph = tp.create_recovery_agent(
        model,
        [search.tool, tp.side_effect(ticket, idempotent=True)],
        checkpointer=cp,
        default_policy=ToolPolicy(backoff=FAST),
    )
    with testing.fake_clock() as clock:
        result = run(graph)

    assert result["messages"][-1].content == "done"
    assert search.calls == 3  # two timeouts, one success: that step only
    assert effects.done == ["create_ticket:A"]  # the earlier step is not repeated
    assert len(model.asked) == 3  # one decision per planned call, one answer: no re-thinking
    assert clock.slept == [1.0, 2.0]  # backoff 1 s, then 2 s
    log = kinds(cp)
    assert log.count("retry_scheduled") == 2
    assert log.count("tool_failed") == 2
    failed = [e for e in cp.events("t") if e.kind is tp.EventKind.TOOL_FAILED]
    assert failed[0].payload["failure"]["kind"] == "transient"
    assert {"args", "attempt", "library_version", "python_version", "host", "at"} <= set(
        failed[0].payload
    )


def test_drill_b_committed_effect_then_outage_repeats_nothing(cp: tp.RecoveryCheckpointer) -> None:
    """Drill B: tool 1 commits, tool 2 is down past an in-process wait; resume repeats nothing."""
    effects = Effects()
    notify = testing.down_for(effects.tool("send_email"), 150, exc=ConnectionRefusedError())
    ticket = tp.side_effect(effects.tool("create_ticket"))  # plain non-idempotent
    model = PlanModel(plan=[("create_ticket", {"ref": "B"}), ("send_email", {"ref": "B"})])
    policy = ToolPolicy(backoff=Backoff(initial=60, jitter=False), wait_window=3600)
    graph = tp.create_recovery_agent(
        model,
        [ticket, tp.side_effect(notify.tool, idempotent=True)],
        checkpointer=cp,
        default_policy=policy,
    )
    with testing.fake_clock() as clock:
        with pytest.raises(ToolWaiting) as waiting:
            run(graph)
        assert graph.get_state({"configurable": {"thread_id": "t"}}).values["flow"]["stage"] == (
            "waiting_tool"
        )
        clock.advance(waiting.value.retry_at - clock.now())
        # Still down (a 150 s outage): the run waits again, then the service comes back.
        while True:
            try:
                result = tp.resume(graph, "t")
                break
            except ToolWaiting as again:
                clock.advance(again.retry_at - clock.now())

    assert result["messages"][-1].content == "done"
    assert effects.done == ["create_ticket:B", "send_email:B"]  # each effect exactly once
    statuses = {e.tool: e.status for e in cp.ledger("t")}
    assert statuses == {"create_ticket": "committed", "send_email": "committed"}
    assert notify.calls == 4  # down at 0, 60 and 120 s; back at 180 s
    assert kinds(cp).count("run_resumed") == 3


def test_drill_c_long_outage_degrades_to_fallback(cp: tp.RecoveryCheckpointer) -> None:
    """Drill C: down past its wait window, the tool is replaced by its fallback, in budget."""
    search = testing.down_for(read_tool("kb_search"), 10_000, exc=ConnectionRefusedError())
    backup = read_tool("kb_backup", answer="from backup")
    model = PlanModel(plan=[("kb_search", {"q": "warranty"})])
    graph = tp.create_recovery_agent(
        model,
        [search.tool, backup],
        checkpointer=cp,
        policies={"kb_search": ToolPolicy(backoff=FAST, wait_window=5, fallback=["kb_backup"])},
    )
    with testing.fake_clock():
        result = run(graph)

    assert result["messages"][-1].content == "done"
    answer = next(m for m in result["messages"] if isinstance(m, ToolMessage))
    assert (answer.name, answer.content) == ("kb_search", "from backup: warranty")
    assert search.calls <= ToolPolicy().max_attempts
    log = kinds(cp)
    assert log.index("retry_scheduled") < log.index("degraded")
    step = next(
        iter(graph.get_state({"configurable": {"thread_id": "t"}}).values["steps"].values())
    )
    assert (step["using"], step["tried"], step["status"]) == ("kb_backup", ["kb_search"], "closed")


@pytest.mark.parametrize("on_exhausted", ["takeover", "fail"])
def test_drill_c_long_outage_without_fallback_escalates(
    cp: tp.RecoveryCheckpointer, on_exhausted: str
) -> None:
    """Drill C: with no fallback the run goes to a person or fails: never an endless replay."""
    search = testing.down_for(read_tool("kb_search"), 10_000, exc=ConnectionRefusedError())
    model = PlanModel(plan=[("kb_search", {"q": "warranty"})])
    policy = ToolPolicy(backoff=FAST, max_attempts=4, wait_window=1_000, on_exhausted=on_exhausted)  # type: ignore[arg-type]
    graph = tp.create_recovery_agent(
        model, [search.tool], checkpointer=cp, policies={"kb_search": policy}
    )
    with testing.fake_clock() as clock:
        result = run(graph)

    assert search.calls == 4  # exactly max_attempts, then no more
    assert clock.slept == [1.0, 2.0, 4.0]
    attempts = [e.payload["attempt"] for e in cp.events("t") if e.kind is tp.EventKind.TOOL_FAILED]
    assert attempts == [1, 2, 3, 4]  # each retry of the step is numbered
    log = kinds(cp)
    assert log.count("retry_scheduled") == 3
    if on_exhausted == "takeover":
        (pending,) = result["__interrupt__"]
        assert pending.value["pending"][0]["tool"] == "kb_search"
        assert "takeover_requested" in log
    else:
        assert "__interrupt__" not in result
        assert result["flow"]["stage"] == "failed"
        assert log[-1] == "agent_finished"
        final = [m for m in result["messages"] if isinstance(m, ToolMessage)]
        assert final[0].status == "error"
        assert "ConnectionRefusedError" in str(final[0].content)


def test_stuck_loop_is_detected_and_escalated(cp: tp.RecoveryCheckpointer) -> None:
    """The same failure again and again (a model repeating a bad call) ends in STUCK."""

    def lookup(customer: str) -> str:
        raise ValueError("customer id must look like c-123")

    bad = StructuredTool.from_function(lookup, name="lookup", description="look up")
    model = PlanModel(plan=[("lookup", {"customer": "bob"})] * 10)
    graph = tp.create_recovery_agent(
        model, [bad], checkpointer=cp, default_policy=ToolPolicy(stuck_after=3)
    )
    with testing.fake_clock():
        result = run(graph)

    (pending,) = result["__interrupt__"]
    assert "stuck" in pending.value["reason"]
    log = kinds(cp)
    assert log.count("tool_failed") == 3  # reported twice to the model, then stopped
    assert "stuck_detected" in log
    assert log.index("stuck_detected") < log.index("takeover_requested")


def test_step_budget_stops_a_model_that_never_answers(cp: tp.RecoveryCheckpointer) -> None:
    """More model decisions than ``max_steps`` in one turn is STUCK: a person is asked."""
    model = PlanModel(plan=[("kb_search", {"q": str(i)}) for i in range(20)])
    graph = tp.create_recovery_agent(model, [read_tool("kb_search")], checkpointer=cp, max_steps=5)
    result = run(graph)

    assert "__interrupt__" in result
    assert len(model.asked) == 5
    assert "stuck_detected" in kinds(cp)


def test_retry_policy_validation_names_the_fix() -> None:
    """Invalid policies fail at build time with the fix in the message."""
    with pytest.raises(tp.ConfigurationError, match="max_attempts"):
        ToolPolicy(max_attempts=0)
    with pytest.raises(tp.ConfigurationError, match="multiplier"):
        Backoff(multiplier=0.5)
    with pytest.raises(tp.ConfigurationError, match="on_exhausted"):
        ToolPolicy(on_exhausted="ignore")  # type: ignore[arg-type]
    with tp.RecoveryCheckpointer.from_conn_string(":memory:") as cp:
        model = PlanModel(plan=[])
        with pytest.raises(tp.ConfigurationError, match="not one of the graph's tools"):
            tp.create_recovery_agent(
                model,
                [read_tool("kb_search")],
                checkpointer=cp,
                policies={"kb_search": ToolPolicy(fallback=["kb_backup"])},
            )
        with pytest.raises(tp.ConfigurationError, match="no tool has that name"):
            tp.create_recovery_agent(
                model, [read_tool("kb_search")], checkpointer=cp, policies={"kb": ToolPolicy()}
            )


# --- property: random failure sequences -------------------------------------------------------

OUTCOMES = st.sampled_from(["ok", "timeout", "refused", "lost"])


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    sequence=st.lists(OUTCOMES, min_size=0, max_size=8),
    max_attempts=st.integers(min_value=1, max_value=5),
    precheck=st.booleans(),
)
def test_random_failures_respect_policy_and_never_repeat_an_effect(
    sequence: list[str], max_attempts: int, precheck: bool
) -> None:
    """Attempts never exceed the policy, no effect runs twice, and every run terminates.

    Each call of the side-effecting tool takes the next outcome: "ok"; "timeout" and
    "refused" fail before anything happens; "lost" performs the effect, then times out.
    """
    performed: list[int] = []
    calls = 0

    def charge(ref: str) -> str:
        nonlocal calls
        calls += 1
        outcome = sequence[calls - 1] if calls <= len(sequence) else "ok"
        if outcome == "refused":
            raise ConnectionRefusedError("down")
        if outcome == "timeout":
            raise TimeoutError("no answer")  # failed before the service acted
        performed.append(calls)
        if outcome == "lost":
            raise TimeoutError("answer lost")
        return f"charged {ref}"

    def find(key: str, args: dict[str, Any]) -> tp.Done | tp.NotDone:
        return tp.Done("charged (found)") if performed else tp.NotDone()

    tool = tp.side_effect(
        StructuredTool.from_function(charge, name="charge", description="charge"),
        precheck=find if precheck else None,
    )
    with tp.RecoveryCheckpointer.from_conn_string(":memory:") as cp:
        graph = tp.create_recovery_agent(
            PlanModel(plan=[("charge", {"ref": "o-1"})]),
            [tool],
            checkpointer=cp,
            default_policy=ToolPolicy(max_attempts=max_attempts, backoff=FAST, on_exhausted="fail"),
        )
        with testing.fake_clock():
            result = run(graph)
        uncertain = [e.key for e in cp.ledger("t") if e.status == "uncertain"]

    assert calls <= max_attempts
    assert len(performed) <= 1  # never executed twice
    stage = result["flow"]["stage"]
    assert stage in ("closed", "failed", "awaiting_human")  # it terminated
    if stage == "closed":
        assert len(performed) == 1
    if stage == "awaiting_human":
        (request,) = result["__interrupt__"]
        if "stuck" in request.value["reason"]:
            # The same failure again and again is escalated, never replayed: nothing ran.
            assert not performed
            assert not uncertain
        else:
            # Stopped on a named effect whose outcome nobody can confirm: a person decides.
            assert uncertain
            assert request.value["uncertain_effects"][0]["key"] == uncertain[0]


def test_langgraph_retry_policy_on_a_recovery_node_is_refused() -> None:
    """One layer owns retries: a RetryPolicy on the act node is a configuration error."""
    from langchain_core.runnables import RunnableLambda
    from langgraph.graph import StateGraph
    from langgraph.types import RetryPolicy

    with tp.RecoveryCheckpointer.from_conn_string(":memory:") as cp:
        act = RecoveryExecutor([read_tool("kb_search")], checkpointer=cp)
        builder = StateGraph(RecoveryState)
        builder.add_node("act", RunnableLambda(act.invoke), retry_policy=RetryPolicy())
        builder.add_edge("__start__", "act")
        with pytest.raises(tp.ConfigurationError, match="one layer owns retries"):
            check_retry_owner(builder)
        plain = StateGraph(RecoveryState)
        plain.add_node("act", RunnableLambda(act.invoke))
        plain.add_edge("__start__", "act")
        check_retry_owner(plain.compile())  # without a retry policy: fine
