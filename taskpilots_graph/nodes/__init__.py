"""Graph nodes of the recovery agent, usable in any ``StateGraph`` with a ``messages`` channel."""

from __future__ import annotations

from taskpilots_graph.nodes.compensate import CompensateNode
from taskpilots_graph.nodes.executor import RecoveryExecutor
from taskpilots_graph.nodes.router import RecoveryRouter, WaitNode
from taskpilots_graph.nodes.takeover import TakeoverNode
from taskpilots_graph.nodes.think import ThinkNode

__all__ = [
    "CompensateNode",
    "RecoveryExecutor",
    "RecoveryRouter",
    "TakeoverNode",
    "ThinkNode",
    "WaitNode",
]
