"""The one exception tree of taskpilots-graph.

Every error the library raises on purpose derives from :class:`TaskPilotsError`, so callers
can catch the whole family at once and still tell the cases apart by type::

    TaskPilotsError
    ├── ConfigurationError          a policy, connection string or setup mistake
    ├── StorageError                the recovery store cannot do what was asked
    │   ├── CorruptRecordError      a stored row cannot be decoded (never "not found")
    │   ├── LedgerConflict          another run moved the same ledger entry first
    │   ├── MigrationError          the schema is newer than this library, or half-applied
    │   └── UnsupportedOperation    the wrapped saver lacks the operation (also NotImplementedError)
    ├── PendingTakeover             the thread waits on a person's decision
    ├── ThreadNotFound              no checkpoint exists for the thread id
    └── ToolWaiting                 the run stopped to wait for a tool until ``retry_at``

    SideEffectUncertain (in ledger.py) also derives from TaskPilotsError.

Errors carry their facts as attributes (not only in the message) and pickle cleanly, so they
survive crossing a process boundary (workers, subprocess drills). LangGraph control flow
(``GraphBubbleUp`` and interrupts) is never wrapped into one of these.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

__all__ = [
    "ConfigurationError",
    "CorruptRecordError",
    "LedgerConflict",
    "MigrationError",
    "PendingTakeover",
    "StorageError",
    "TaskPilotsError",
    "ThreadNotFound",
    "ToolWaiting",
    "UnsupportedOperation",
]


class TaskPilotsError(Exception):
    """Base class of every error raised by taskpilots-graph."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only constructors do not round-trip through the default pickling of
        # ``Exception`` (which replays ``args`` positionally); rebuild from ``__dict__``.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[TaskPilotsError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class ConfigurationError(TaskPilotsError, ValueError):
    """A setting, policy or connection string is invalid; the message says how to fix it."""


class StorageError(TaskPilotsError):
    """The recovery store could not complete an operation."""


class CorruptRecordError(StorageError):
    """A stored record exists but cannot be decoded.

    Raised instead of returning "nothing found": silently treating corrupt data as absent
    would make a run start over and repeat its side effects.
    """

    def __init__(self, message: str, *, table: str, key: str) -> None:
        super().__init__(f"{message} (table={table!r}, key={key!r})")
        self.table = table
        self.key = key


class LedgerConflict(StorageError):
    """A ledger entry was changed by another run between our read and our write.

    Two runs are executing the same side effect at once; the loser stops instead of
    performing it a second time.
    """

    def __init__(self, key: str) -> None:
        super().__init__(
            f"ledger entry {key!r} was changed by another run at the same time; "
            "the effect was not executed again"
        )
        self.key = key


class MigrationError(StorageError):
    """The database schema cannot be brought to the version this library needs."""


class UnsupportedOperation(StorageError, NotImplementedError):
    """The wrapped LangGraph saver does not implement the requested operation."""

    def __init__(self, operation: str, backend: str) -> None:
        super().__init__(
            f"{operation}() is not supported by the {backend} backend "
            f"(LangGraph's {backend} does not implement it)"
        )
        self.operation = operation
        self.backend = backend


class ThreadNotFound(TaskPilotsError, LookupError):
    """No checkpoint exists for the given thread id."""

    def __init__(self, thread_id: str) -> None:
        super().__init__(f"no checkpoint exists for thread_id={thread_id!r}")
        self.thread_id = thread_id


class PendingTakeover(TaskPilotsError):
    """The thread is paused on an interrupt that a person must answer.

    Resuming it with ``invoke(None)`` could replay a stale answer (LangGraph #8837); answer
    the interrupt instead.
    """

    def __init__(self, thread_id: str, interrupt_ids: list[str]) -> None:
        super().__init__(
            f"thread {thread_id!r} waits on a person ({len(interrupt_ids)} pending "
            "interrupt(s)); answer it with Command(resume=...) instead of resuming it"
        )
        self.thread_id = thread_id
        self.interrupt_ids = interrupt_ids


class ToolWaiting(TaskPilotsError):
    """The run stopped to wait out a tool failure longer than an in-process sleep.

    The thread's state says ``waiting_tool`` with ``retry_at``; ``resume`` after that time
    continues with the waiting step (the supervisor does this on its own).
    """

    def __init__(self, thread_id: str, retry_at: float) -> None:
        when = datetime.fromtimestamp(retry_at, UTC).isoformat(timespec="seconds")
        super().__init__(f"thread {thread_id!r} waits for a tool until {when}; resume it then")
        self.thread_id = thread_id
        self.retry_at = retry_at
