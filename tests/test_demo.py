"""The demo CLI, run as a user would: ``python -m taskpilots_graph.demo --json``.

A real subprocess (the package is installed editable, so no PYTHONPATH is needed): the
ticket batch is SIGKILLed at the demo's own kill points, once on the recovery agent and once
on plain LangGraph. The agent must close or hand over every ticket without a duplicate side
effect, plain LangGraph must repeat some, and the CLI must exit 0 (it exits 1 on any
duplicate of the agent).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

TICKETS = 6


@pytest.mark.timeout(600)  # two drills of ~8 worker starts each, 1.5-6 s per start
def test_demo_cli_json() -> None:
    cmd = [sys.executable, "-m", "taskpilots_graph.demo", "--json"]
    cmd += ["--tickets", str(TICKETS), "--timed-kills", "0"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=540, stdin=subprocess.DEVNULL, check=False
    )
    context = f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, context
    summary = json.loads(done.stdout)
    agent, plain = summary["agent"], summary["plain"]

    assert agent["tickets"] == plain["tickets"] == TICKETS, context
    assert agent["kills"] > 0, f"the demo never killed its worker: {context}"
    assert agent["duplicates"] == 0, context
    assert agent["closed"] + len(agent["stopped_uncertain"]) == TICKETS, context
    assert agent["incomplete"] == [], context
    # Every ticket the agent handed over names the effect a person must decide on.
    assert len(agent["uncertain_keys"]) >= len(agent["stopped_uncertain"]), context
    assert plain["kills"] > 0, context
    assert plain["duplicates"] > 0, f"plain LangGraph repeated nothing: {context}"
