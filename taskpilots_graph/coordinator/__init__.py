"""Multi-agent coordination: run sub-agents as threads of their own, watch them, attribute
failures and recover only what failed.

* :func:`create_coordinator` builds a :class:`Coordinator` over sub-agent graphs (what it
  does, dependencies, shared objects and their :class:`Share` policies: its docstring).
  ``Coordinator.run(parent, inputs)`` (or ``arun``) drives them and returns a
  :class:`CoordinationReport`; run it again in any process to continue after a crash.
* :func:`await_lock` takes a business lock visibly, so a coordinator can report sub-agents
  waiting on each other as STUCK (:class:`MutualWait` ends the waits).
* The pure parts (:class:`CoordinationPlan`, :func:`plan_recovery`, :func:`find_cycle`,
  :class:`FailureAttribution`) can be used on their own.

Sub-agent graphs can also be nodes of a parent LangGraph graph (LangGraph's own subgraph
mechanism): their side effects keep their ledger keys across resumes, because keys use the
graph namespace without task ids.
"""

from taskpilots_graph.coordinator._plan import (
    CoordinationPlan,
    FailureAttribution,
    Share,
    SharedEffect,
    SharePolicy,
    SubAgentState,
    SubTask,
    SubTaskRecovery,
    attempt_thread_id,
    find_cycle,
    plan_recovery,
)
from taskpilots_graph.coordinator._report import CoordinationReport, SubAgentReport
from taskpilots_graph.coordinator._run import Coordinator, create_coordinator
from taskpilots_graph.coordinator._waits import await_lock, wait_edges
from taskpilots_graph.errors import MutualWait

__all__ = [
    "CoordinationPlan",
    "CoordinationReport",
    "Coordinator",
    "FailureAttribution",
    "MutualWait",
    "Share",
    "SharePolicy",
    "SharedEffect",
    "SubAgentReport",
    "SubAgentState",
    "SubTask",
    "SubTaskRecovery",
    "attempt_thread_id",
    "await_lock",
    "create_coordinator",
    "find_cycle",
    "plan_recovery",
    "wait_edges",
]
