"""taskpilots-graph: LangGraph agents that continue from the right place after a failure.

The public API is re-exported here; everything else is an implementation detail.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from taskpilots_graph.agent import RecoveryGraph, check_retry_owner, create_recovery_agent
from taskpilots_graph.checkpointers import (
    ArtifactRef,
    ArtifactStore,
    AsyncRecoveryCheckpointer,
    FileArtifactStore,
    RecoveryCheckpointer,
)
from taskpilots_graph.checkpointers.density import CheckpointDensity
from taskpilots_graph.checkpointers.retention import PruneReport
from taskpilots_graph.coordinator import (
    CoordinationPlan,
    CoordinationReport,
    Coordinator,
    FailureAttribution,
    SubAgentReport,
    await_lock,
    create_coordinator,
)
from taskpilots_graph.errors import (
    ArtifactNotFound,
    ConfigurationError,
    CorruptRecordError,
    EffectInProgress,
    InvalidDecision,
    LeaseLost,
    LedgerConflict,
    LockBackendUnavailable,
    MigrationError,
    MutualWait,
    NoPendingTakeover,
    PendingTakeover,
    ResultDrifted,
    StorageError,
    TaskPilotsError,
    ThreadBusy,
    ThreadNotFound,
    ToolWaiting,
    UnsupportedOperation,
)
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.failures import Failure, FailureKind, classify
from taskpilots_graph.ledger import (
    CommittedEffect,
    Done,
    LedgerEntry,
    LedgerStatus,
    NotDone,
    SideEffectSpec,
    SideEffectUncertain,
    Unknown,
)
from taskpilots_graph.metrics import RecoveryMetrics, arecovery_metrics, recovery_metrics
from taskpilots_graph.nodes.compensate import CompensateNode
from taskpilots_graph.nodes.executor import RecoveryExecutor
from taskpilots_graph.nodes.router import RecoveryRouter, WaitNode
from taskpilots_graph.nodes.takeover import TakeoverNode
from taskpilots_graph.nodes.think import ResumeContext, ThinkNode
from taskpilots_graph.policy import Backoff, ModelPolicy, ToolPolicy
from taskpilots_graph.prompts import ResumeFacts, build_resume_prompt, resume_facts
from taskpilots_graph.recovery import Action, RecoveryDecision, decide_recovery
from taskpilots_graph.recovery_map import RecoveryMap, ToolRecovery, recovery_map
from taskpilots_graph.replay import Replay, ReplayStep, areplay, replay
from taskpilots_graph.runner import (
    adecide,
    apending_takeovers,
    aresume,
    arewind,
    arun,
    decide,
    pending_takeovers,
    resume,
    rewind,
    run,
)
from taskpilots_graph.state import FlowState, RecoveryState, StepRecord
from taskpilots_graph.supervisor import (
    Attribution,
    ScanReport,
    Supervisor,
    ThreadHealth,
    arecover,
    asupervise,
    recover,
    supervise,
)
from taskpilots_graph.takeover import Decision, TakeoverRequest
from taskpilots_graph.threads import (
    ThreadInfo,
    alist_threads,
    athread_info,
    list_threads,
    thread_info,
)
from taskpilots_graph.tools import Invocation, SideEffectTool, current_invocation, side_effect
from taskpilots_graph.window import MemoryWindow, ObservationPolicy

if TYPE_CHECKING:
    from taskpilots_graph import notebook
    from taskpilots_graph.middleware import RecoveryMiddleware, check_middleware

# The middleware needs the optional ``langchain`` package, the notebook views are for
# Jupyter: both are imported on first use.
_LAZY = frozenset({"RecoveryMiddleware", "check_middleware"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from taskpilots_graph import middleware

        return getattr(middleware, name)
    if name == "notebook":
        import importlib

        return importlib.import_module("taskpilots_graph.notebook")
    raise AttributeError(f"module 'taskpilots_graph' has no attribute {name!r}")


try:
    __version__ = version("taskpilots-graph")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "Action",
    "ArtifactNotFound",
    "ArtifactRef",
    "ArtifactStore",
    "AsyncRecoveryCheckpointer",
    "Attribution",
    "Backoff",
    "CheckpointDensity",
    "CommittedEffect",
    "CompensateNode",
    "ConfigurationError",
    "CoordinationPlan",
    "CoordinationReport",
    "Coordinator",
    "CorruptRecordError",
    "Decision",
    "Done",
    "EffectInProgress",
    "Event",
    "EventKind",
    "Failure",
    "FailureAttribution",
    "FailureKind",
    "FileArtifactStore",
    "FlowState",
    "InvalidDecision",
    "Invocation",
    "LeaseLost",
    "LedgerConflict",
    "LedgerEntry",
    "LedgerStatus",
    "LockBackendUnavailable",
    "MemoryWindow",
    "MigrationError",
    "ModelPolicy",
    "MutualWait",
    "NoPendingTakeover",
    "NotDone",
    "ObservationPolicy",
    "PendingTakeover",
    "PruneReport",
    "RecoveryCheckpointer",
    "RecoveryDecision",
    "RecoveryExecutor",
    "RecoveryGraph",
    "RecoveryMap",
    "RecoveryMetrics",
    "RecoveryMiddleware",
    "RecoveryRouter",
    "RecoveryState",
    "Replay",
    "ReplayStep",
    "ResultDrifted",
    "ResumeContext",
    "ResumeFacts",
    "ScanReport",
    "SideEffectSpec",
    "SideEffectTool",
    "SideEffectUncertain",
    "StepRecord",
    "StorageError",
    "SubAgentReport",
    "Supervisor",
    "TakeoverNode",
    "TakeoverRequest",
    "TaskPilotsError",
    "ThinkNode",
    "ThreadBusy",
    "ThreadHealth",
    "ThreadInfo",
    "ThreadNotFound",
    "ToolPolicy",
    "ToolRecovery",
    "ToolWaiting",
    "Unknown",
    "UnsupportedOperation",
    "WaitNode",
    "__version__",
    "adecide",
    "alist_threads",
    "apending_takeovers",
    "arecover",
    "arecovery_metrics",
    "areplay",
    "aresume",
    "arewind",
    "arun",
    "asupervise",
    "athread_info",
    "await_lock",
    "build_resume_prompt",
    "check_middleware",
    "check_retry_owner",
    "classify",
    "create_coordinator",
    "create_recovery_agent",
    "current_invocation",
    "decide",
    "decide_recovery",
    "list_threads",
    "notebook",
    "pending_takeovers",
    "recover",
    "recovery_map",
    "recovery_metrics",
    "replay",
    "resume",
    "resume_facts",
    "rewind",
    "run",
    "side_effect",
    "supervise",
    "thread_info",
]
