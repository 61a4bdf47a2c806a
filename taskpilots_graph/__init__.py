"""taskpilots-graph: LangGraph agents that continue from the right place after a failure.

The public API is re-exported here; everything else is an implementation detail.

Every public name is imported from its submodule on first use (PEP 562), so
``import taskpilots_graph`` (and the ``taskpilots`` command) loads neither LangGraph nor
any optional dependency; ``from taskpilots_graph import run`` loads what ``run`` needs.
"""

from __future__ import annotations

import sys
from importlib import import_module
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from taskpilots_graph import notebook
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
        PrecheckError,
        ResultDrifted,
        StaleDecision,
        StorageBusy,
        StorageError,
        StorageReadOnly,
        StorageUnavailable,
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
        CompensationUncertain,
        Done,
        LedgerEntry,
        LedgerStatus,
        NotDone,
        SideEffectSpec,
        SideEffectUncertain,
        Unknown,
    )
    from taskpilots_graph.metrics import RecoveryMetrics, arecovery_metrics, recovery_metrics
    from taskpilots_graph.middleware import RecoveryMiddleware, check_middleware
    from taskpilots_graph.nodes.compensate import CompensateNode
    from taskpilots_graph.nodes.executor import RecoveryExecutor
    from taskpilots_graph.nodes.router import RecoveryRouter, WaitNode
    from taskpilots_graph.nodes.takeover import TakeoverNode
    from taskpilots_graph.nodes.think import ResumeContext, ThinkNode
    from taskpilots_graph.nodes.toolnode import ToolNode
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

    __version__: str

# Where each public name lives (submodule of this package: names). ``notebook`` is itself a
# submodule; ``__version__`` comes from the installed distribution.
_SOURCES: dict[str, tuple[str, ...]] = {
    "agent": ("RecoveryGraph", "check_retry_owner", "create_recovery_agent"),
    "checkpointers": (
        "ArtifactRef",
        "ArtifactStore",
        "AsyncRecoveryCheckpointer",
        "FileArtifactStore",
        "RecoveryCheckpointer",
    ),
    "checkpointers.density": ("CheckpointDensity",),
    "checkpointers.retention": ("PruneReport",),
    "coordinator": (
        "CoordinationPlan",
        "CoordinationReport",
        "Coordinator",
        "FailureAttribution",
        "SubAgentReport",
        "await_lock",
        "create_coordinator",
    ),
    "errors": (
        "ArtifactNotFound",
        "ConfigurationError",
        "CorruptRecordError",
        "EffectInProgress",
        "InvalidDecision",
        "LeaseLost",
        "LedgerConflict",
        "LockBackendUnavailable",
        "MigrationError",
        "MutualWait",
        "NoPendingTakeover",
        "PendingTakeover",
        "PrecheckError",
        "ResultDrifted",
        "StaleDecision",
        "StorageBusy",
        "StorageError",
        "StorageReadOnly",
        "StorageUnavailable",
        "TaskPilotsError",
        "ThreadBusy",
        "ThreadNotFound",
        "ToolWaiting",
        "UnsupportedOperation",
    ),
    "events": ("Event", "EventKind"),
    "failures": ("Failure", "FailureKind", "classify"),
    "ledger": (
        "CommittedEffect",
        "CompensationUncertain",
        "Done",
        "LedgerEntry",
        "LedgerStatus",
        "NotDone",
        "SideEffectSpec",
        "SideEffectUncertain",
        "Unknown",
    ),
    "metrics": ("RecoveryMetrics", "arecovery_metrics", "recovery_metrics"),
    "middleware": ("RecoveryMiddleware", "check_middleware"),
    "nodes.compensate": ("CompensateNode",),
    "nodes.executor": ("RecoveryExecutor",),
    "nodes.router": ("RecoveryRouter", "WaitNode"),
    "nodes.takeover": ("TakeoverNode",),
    "nodes.think": ("ResumeContext", "ThinkNode"),
    "nodes.toolnode": ("ToolNode",),
    "policy": ("Backoff", "ModelPolicy", "ToolPolicy"),
    "prompts": ("ResumeFacts", "build_resume_prompt", "resume_facts"),
    "recovery": ("Action", "RecoveryDecision", "decide_recovery"),
    "recovery_map": ("RecoveryMap", "ToolRecovery", "recovery_map"),
    "replay": ("Replay", "ReplayStep", "areplay", "replay"),
    "runner": (
        "adecide",
        "apending_takeovers",
        "aresume",
        "arewind",
        "arun",
        "decide",
        "pending_takeovers",
        "resume",
        "rewind",
        "run",
    ),
    "state": ("FlowState", "RecoveryState", "StepRecord"),
    "supervisor": (
        "Attribution",
        "ScanReport",
        "Supervisor",
        "ThreadHealth",
        "arecover",
        "asupervise",
        "recover",
        "supervise",
    ),
    "takeover": ("Decision", "TakeoverRequest"),
    "threads": ("ThreadInfo", "alist_threads", "athread_info", "list_threads", "thread_info"),
    "tools": ("Invocation", "SideEffectTool", "current_invocation", "side_effect"),
    "window": ("MemoryWindow", "ObservationPolicy"),
}
_EXPORTS: dict[str, str] = {
    name: f"taskpilots_graph.{module}" for module, names in _SOURCES.items() for name in names
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(import_module(module), name)
    elif name == "notebook":
        value = import_module("taskpilots_graph.notebook")
    elif name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("taskpilots-graph")
        except PackageNotFoundError:  # pragma: no cover - running from a source tree
            value = "0.0.0"
    else:
        raise AttributeError(f"module 'taskpilots_graph' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(ModuleType):
    """This package's module type: a loaded submodule never hides a public name.

    The import system binds every loaded submodule on its package, so loading
    ``taskpilots_graph.replay`` would make ``taskpilots_graph.replay`` the module instead of
    the :func:`replay` function (``recovery_map`` likewise). Those bindings are skipped.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

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
    "CompensationUncertain",
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
    "PrecheckError",
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
    "StaleDecision",
    "StepRecord",
    "StorageBusy",
    "StorageError",
    "StorageReadOnly",
    "StorageUnavailable",
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
    "ToolNode",
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
