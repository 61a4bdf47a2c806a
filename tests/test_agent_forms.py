"""The two agent forms decide alike about the same tool call.

``create_recovery_agent`` and ``create_agent`` + ``RecoveryMiddleware`` are given the same
tools, the same policies and the same scripted model; each scenario then compares how often
each tool body ran, the ledger each form left, and the sequence of tool-level events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from _models import PlanModel
from langchain.agents import create_agent
from langchain_core.tools import BaseTool, tool

import taskpilots_graph as tp
from taskpilots_graph.events import EventKind
from taskpilots_graph.middleware import RecoveryMiddleware
from taskpilots_graph.testing import fake_clock

# Events about one tool call that both forms write (the forms differ in model-side events).
TOOL_EVENTS = {
    EventKind.TOOL_INVOKED,
    EventKind.TOOL_SUCCEEDED,
    EventKind.TOOL_FAILED,
    EventKind.RETRY_SCHEDULED,
    EventKind.DEGRADED,
    EventKind.TAKEOVER_REQUESTED,
    EventKind.STUCK_DETECTED,
    EventKind.DECISION_RECORDED,
    EventKind.COMPENSATED,
    EventKind.EFFECT_UNCERTAIN,
    EventKind.REPEAT_CAUGHT,
}


class Jammed(Exception):
    """A failure the user declares fatal, whatever the default taxonomy says."""


class Unreadable(Exception):
    """The service answered in a shape the tool does not understand (a contract failure)."""


@dataclass
class Scenario:
    """Tools (built fresh per form, counting their calls), policies and the model's plan."""

    plan: list[tuple[str, dict[str, Any]]]
    tools: Callable[[dict[str, int]], list[BaseTool]]
    policies: dict[str, tp.ToolPolicy] = field(default_factory=dict)
    decision: tp.Decision | None = None
    """A person's answer to the takeover the run stops on, if any."""


def _jammed_printer(calls: dict[str, int]) -> list[BaseTool]:
    @tool
    def print_label(order: str) -> str:
        """Print a shipping label."""
        calls["print_label"] = calls.get("print_label", 0) + 1
        raise Jammed("the printer is jammed")

    return [print_label]


def _flaky_lookup(calls: dict[str, int]) -> list[BaseTool]:
    @tool
    def lookup(sku: str) -> str:
        """Look a product up."""
        calls["lookup"] = calls.get("lookup", 0) + 1
        raise ConnectionResetError("reset by peer")

    return [lookup]


def _outage_with_fallback(calls: dict[str, int]) -> list[BaseTool]:
    @tool
    def quote_primary(weight: int) -> str:
        """Quote a carrier price."""
        calls["quote_primary"] = calls.get("quote_primary", 0) + 1
        raise ConnectionRefusedError("carrier API down")

    @tool
    def quote_backup(weight: int) -> str:
        """Quote a carrier price from the backup carrier."""
        calls["quote_backup"] = calls.get("quote_backup", 0) + 1
        return f"{weight * 2} EUR"

    return [quote_primary, quote_backup]


def _unreadable_feed(calls: dict[str, int]) -> list[BaseTool]:
    @tool
    def read_feed(feed: str) -> str:
        """Read a supplier's stock feed."""
        calls["read_feed"] = calls.get("read_feed", 0) + 1
        raise Unreadable("the feed is not JSON")

    return [read_feed]


def _lost_reply(calls: dict[str, int]) -> list[BaseTool]:
    """A refund whose first reply is lost after the refund was made; a booking before it."""

    def undo_booking(key: str, args: dict[str, Any], result: Any) -> None:
        calls["undo_booking"] = calls.get("undo_booking", 0) + 1

    @tp.side_effect(compensate=undo_booking)
    @tool
    def book_courier(order: str) -> str:
        """Book a courier for an order."""
        calls["book_courier"] = calls.get("book_courier", 0) + 1
        return f"courier for {order}"

    @tp.side_effect()
    @tool
    def refund(order: str, amount: int) -> str:
        """Refund an order."""
        calls["refund"] = calls.get("refund", 0) + 1
        if calls["refund"] == 1:
            raise TimeoutError("the reply never came")
        return f"refunded {amount} on {order}"

    return [book_courier, refund]


def _effect_then_read(calls: dict[str, int]) -> list[BaseTool]:
    @tp.side_effect(idempotent=True)
    @tool
    def book_slot(day: str) -> str:
        """Book a delivery slot."""
        calls["book_slot"] = calls.get("book_slot", 0) + 1
        return f"slot on {day}"

    return [book_slot]


