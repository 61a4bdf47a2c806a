"""The one exception tree of taskpilots-graph.

Every error the library raises on purpose derives from :class:`TaskPilotsError`, so callers
can catch the whole family at once and still tell the cases apart by type::

    TaskPilotsError
    ├── ArtifactNotFound            no artifact is stored under the id (also LookupError)
    ├── ConfigurationError          a policy, connection string or setup mistake
    │   ├── InvalidDecision         a takeover decision that does not validate
    │   └── PrecheckError           a pre-check returned something else than Done/NotDone/Unknown
    ├── LeaseLost                   our lease expired or was taken: stop before the next effect
    ├── MutualWait                  sub-agents wait for each other's locks (reported STUCK)
    ├── StorageError                the recovery store cannot do what was asked
    │   ├── CorruptRecordError      a stored row cannot be decoded (never "not found")
    │   ├── EffectInProgress        another live runner is performing the same effect
    │   ├── LedgerConflict          another run moved the same ledger entry first
    │   ├── LockBackendUnavailable  the lease/lock store is unreachable: fail closed
    │   ├── MigrationError          the schema is newer than this library, or half-applied
    │   ├── StorageBusy             another writer holds the database past the wait
    │   ├── StorageReadOnly         the database can be read, not written
    │   ├── StorageUnavailable      the database cannot be reached, or the connection was lost
    │   └── UnsupportedOperation    the wrapped saver lacks the operation (also NotImplementedError)
    ├── PendingTakeover             the thread waits on a person's decision
    ├── ResultDrifted               a high-risk call answered differently than before
    ├── NoPendingTakeover           a decision for a thread that waits on nobody
    │   └── StaleDecision           a decision for a takeover that is no longer pending
    ├── ThreadBusy                  another process holds the lease (thread or business lock)
    ├── ThreadNotFound              no checkpoint exists for the thread id
    └── ToolWaiting                 the run stopped to wait for a tool until ``retry_at``

    SideEffectUncertain (in ledger.py) also derives from TaskPilotsError, and so does its
    subclass CompensationUncertain (in ledger.py): the undo of an effect of unknown outcome.

Errors carry their facts as attributes (not only in the message) and pickle cleanly, so they
survive crossing a process boundary (workers, subprocess drills). LangGraph control flow
(``GraphBubbleUp`` and interrupts) is never wrapped into one of these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

__all__ = [
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


class InvalidDecision(ConfigurationError):
    """A takeover decision is malformed; nothing was recorded or changed."""


class PrecheckError(ConfigurationError):
    """A tool's pre-check answered with something else than ``Done``, ``NotDone`` or
    ``Unknown`` (``None``, a string, ...).

    The pre-check is broken, so nothing can tell whether the effect happened: the ledger
    fails closed (the entry is marked ``uncertain`` and a person decides; the tool is never
    executed on such an answer), and this error names the tool and what was returned.
    """

    def __init__(self, tool: str, returned: Any) -> None:
        try:
            shown = repr(returned)
        except Exception:  # a broken __repr__ must not hide the broken pre-check
            shown = f"<{type(returned).__name__} object>"
        if len(shown) > 200:
            shown = shown[:200] + "…"
        super().__init__(
            f"the pre-check of {tool!r} returned {shown} ({type(returned).__name__}); "
            "it must return tp.Done(...), tp.NotDone() or tp.Unknown(...)"
        )
        self.tool = tool
        self.returned = shown


class StorageError(TaskPilotsError):
    """The recovery store could not complete an operation."""


class _BackendError(StorageError):
    """A storage failure of one backend during one operation (see the subclasses)."""

    def __init__(self, message: str, *, backend: str, operation: str) -> None:
        super().__init__(f"{backend} {operation}: {message}")
        self.backend = backend
        self.operation = operation


class StorageUnavailable(_BackendError):
    """The database cannot be reached, or the connection was lost (server down, restarted,
    network). A write whose COMMIT may have reached the server is never reported as this
    after the fact: it is ambiguous and is reconciled on the next read."""


class StorageBusy(_BackendError):
    """The database is held by another writer past the wait (SQLite's busy timeout, a
    PostgreSQL lock timeout); retrying later may succeed."""


class StorageReadOnly(_BackendError):
    """The database can be read but not written (a read-only file or a standby server)."""


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

    def __init__(self, key: str, *, performed: bool = False) -> None:
        # Truthful either way: the conflict can hit the write *after* our own call ran
        # (its commit), and then the effect did happen once, by this run.
        outcome = (
            "this run had already performed the effect, its result was not recorded; "
            "a person or the pre-check must settle it"
            if performed
            else "this run did not perform the effect"
        )
        super().__init__(
            f"ledger entry {key!r} was changed by another run at the same time; {outcome}"
        )
        self.key = key
        self.performed = performed


class EffectInProgress(StorageError):
    """A side effect's ledger intent belongs to a runner that is still alive, past our wait.

    The entry is ``intended`` and its thread's lease is held by another runner: the effect is
    being performed right now, elsewhere. Running the pre-check or the tool against it could
    perform it twice, so the caller waits for its outcome; this is raised when that wait runs
    out (nothing was run). Try again later: the entry will be committed, or reconciled once
    its owner is gone.
    """

    def __init__(self, key: str, *, tool: str, owner_thread: str, holder: str | None) -> None:
        who = f" (lease held by {holder!r})" if holder is not None else ""
        super().__init__(
            f"side effect {tool!r} under key {key!r} is being performed by thread "
            f"{owner_thread!r}{who}; its outcome did not arrive in time and nothing was run "
            "here; try again later"
        )
        self.key = key
        self.tool = tool
        self.owner_thread = owner_thread
        self.holder = holder


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

    Resuming it with ``invoke(None)`` could replay a stale answer (LangGraph #8837), and new
    input would silently drop the question: answer it (``tp.decide``) instead.
    """

    def __init__(self, thread_id: str, interrupt_ids: list[str]) -> None:
        super().__init__(
            f"thread {thread_id!r} waits on a person's decision (pending takeover "
            f"{', '.join(interrupt_ids) or '?'}); nothing was run. Answer it first with "
            f"tp.decide(graph, {thread_id!r}, tp.Decision(...)) or `taskpilots decide`"
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


class NoPendingTakeover(TaskPilotsError):
    """A decision was given for a thread that is not waiting on a person (or not any more:
    each decision is consumed once)."""

    def __init__(self, thread_id: str) -> None:
        super().__init__(f"thread {thread_id!r} is not waiting on a person; nothing to decide")
        self.thread_id = thread_id


class StaleDecision(NoPendingTakeover):
    """A decision names a takeover that is no longer pending; nothing was recorded or changed.

    The takeover was answered already (a form sent twice, a second browser tab, a command
    run again) and the thread may now wait on a newer takeover about another step: applying
    the old answer there would decide something the person never saw. A subclass of
    :class:`NoPendingTakeover`, so code that treats "already decided" alike keeps working.

    Attributes:
        thread_id: The thread.
        interrupt_id: The takeover the decision answers (its interrupt id).
        current: The interrupt ids of the takeovers pending now (empty: none).
    """

    def __init__(self, thread_id: str, interrupt_id: str, current: Sequence[str] = ()) -> None:
        now = (
            f"it now waits on takeover {', '.join(current)}: look at that one before deciding"
            if current
            else "it waits on nobody now"
        )
        TaskPilotsError.__init__(
            self,
            f"the decision answers takeover {interrupt_id!r} of thread {thread_id!r}, which "
            f"is no longer pending (answered already); {now}. Nothing was changed",
        )
        self.thread_id = thread_id
        self.interrupt_id = interrupt_id
        self.current = list(current)


class ArtifactNotFound(TaskPilotsError, LookupError):
    """No artifact is stored under the given id.

    A stored artifact whose bytes no longer match its id raises :class:`CorruptRecordError`
    instead: "missing" and "damaged" call for different repairs.
    """

    def __init__(self, artifact_id: str) -> None:
        super().__init__(f"no artifact is stored under id {artifact_id!r}")
        self.artifact_id = artifact_id


class ThreadBusy(TaskPilotsError):
    """Another process holds the lease on this name (a thread, or a business object).

    Raised instead of running anyway: two runners on one thread would silently lose each
    other's writes (LangGraph #8796), and two agents on one business object would both
    perform its side effect. ``holder`` is the owner token of the current holder (host, pid
    and a random part), or ``None`` if it let go between our attempt and the lookup.
    """

    def __init__(self, name: str, holder: str | None, *, expires_at: float | None = None) -> None:
        who = f"held by {holder!r}" if holder is not None else "held by another owner"
        until = ""
        if expires_at is not None:
            when = datetime.fromtimestamp(expires_at, UTC).isoformat(timespec="milliseconds")
            until = f" until {when} unless renewed"
        super().__init__(f"{name!r} is {who}{until}; nothing was run a second time")
        self.name = name
        self.holder = holder
        self.expires_at = expires_at


class LeaseLost(TaskPilotsError):
    """A lease we held expired or was taken over: we no longer own its name.

    Raised by ``renew`` and by a holder's ``check()``. Work done after this point could
    overlap with a new holder's, so stop before the next side effect (the new holder's
    higher fencing token is what protects the resources themselves).
    """

    def __init__(self, name: str, reason: str, *, fencing: int | None = None) -> None:
        token = "" if fencing is None else f" (fencing token {fencing})"
        super().__init__(f"lease {name!r}{token} was lost: {reason}; stop before the next effect")
        self.name = name
        self.reason = reason
        self.fencing = fencing


class LockBackendUnavailable(StorageError):
    """The lease and lock store (Redis, PostgreSQL, a SQLite file) cannot be reached.

    Side effects fail closed on it: the caller waits or escalates, it never runs the effect
    without the lock.
    """

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(
            f"the {backend} lock backend is unreachable ({reason}); "
            "nothing was run without the lock"
        )
        self.backend = backend
        self.reason = reason


class ResultDrifted(TaskPilotsError):
    """A high-risk tool answered the same call differently than before; a person confirms.

    Classified ``data_uncertain`` (the recovery router hands it to a person). Its step
    record keeps the new result for ``accept``.

    Attributes:
        tool: The tool.
        tool_call_id: The call.
        drift: What :func:`detect_drift` found.
        result: The new result (as the ledger would record it).
    """

    failure_kind = "data_uncertain"
    maybe_sent = False

    def __init__(
        self, *, tool: str, tool_call_id: str | None, drift: Mapping[str, Any], result: Any
    ) -> None:
        lines: Sequence[str] = drift.get("difference") or []
        super().__init__(
            f"{tool} returned a different result than when this call ran before "
            f"({'; '.join(lines[:3]) or 'the values differ'}); a person must confirm it"
        )
        self.tool = tool
        self.tool_call_id = tool_call_id
        self.drift = dict(drift)
        self.result = result


class MutualWait(TaskPilotsError):
    """The coordinator found this thread in a mutual wait and stopped its lock wait.

    Its failure kind is ``stuck``: the sub-agent's recovery router escalates to a person
    instead of retrying.
    """

    failure_kind = "stuck"

    def __init__(self, thread_id: str, lock: str) -> None:
        super().__init__(
            f"thread {thread_id!r} waits for {lock!r} in a mutual wait (a wait-for cycle); "
            "the coordinator reported it STUCK"
        )
        self.thread_id = thread_id
        self.lock = lock
