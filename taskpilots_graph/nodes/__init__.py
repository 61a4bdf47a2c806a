"""Graph nodes of the recovery agent, usable in any ``StateGraph`` with a ``messages`` channel."""

from __future__ import annotations

from taskpilots_graph.nodes.executor import RecoveryExecutor
from taskpilots_graph.nodes.think import ThinkNode

__all__ = ["RecoveryExecutor", "ThinkNode"]