FAST = tp.Backoff(initial=0.01, jitter=False)
SCENARIOS = {
    "user rule says fatal": Scenario(
        plan=[("print_label", {"order": "A-1"})],
        tools=_jammed_printer,
        policies={
            "print_label": tp.ToolPolicy(
                max_attempts=3, backoff=FAST, rules=[(Jammed, tp.FailureKind.FATAL)]
            )
        },
    ),
    "transient until attempts run out": Scenario(
        plan=[("lookup", {"sku": "S-9"})],
        tools=_flaky_lookup,
        policies={"lookup": tp.ToolPolicy(max_attempts=3, backoff=FAST)},
    ),
    "outage degrades to the fallback": Scenario(
        plan=[("quote_primary", {"weight": 3})],
        tools=_outage_with_fallback,
        policies={
            "quote_primary": tp.ToolPolicy(
                max_attempts=2, backoff=FAST, wait_window=0.0, fallback=("quote_backup",)
            )
        },
    ),
    "the model repeats a call that keeps failing": Scenario(
        plan=[("read_feed", {"feed": "north"})] * 4,
        tools=_unreadable_feed,
        policies={
            "read_feed": tp.ToolPolicy(
                backoff=FAST, stuck_after=3, rules=[(Unreadable, tp.FailureKind.CONTRACT)]
            )
        },
    ),
    **{
        f"an uncertain refund, then {decision.action}": Scenario(
            plan=[("book_courier", {"order": "B-7"}), ("refund", {"order": "B-7", "amount": 40})],
            tools=_lost_reply,
            decision=decision,
        )
        for decision in (
            tp.Decision(action="retry"),
            tp.Decision(action="skip"),
            tp.Decision(action="provide_result", result="refunded 40 on B-7"),
            tp.Decision(action="edit_args", args={"order": "B-7", "amount": 30}),
            tp.Decision(action="abandon"),
        )
    },
    "a side effect, twice in the plan": Scenario(
        plan=[("book_slot", {"day": "mon"}), ("book_slot", {"day": "mon"})],
        tools=_effect_then_read,
    ),
}


@dataclass
class Outcome:
    calls: dict[str, int]
    ledger: list[tuple[str, str]]
    events: list[tuple[str, str]]
    failed: bool
    """The run failed: the middleware raises the tool's error out of ``invoke``, the
    recovery agent ends with its flow stage ``failed`` (its state says why)."""


def _send(graph: Any, entry: str, thread_id: str) -> Any:
    """The user's "go" through one entry point; the thread's values afterwards."""
    message = {"messages": [("user", "go")]}
    config: Any = {"configurable": {"thread_id": thread_id}}
    if entry == "invoke":
        return graph.invoke(message, config)
    if entry == "stream":
        for _ in graph.stream(message, config):
            pass
        return graph.get_state(config).values
    return tp.run(graph, thread_id, message)


def _run(
    form: str,
    scenario: Scenario,
    cp: tp.RecoveryCheckpointer,
    thread_id: str,
    *,
    entry: str = "invoke",
    times: int = 1,
) -> Outcome:
    calls: dict[str, int] = {}
    tools = scenario.tools(calls)
    model = PlanModel(plan=scenario.plan)
    if form == "recovery agent":
        graph: Any = tp.create_recovery_agent(
            model, tools, checkpointer=cp, policies=scenario.policies
        )
    else:
        graph = create_agent(
            model,
            tools,
            checkpointer=cp,
            middleware=[RecoveryMiddleware(cp, policies=scenario.policies)],
        )
    failed = False
    with fake_clock():
        try:
            for _ in range(times):  # the same command again: nothing may run twice
                out = _send(graph, entry, thread_id)
        except Exception as exc:
            failed = form == "middleware" and isinstance(exc, (Jammed, ConnectionError))
            if not failed:
                raise
        else:
            failed = (out.get("flow") or {}).get("stage") == "failed"
        if scenario.decision is not None:
            tp.decide(graph, thread_id, scenario.decision)
    return Outcome(
        calls=calls,
        ledger=sorted((e.tool, e.status.value) for e in cp.ledger(thread_id)),
        events=[
            (e.kind.value, str(e.payload.get("using") or e.payload.get("tool")))
            for e in cp.events(thread_id)
            if e.kind in TOOL_EVENTS
        ],
        failed=failed,
    )


