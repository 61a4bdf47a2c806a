"""The recovery map: per tool, its side-effect class, its policy and what each failure kind
leads to, derived from the same decisions the running agent makes; plus the warnings."""

from __future__ import annotations

import json
from typing import Any

import pytest
from langchain_core.tools import BaseTool, StructuredTool
from typer.testing import CliRunner

import taskpilots_graph as tp
from taskpilots_graph.cli import app as cli_app
from taskpilots_graph.recovery_map import MAP_KINDS, RecoveryMap, recovery_map
from taskpilots_graph.testing import ScriptedModel


def _tool(name: str) -> BaseTool:
    def run(query: str) -> str:
        return query

    return StructuredTool.from_function(run, name=name, description=f"the {name} tool")


def _undo(key: str, args: dict[str, Any], result: Any) -> None:
    return None


def _graph(cp: tp.RecoveryCheckpointer) -> Any:
    tools = [
        _tool("kb_search"),
        _tool("kb_backup"),
        tp.side_effect(
            _tool("create_ticket"), precheck=lambda k, a: tp.NotDone(), compensate=_undo
        ),
        tp.side_effect(_tool("charge")),
        tp.side_effect(_tool("send_mail"), idempotent=True, compensate=_undo),
    ]
    policies = {
        "kb_search": tp.ToolPolicy(max_attempts=3, fallback=["kb_backup"], confirm_drift=True),
        "create_ticket": tp.ToolPolicy(
            max_attempts=2,
            on_exhausted="compensate",
            backoff=tp.Backoff(initial=1, multiplier=3, max_delay=10, jitter=False),
        ),
        "send_mail": tp.ToolPolicy(fallback=["charge"], wait_window=60, on_exhausted="fail"),
    }
    return tp.create_recovery_agent(
        ScriptedModel(plan=[]), tools, checkpointer=cp, policies=policies
    )


@pytest.fixture
def rmap() -> RecoveryMap:
    with tp.RecoveryCheckpointer.from_conn_string("sqlite:///:memory:") as cp:
        cp.setup()
        return recovery_map(_graph(cp))


DEFAULTS = {
    "compensation": "no",
    "drift": "recorded, new result taken",
    "attempts": "5",
    "backoff": "2s x2, at most 60s, jitter",
    "fallback": "-",
    "on exhausted": "takeover",
    "transient": "retry up to 5 attempts, then ask a person",
    "rate_limited": "retry up to 5 attempts, then ask a person",
    "external_outage": "wait and retry (up to 5 attempts within 300s), then ask a person",
    "auth": "ask a person",
    "contract": "report the error to the model",
    "data_uncertain": "ask a person",
    "side_effect_uncertain": "ask a person",
    "stuck": "ask a person",
    "fatal": "fail the run",
}

EXPECTED = [
    {
        **DEFAULTS,
        "tool": "kb_search",
        "side effect": "read",
        "drift": "a person confirms",
        "attempts": "3",
        "fallback": "kb_backup",
        "transient": "retry up to 3 attempts, then degrade to kb_backup",
        "rate_limited": "retry up to 3 attempts, then degrade to kb_backup",
        "external_outage": (
            "wait and retry (up to 3 attempts within 300s), then degrade to kb_backup"
        ),
        "contract": "degrade to kb_backup",
        "side_effect_uncertain": "n/a (no side effect)",
    },
    {
        **DEFAULTS,
        "tool": "kb_backup",
        "side effect": "read",
        "side_effect_uncertain": "n/a (no side effect)",
    },
    {
        **DEFAULTS,
        "tool": "create_ticket",
        "side effect": "pre-checked",
        "compensation": "yes",
        "attempts": "2",
        "backoff": "1s x3, at most 10s",
        "on exhausted": "compensate",
        "transient": "retry up to 2 attempts, then compensate committed effects, then fail",
        "rate_limited": "retry up to 2 attempts, then compensate committed effects, then fail",
        "external_outage": (
            "wait and retry (up to 2 attempts within 300s), "
            "then compensate committed effects, then fail"
        ),
        "side_effect_uncertain": (
            "pre-check: done → keep its result; not done → run again; unknown → ask a person"
        ),
    },
    {**DEFAULTS, "tool": "charge", "side effect": "may become uncertain"},
    {
        **DEFAULTS,
        "tool": "send_mail",
        "side effect": "idempotent",
        "compensation": "yes",
        "fallback": "charge",
        "on exhausted": "fail",
        "transient": "retry up to 5 attempts, then degrade to charge",
        "rate_limited": "retry up to 5 attempts, then degrade to charge",
        "external_outage": "wait and retry (up to 5 attempts within 60s), then degrade to charge",
        "contract": "degrade to charge",
        "side_effect_uncertain": "run again with the same key",
    },
]


