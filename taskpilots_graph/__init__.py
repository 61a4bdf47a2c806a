"""taskpilots-graph: LangGraph agents that continue from the right place after a failure.

The public API is re-exported here; everything else is an implementation detail.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from taskpilots_graph.checkpointers import AsyncRecoveryCheckpointer, RecoveryCheckpointer
from taskpilots_graph.errors import (
    ConfigurationError,
    CorruptRecordError,
    MigrationError,
    StorageError,
    TaskPilotsError,
    ThreadNotFound,
    UnsupportedOperation,
)
from taskpilots_graph.events import Event, EventKind

try:
    __version__ = version("taskpilots-graph")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AsyncRecoveryCheckpointer",
    "ConfigurationError",
    "CorruptRecordError",
    "Event",
    "EventKind",
    "MigrationError",
    "RecoveryCheckpointer",
    "StorageError",
    "TaskPilotsError",
    "ThreadNotFound",
    "UnsupportedOperation",
    "__version__",
]
