"""taskpilots-graph: LangGraph agents that continue from the right place after a failure.

The public API is re-exported here; everything else is an implementation detail.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from taskpilots_graph.agent import check_retry_owner, create_recovery_agent
from taskpilots_graph.checkpointers import (
    ArtifactRef,
    ArtifactStore,
    AsyncRecoveryCheckpointer,
    FileArtifactStore,
    RecoveryCheckpointer,
)
from taskpilots_graph.errors import (
    ArtifactNotFound,
    ConfigurationError,
    CorruptRecordError,
    InvalidDecision,
    LeaseLost,
    LedgerConflict,
    LockBackendUnavailable,
    MigrationError,
    NoPendingTakeover,
    PendingTakeover,
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
    Done,
    LedgerEntry,
    LedgerStatus,
    NotDone,
    SideEffectSpec,
    SideEffectUncertain,
    Unknown,
)
from taskpilots_graph.nodes.compensate import CompensateNode
from taskpilots_graph.nodes.executor import RecoveryExecutor
from taskpilots_graph.nodes.router import RecoveryRouter, WaitNode
from taskpilots_graph.nodes.takeover import TakeoverNode
from taskpilots_graph.nodes.think import ResumeContext, ThinkNode
from taskpilots_graph.policy import Backoff, ModelPolicy, ToolPolicy
from taskpilots_graph.prompts import ResumeFacts, build_resume_prompt, resume_facts
from taskpilots_graph.recovery import Action, RecoveryDecision, decide_recovery
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
from taskpilots_graph.takeover import Decision, TakeoverRequest
from taskpilots_graph.tools import Invocation, SideEffectTool, current_invocation, side_effect

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
    "Backoff",
    "CompensateNode",
    "ConfigurationError",
    "CorruptRecordError",
    "Decision",
    "Done",
    "Event",
    "EventKind",
    "Failure",
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
    "MigrationError",
    "ModelPolicy",
    "NoPendingTakeover",
    "NotDone",
    "PendingTakeover",
    "RecoveryCheckpointer",
    "RecoveryDecision",
    "RecoveryExecutor",
    "RecoveryRouter",
    "RecoveryState",
    "ResumeContext",
    "ResumeFacts",
    "SideEffectSpec",
    "SideEffectTool",
    "SideEffectUncertain",
    "StepRecord",
    "StorageError",
    "TakeoverNode",
    "TakeoverRequest",
    "TaskPilotsError",
    "ThinkNode",
    "ThreadBusy",
    "ThreadNotFound",
    "ToolPolicy",
    "ToolWaiting",
    "Unknown",
    "UnsupportedOperation",
    "WaitNode",
    "__version__",
    "adecide",
    "apending_takeovers",
    "aresume",
    "arewind",
    "arun",
    "build_resume_prompt",
    "check_retry_owner",
    "classify",
    "create_recovery_agent",
    "current_invocation",
    "decide",
    "decide_recovery",
    "pending_takeovers",
    "resume",
    "resume_facts",
    "rewind",
    "run",
    "side_effect",
]
