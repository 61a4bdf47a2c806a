"""taskpilots-graph: LangGraph agents that continue from the right place after a failure.

This module is the front door: storage, side-effect tools, the agent forms, running and
resuming, takeovers, metrics and the common errors. Everything else lives in a named
submodule and is imported from there, e.g. ``taskpilots_graph.errors`` (every error),
``taskpilots_graph.nodes`` and ``taskpilots_graph.state`` (building blocks for your own
graph), ``taskpilots_graph.supervisor``, ``taskpilots_graph.coordinator``,
``taskpilots_graph.replay``, ``taskpilots_graph.notebook`` (Jupyter views).

Every public name is imported from its submodule on first use (PEP 562), so
``import taskpilots_graph`` (and the ``taskpilots`` command) loads neither LangGraph nor
any optional dependency; ``from taskpilots_graph import run`` loads what ``run`` needs.
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from taskpilots_graph.agent import create_recovery_agent
    from taskpilots_graph.checkpointers import AsyncRecoveryCheckpointer, RecoveryCheckpointer
    from taskpilots_graph.decisions import adecide, apending_takeovers, decide, pending_takeovers
    from taskpilots_graph.errors import (
        ConfigurationError,
        PendingTakeover,
        TaskPilotsError,
        ThreadBusy,
    )
    from taskpilots_graph.events import Event, EventKind
    from taskpilots_graph.failures import FailureKind
    from taskpilots_graph.ledger import (
        Done,
        LedgerEntry,
        LedgerStatus,
        NotDone,
        SideEffectUncertain,
        Unknown,
    )
    from taskpilots_graph.metrics import RecoveryMetrics, arecovery_metrics, recovery_metrics
    from taskpilots_graph.middleware import RecoveryMiddleware
    from taskpilots_graph.middleware.toolnode import ToolNode
    from taskpilots_graph.policy import Backoff, ModelPolicy, ToolPolicy
    from taskpilots_graph.runner import aresume, arewind, arun, resume, rewind, run
    from taskpilots_graph.takeover import Decision, TakeoverRequest
    from taskpilots_graph.thread_listing import alist_threads, list_threads
    from taskpilots_graph.threads import athread_info, thread_info
    from taskpilots_graph.tools import Invocation, current_invocation, side_effect

    __version__: str

# Where each public name lives (submodule of this package: names); ``__version__`` comes
# from the installed distribution. Everything else is imported from its submodule.
_SOURCES: dict[str, tuple[str, ...]] = {
    "agent": ("create_recovery_agent",),
    "checkpointers": ("AsyncRecoveryCheckpointer", "RecoveryCheckpointer"),
    "decisions": ("adecide", "apending_takeovers", "decide", "pending_takeovers"),
    "errors": ("ConfigurationError", "PendingTakeover", "TaskPilotsError", "ThreadBusy"),
    "events": ("Event", "EventKind"),
    "failures": ("FailureKind",),
    "ledger": ("Done", "LedgerEntry", "LedgerStatus", "NotDone", "SideEffectUncertain", "Unknown"),
    "metrics": ("RecoveryMetrics", "arecovery_metrics", "recovery_metrics"),
    "middleware": ("RecoveryMiddleware",),
    "middleware.toolnode": ("ToolNode",),
    "policy": ("Backoff", "ModelPolicy", "ToolPolicy"),
    "runner": ("aresume", "arewind", "arun", "resume", "rewind", "run"),
    "takeover": ("Decision", "TakeoverRequest"),
    "thread_listing": ("alist_threads", "list_threads"),
    "threads": ("athread_info", "thread_info"),
    "tools": ("Invocation", "current_invocation", "side_effect"),
}
_EXPORTS: dict[str, str] = {
    name: f"taskpilots_graph.{module}" for module, names in _SOURCES.items() for name in names
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(import_module(module), name)
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


# The run objects IPython shows as HTML tables, drawn by ``taskpilots_graph.notebook``. The
# domain modules never import that package (see ``taskpilots_graph.reprs``); this, the
# package's entry, tells IPython where to find each view, by type name, so a notebook shows
# the tables after ``import taskpilots_graph`` alone and nothing is imported before one is.
_HTML_VIEWS: tuple[str, ...] = (
    "taskpilots_graph.metrics.RecoveryMetrics",
    "taskpilots_graph.replay.Replay",
    "taskpilots_graph.takeover.TakeoverRequest",
    "taskpilots_graph.threads.ThreadInfo",
)


def _html_view(obj: object) -> str | None:
    import_module("taskpilots_graph.notebook")  # registers the views on first import
    return import_module("taskpilots_graph.reprs").html_view(obj)  # type: ignore[no-any-return]


def _show_views_in_ipython() -> None:
    ipython = sys.modules.get("IPython")  # never imported here: only a running shell counts
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return
    html = shell.display_formatter.formatters["text/html"]
    for qualified in _HTML_VIEWS:
        module, _, name = qualified.rpartition(".")
        html.for_type_by_name(module, name, _html_view)


_show_views_in_ipython()


__all__ = [
    "AsyncRecoveryCheckpointer",
    "Backoff",
    "ConfigurationError",
    "Decision",
    "Done",
    "Event",
    "EventKind",
    "FailureKind",
    "Invocation",
    "LedgerEntry",
    "LedgerStatus",
    "ModelPolicy",
    "NotDone",
    "PendingTakeover",
    "RecoveryCheckpointer",
    "RecoveryMetrics",
    "RecoveryMiddleware",
    "SideEffectUncertain",
    "TakeoverRequest",
    "TaskPilotsError",
    "ThreadBusy",
    "ToolNode",
    "ToolPolicy",
    "Unknown",
    "__version__",
    "adecide",
    "alist_threads",
    "apending_takeovers",
    "arecovery_metrics",
    "aresume",
    "arewind",
    "arun",
    "athread_info",
    "create_recovery_agent",
    "current_invocation",
    "decide",
    "list_threads",
    "pending_takeovers",
    "recovery_metrics",
    "resume",
    "rewind",
    "run",
    "side_effect",
    "thread_info",
]