def test_table_is_exact(rmap: RecoveryMap) -> None:
    """Every row, every column: effect class, policy, and the outcome of each failure kind."""
    assert rmap.table() == EXPECTED
    head = ["tool", "side effect", "compensation", "drift", "attempts", "backoff", "fallback"]
    assert list(rmap.table()[0]) == [*head, "on exhausted", *(k.value for k in MAP_KINDS)]


def test_warnings_name_the_mistakes_it_can_see(rmap: RecoveryMap) -> None:
    """An unguarded non-idempotent effect, and a fallback that is one."""
    assert rmap.warnings == (
        "charge: a non-idempotent side effect with neither pre-check nor compensation; an "
        "uncertain outcome always needs a person, and an abandoned run cannot undo it",
        "send_mail: falls back to charge, a side effect without a pre-check; degrading may "
        "perform an effect whose outcome nobody can check",
    )


def test_a_well_guarded_graph_has_no_warnings() -> None:
    """Pre-checked or compensated effects and read fallbacks raise nothing."""
    with tp.RecoveryCheckpointer.from_conn_string("sqlite:///:memory:") as cp:
        cp.setup()
        graph = tp.create_recovery_agent(
            ScriptedModel(plan=[]),
            [_tool("a"), _tool("b"), tp.side_effect(_tool("c"), compensate=_undo)],
            checkpointer=cp,
            policies={"a": tp.ToolPolicy(fallback=["b"])},
        )
        assert recovery_map(graph).warnings == ()


def test_mermaid_flowchart(rmap: RecoveryMap) -> None:
    """Each tool is a node, outcomes are grouped by failure kinds, fallbacks are dotted."""
    text = rmap.mermaid()
    lines = text.splitlines()
    assert lines[0] == "flowchart LR"
    assert '  t0["kb_search<br/>read"]' in lines
    assert '  t0 -.->|"fallback"| t1' in lines
    assert '  t4 -.->|"fallback"| t3' in lines
    assert (
        '  t3 -->|"auth, data_uncertain, side_effect_uncertain, stuck"| t3o2("ask a person")'
        in lines
    )
    assert '  t0 -->|"contract"| t0o3("degrade to kb_backup")' in lines


def test_html_is_escaped_and_has_no_script() -> None:
    """Tool names reach the HTML escaped; the warnings are listed."""
    with tp.RecoveryCheckpointer.from_conn_string("sqlite:///:memory:") as cp:
        cp.setup()
        graph = tp.create_recovery_agent(
            ScriptedModel(plan=[]), [tp.side_effect(_tool("x<script>"))], checkpointer=cp
        )
        page = recovery_map(graph)._repr_html_()
    assert "<script>" not in page
    assert "x&lt;script&gt;" in page
    assert "<li>x&lt;script&gt;: a non-idempotent side effect" in page
    assert "may become uncertain" in str(recovery_map(graph))


def test_a_graph_without_executor_is_refused() -> None:
    """recovery_map of something that is not a recovery agent raises ConfigurationError."""
    with pytest.raises(tp.ConfigurationError, match="create_recovery_agent"):
        recovery_map(object())


def test_map_command_prints_the_table_the_flowchart_and_json() -> None:
    """``taskpilots map module:attr``: text with warnings, --mermaid, --json."""
    runner = CliRunner()
    text = runner.invoke(cli_app, ["map", "test_recovery_map:_graph"])
    assert text.exit_code == 0, text.output
    assert "charge (may become uncertain)" in text.output
    assert "warning: send_mail: falls back to charge" in text.output
    flow = runner.invoke(cli_app, ["map", "test_recovery_map:_graph", "--mermaid"])
    assert flow.output.startswith("flowchart LR\n")
    data = json.loads(runner.invoke(cli_app, ["map", "test_recovery_map:_graph", "--json"]).output)
    assert data["tools"] == EXPECTED
    assert len(data["warnings"]) == 2
    bad = runner.invoke(cli_app, ["map", "no_such_module:graph"])
    assert bad.exit_code == 1
    assert "cannot import" in bad.output
