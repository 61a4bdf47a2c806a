"""Graph factories for the queue-worker tests, named by reference (``_worker_graph:build``).

Worker processes import this module and call ``build(checkpointer=..., leases=...)`` with
what they opened from ``--db`` / ``--leases``. The simulated services live in the SQLite
file named by ``TASKPILOTS_TEST_SERVICES``, outside every worker, so effects can be counted
after workers are killed.
"""

from __future__ import annotations

import os
from typing import Any

import taskpilots_graph as tp
from taskpilots_graph.demo.model import ScriptedTicketModel
from taskpilots_graph.demo.services import Services
from taskpilots_graph.demo.workflow import PROMPT, recovery_tools

SERVICES_ENV = "TASKPILOTS_TEST_SERVICES"
LEASE_TTL_ENV = "TASKPILOTS_TEST_LEASE_TTL"
LATENCY_ENV = "TASKPILOTS_TEST_LATENCY"


def build(*, checkpointer: Any, leases: Any) -> Any:
    """The demo's ticket workflow on the recovery agent, with the given lease backend."""
    services = Services(
        os.environ[SERVICES_ENV], latency_s=float(os.environ.get(LATENCY_ENV, "0.004"))
    )
    return tp.create_recovery_agent(
        ScriptedTicketModel(),
        recovery_tools(services),
        checkpointer=checkpointer,
        prompt=PROMPT,
        leases=leases,
        lease_ttl=float(os.environ.get(LEASE_TTL_ENV, "2.0")),
        name="tickets",
    )