@pytest.fixture
def cp(sqlite_path: str) -> Iterator[tp.RecoveryCheckpointer]:
    with tp.RecoveryCheckpointer.from_conn_string(sqlite_path) as saver:
        saver.setup()
        yield saver


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_both_forms_decide_alike(name: str, cp: tp.RecoveryCheckpointer) -> None:
    scenario = SCENARIOS[name]
    agent = _run("recovery agent", scenario, cp, "forms-agent")
    middleware = _run("middleware", scenario, cp, "forms-middleware")
    assert middleware.calls == agent.calls
    assert middleware.ledger == agent.ledger
    assert middleware.events == agent.events
    assert middleware.failed == agent.failed


@pytest.mark.parametrize("entry", ["stream", "tp.run"])
@pytest.mark.parametrize(
    "name",
    [
        "user rule says fatal",
        "the model repeats a call that keeps failing",
        "an uncertain refund, then retry",
        "a side effect, twice in the plan",
    ],
)
def test_both_forms_decide_alike_on_every_entry_point(
    name: str, entry: str, cp: tp.RecoveryCheckpointer
) -> None:
    scenario = SCENARIOS[name]
    agent = _run("recovery agent", scenario, cp, "entry-agent", entry=entry)
    middleware = _run("middleware", scenario, cp, "entry-middleware", entry=entry)
    assert middleware.calls == agent.calls
    assert middleware.ledger == agent.ledger
    assert middleware.events == agent.events
    assert middleware.failed == agent.failed


@pytest.mark.parametrize("entry", ["invoke", "stream", "tp.run"])
def test_the_same_command_twice_performs_the_effect_once_in_both_forms(
    entry: str, cp: tp.RecoveryCheckpointer
) -> None:
    """The model plans the booking again for the repeated command (it reads only its
    messages); the ledger answers from the recorded result in both forms."""
    scenario = SCENARIOS["a side effect, twice in the plan"]
    for form, thread_id in (("recovery agent", "twice-a"), ("middleware", "twice-m")):
        outcome = _run(form, scenario, cp, thread_id, entry=entry, times=2)
        assert outcome.calls == {"book_slot": 1}, form
        assert outcome.ledger == [("book_slot", "committed")], form
        kinds = [kind for kind, _ in outcome.events]
        assert kinds.count("tool_invoked") == 1, form
        assert kinds.count("repeat_caught") == 3, form


def test_a_repeated_failure_is_stuck_in_both_forms(cp: tp.RecoveryCheckpointer) -> None:
    """The third call failing the same way goes to a person instead of to the model."""
    scenario = SCENARIOS["the model repeats a call that keeps failing"]
    for form, thread_id in (("recovery agent", "stuck-a"), ("middleware", "stuck-m")):
        outcome = _run(form, scenario, cp, thread_id)
        assert outcome.calls == {"read_feed": 3}, form
        kinds = [kind for kind, _ in outcome.events]
        assert kinds[-2:] == ["stuck_detected", "takeover_requested"], form


def test_a_fatal_user_rule_stops_after_one_call(cp: tp.RecoveryCheckpointer) -> None:
    """The rule the two forms once disagreed on: a user's FATAL rule wins over retries."""
    scenario = SCENARIOS["user rule says fatal"]
    for form, thread_id in (("recovery agent", "fatal-a"), ("middleware", "fatal-m")):
        outcome = _run(form, scenario, cp, thread_id)
        assert outcome.calls == {"print_label": 1}, form
        assert outcome.failed, form
        failed = [e for e in cp.events(thread_id) if e.kind is EventKind.TOOL_FAILED]
        assert [e.payload["failure"]["kind"] for e in failed] == ["fatal"], form


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        ("retry", {"book_courier": 1, "refund": 2}),
        ("skip", {"book_courier": 1, "refund": 1}),
        ("provide_result", {"book_courier": 1, "refund": 1}),
        ("edit_args", {"book_courier": 1, "refund": 2}),
        ("abandon", {"book_courier": 1, "refund": 1, "undo_booking": 1}),
    ],
)
def test_each_decision_does_what_it_says_in_both_forms(
    action: str, expected: dict[str, int], cp: tp.RecoveryCheckpointer
) -> None:
    scenario = SCENARIOS[f"an uncertain refund, then {action}"]
    for form, thread_id in (("recovery agent", "d-a"), ("middleware", "d-m")):
        outcome = _run(form, scenario, cp, thread_id)
        assert outcome.calls == expected, form
        kinds = [kind for kind, _ in outcome.events]
        assert kinds.count("takeover_requested") == 1, form
        assert kinds.count("decision_recorded") == 1, form
