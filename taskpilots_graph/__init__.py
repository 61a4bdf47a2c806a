"""taskpilots-graph: LangGraph agents that continue from the right place after a failure.

The public API is re-exported here; everything else is an implementation detail.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from taskpilots_graph.agent import create_recovery_agent
from taskpilots_graph.checkpointers import AsyncRecoveryCheckpointer, RecoveryCheckpointer
from taskpilots_graph.errors import (
    ConfigurationError,
    CorruptRecordError,
    LedgerConflict,
    MigrationError,
    PendingTakeover,
    StorageError,
    TaskPilotsError,
    ThreadNotFound,
    UnsupportedOperation,
)
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.ledger import (
    Done,
    LedgerEntry,
    LedgerStatus,
    NotDone,
    SideEffectSpec,
    SideEffectUncertain,
    Unknown,
)
from taskpilots_graph.nodes.executor import RecoveryExecutor
from taskpilots_graph.nodes.think import ThinkNode
from taskpilots_graph.runner import aresume, resume
from taskpilots_graph.state import RecoveryState
from taskpilots_graph.tools import Invocation, SideEffectTool, current_invocation, side_effect

try:
    __version__ = version("taskpilots-graph")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AsyncRecoveryCheckpointer",
    "ConfigurationError",
    "CorruptRecordError",
    "Done",
    "Event",
    "EventKind",
    "Invocation",
    "LedgerConflict",
    "LedgerEntry",
    "LedgerStatus",
    "MigrationError",
    "NotDone",
    "PendingTakeover",
    "RecoveryCheckpointer",
    "RecoveryExecutor",
    "RecoveryState",
    "SideEffectSpec",
    "SideEffectTool",
    "SideEffectUncertain",
    "StorageError",
    "TaskPilotsError",
    "ThinkNode",
    "ThreadNotFound",
    "Unknown",
    "UnsupportedOperation",
    "__version__",
    "aresume",
    "create_recovery_agent",
    "current_invocation",
    "resume",
    "side_effect",
]
