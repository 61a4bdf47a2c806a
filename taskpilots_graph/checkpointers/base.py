"""Pieces shared by the sync and async recovery checkpointers (I/O free): the recovery store
protocols (a store also keeps artifacts, :mod:`.artifacts`, and compacts its event log in
place), connection-string parsing, SQLite error mapping and event-row decoding.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

from langgraph.checkpoint.base import BaseCheckpointSaver

from taskpilots_graph.checkpointers.artifacts import PreparedArtifact
from taskpilots_graph.checkpointers.messages import LoadedRow, MessageRows
from taskpilots_graph.compaction import CompactionPolicy
from taskpilots_graph.errors import (
    ConfigurationError,
    CorruptRecordError,
    StorageBusy,
    StorageError,
    StorageReadOnly,
    StorageUnavailable,
    UnsupportedOperation,
)
from taskpilots_graph.events import Event, EventRecord, event_from_row
from taskpilots_graph.ledger import CommittedEffect, LedgerEntry, LedgerStatus

__all__ = [
    "DEFAULT_POOL_SIZE",
    "SQLITE_BUSY_TIMEOUT_S",
    "AsyncMessageStore",
    "AsyncRecoveryStore",
    "ConnTarget",
    "DecisionRecord",
    "HeldCommit",
    "MessageStore",
    "PendingRecord",
    "RecoveryStore",
    "enable_wal",
    "parse_conn_string",
    "require_override",
    "rows_to_events",
    "skipping_corrupt_events",
    "sqlite_error",
    "sqlite_path",
]

Backend = Literal["memory", "sqlite", "postgres"]

SQLITE_BUSY_TIMEOUT_S = 30.0
"""How long a SQLite writer waits for another process's write before failing."""

DEFAULT_POOL_SIZE = 8
"""Connections in the PostgreSQL pool that the saver and the recovery store share."""


def enable_wal(execute: Callable[[str], Any]) -> None:
    """Switch a SQLite file to WAL once, retrying while another process holds it.

    LangGraph's SqliteSaver switches the journal mode inside its lazy ``setup()``; on a fresh
    file opened by two processes at once that switch fails with SQLITE_BUSY at once (the busy
    timeout does not cover it). Done here first, with retries, the saver's own switch is a
    no-op.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    while True:
        try:
            execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = getattr(exc, "sqlite_errorcode", None) in (
                sqlite3.SQLITE_BUSY,
                sqlite3.SQLITE_LOCKED,
            )
            if not busy or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def sqlite_error(exc: sqlite3.Error, operation: str) -> StorageError | None:
    """The typed error for a sqlite3 error, read from its result code (never its text).

    ``None`` for codes that are not storage conditions (a constraint, a programming error):
    those keep their own type.
    """
    code = getattr(exc, "sqlite_errorcode", None)
    if not isinstance(code, int):
        return None
    primary = code & 0xFF  # extended codes (SQLITE_BUSY_SNAPSHOT, ...) keep the primary
    reason = f"{exc} ({getattr(exc, 'sqlite_errorname', code)})"
    where = {"backend": "sqlite", "operation": operation}
    if primary in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return StorageBusy(
            f"{reason}: another connection held the file past the busy timeout; nothing "
            "of this operation was written, retry later",
            **where,
        )
    if primary == sqlite3.SQLITE_READONLY:
        return StorageReadOnly(f"{reason}: the file is open read-only (inspection only)", **where)
    if primary in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return StorageUnavailable(
            f"{reason}: the file is not a SQLite database, or it is damaged", **where
        )
    if primary in (
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_PERM,
        sqlite3.SQLITE_AUTH,
    ):
        return StorageUnavailable(reason, **where)
    return None


def sqlite_path(address: str) -> str:
    """Create the parent folder of a SQLite file, so ``.taskpilots/runs.db`` just works."""
    if address != ":memory:" and not address.startswith("file:"):
        Path(address).parent.mkdir(parents=True, exist_ok=True)
    return address


@dataclass(frozen=True, slots=True)
class ConnTarget:
    """Where a connection string points: the backend and its native address."""

    backend: Backend
    address: str


def parse_conn_string(conn_string: str) -> ConnTarget:
    """Resolve a connection string to a backend.

    Accepted forms: ``":memory:"`` (LangGraph's in-memory saver), ``"sqlite:///path.db"``,
    ``"sqlite:///:memory:"``, a plain file path with no ``:`` before its first ``/``, and
    ``"postgresql://..."`` / ``"postgres://..."``.

    Raises:
        ConfigurationError: For an empty string, an unknown URL scheme, a scheme typo
            (``postgresql:/db``, ``sqlite:/runs.db``) or a malformed PostgreSQL URL; nothing
            is opened or created.
    """
    if not isinstance(conn_string, str) or not conn_string.strip():
        raise ConfigurationError(
            "connection string is empty; use ':memory:', 'sqlite:///path/runs.db' "
            "or 'postgresql://user@host/db'"
        )
    if conn_string == ":memory:":
        return ConnTarget("memory", conn_string)
    if conn_string.startswith(("postgresql://", "postgres://")):
        try:
            urlsplit(conn_string)  # brackets, IPv6 literals: what every URL reader needs
        except ValueError as exc:
            raise ConfigurationError(
                f"malformed PostgreSQL URL ({exc}); use 'postgresql://user@host:port/db'"
            ) from exc
        return ConnTarget("postgres", conn_string)
    if conn_string.startswith("sqlite://"):
        path = conn_string.removeprefix("sqlite://")
        # sqlite:///rel.db -> "rel.db", sqlite:////abs.db -> "/abs.db" (SQLAlchemy's rule).
        path = path.removeprefix("/")
        if not path:
            raise ConfigurationError(
                f"{conn_string!r} names no file; use 'sqlite:///runs.db' or 'sqlite:///:memory:'"
            )
        return ConnTarget("sqlite", path)
    scheme, sep, _ = conn_string.partition("://")
    if sep:
        raise ConfigurationError(
            f"unsupported connection string scheme {scheme!r}; use ':memory:', "
            "'sqlite:///path' or 'postgresql://...'"
        )
    if ":" in conn_string.partition("/")[0]:
        # 'postgresql:/db', 'sqlite:/runs.db': a scheme typo must never become a local file
        # (workers sharing the typo would each keep a private ledger).
        raise ConfigurationError(
            f"{conn_string!r} looks like a URL with a malformed scheme (a scheme is followed "
            "by '://'); use 'sqlite:///path/runs.db' or 'postgresql://user@host/db', or "
            f"'./{conn_string}' for a file whose name contains ':'"
        )
    return ConnTarget("sqlite", conn_string)


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """A model decision to record, written like events (``append_events``, ``ledger_write``).

    The act node needs a decision on disk before the first side effect it leads to, not
    before: deferred into the ledger intent's transaction, it costs no commit of its own.
    """

    thread_id: str
    checkpoint_ns: str
    input_digest: str
    message: str
    created_at: float

    def params(self) -> dict[str, Any]:
        """Parameters of the decision insert (``LEDGER["decision_put"]``)."""
        return asdict(self)


PendingRecord = EventRecord | DecisionRecord
"""What a store writes in one transaction beside a ledger entry: events and decisions."""


@dataclass(frozen=True, slots=True)
class HeldCommit:
    """A ledger commit held for the put_writes of the task that performed it.

    Only commits of tools that settle a lost commit themselves ride (an idempotent service
    or a pre-check): written in the same transaction as the task's writes, a crash loses
    both or neither, and a lost one is settled on resume like any unrecorded attempt.
    """

    entry: LedgerEntry
    expect: tuple[LedgerStatus, int] | None
    events: tuple[PendingRecord, ...]
    task_id: str
    parked: bool = False
    """Its put_writes failed: only the put of the next checkpoint of the run that failed
    writes it (before that checkpoint); the thread's next run drops it and settles the call
    as an unrecorded attempt, as it would after a commit that failed on its own."""


_SKIPPED: ContextVar[list[CorruptRecordError] | None] = ContextVar(
    "taskpilots_skipped_event_rows", default=None
)


@contextmanager
def skipping_corrupt_events() -> Iterator[list[CorruptRecordError]]:
    """Within the block, an event row that cannot be decoded is skipped and its error
    collected in the yielded list, instead of failing the whole read.

    For listings and metrics only, which must not fail a whole store for one bad row; a
    run, a resume or a replay always reads with corrupt rows refused (a skipped event could
    make a run repeat an effect). Works for stores called in this context (the sync
    checkpointer, and the async one awaited from this task).
    """
    skipped: list[CorruptRecordError] = []
    token = _SKIPPED.set(skipped)
    try:
        yield skipped
    finally:
        _SKIPPED.reset(token)


_EVENT_COLUMNS = ("thread_id", "seq", "kind", "ts", "checkpoint_ns", "checkpoint_id", "payload")


def rows_to_events(rows: Iterable[Sequence[Any]]) -> list[Event]:
    """Decode rows selected in the column order of ``SELECT_EVENTS``.

    Raises:
        CorruptRecordError: For a row that cannot be decoded (skipped and collected instead
            inside :func:`skipping_corrupt_events`).
    """
    skipped = _SKIPPED.get()
    events = []
    for row in rows:
        try:
            event = event_from_row(**dict(zip(_EVENT_COLUMNS, row, strict=False)))
        except CorruptRecordError as exc:
            if skipped is None:
                raise
            skipped.append(exc)
            continue
        events.append(event)
    return events


class RecoveryStore(Protocol):
    """Synchronous storage of the recovery data that lives beside the checkpoints."""

    def setup(self, inner_setup: Callable[[], None] | None = None) -> None:
        """Run the saver's ``inner_setup``, then create or migrate the store's tables;
        idempotent, and safe when several processes call it at once."""

    def append_events(self, records: Sequence[PendingRecord]) -> list[Event]:
        """Append events and record decisions (the first record for an input wins) in one
        transaction; durable on return."""

    def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        """The thread's events with ``seq > after_seq``, in order."""

    def delete_thread(self, thread_id: str) -> None:
        """Remove everything stored for the thread."""

    def ledger_get(self, key: str) -> LedgerEntry | None:
        """The entry recorded under ``key``, if any."""

    def ledger_write(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[PendingRecord] = (),
    ) -> list[Event]:
        """Insert (``expect=None``) or compare-and-set update an entry, with its events.

        Entry, events and decisions commit in one transaction, durable on return.

        Raises:
            LedgerConflict: If the key exists (insert) or its (status, attempt) moved on.
        """

    def ledger(self, thread_id: str | None = None) -> list[LedgerEntry]:
        """Entries of one thread, or of all threads, oldest first."""

    def ledger_repeat(self, thread_id: str, tool: str, args_digest: str) -> CommittedEffect | None:
        """The thread's earliest committed entry of ``tool`` with these canonical arguments,
        and its position among the thread's entries (oldest first, from 1); one indexed
        read."""

    def ledger_committed_digests(self, thread_id: str) -> list[tuple[str, str]]:
        """The (tool, arguments digest) pairs of the thread's committed entries."""

    def decision_get(self, thread_id: str, checkpoint_ns: str, input_digest: str) -> str | None:
        """A model decision recorded for exactly this input, if any."""

    def decision_digests(self, thread_id: str, checkpoint_ns: str) -> list[str]:
        """The input digests of every decision recorded for the thread and namespace."""

    def decision_forget(self, thread_id: str, since: float) -> int:
        """Delete the thread's decisions recorded after ``since`` (epoch seconds)."""

    def put_artifact(self, artifact: PreparedArtifact) -> None:
        """Store an artifact for its thread (a no-op if the thread has it); durable on return."""

    def get_artifact(self, artifact_id: str) -> bytes | None:
        """The payload stored under ``artifact_id`` by any thread, or ``None``."""

    def delete_artifacts(self, thread_id: str) -> None:
        """Remove the thread's artifacts (``delete_thread`` does this too)."""

    def compact_events(self, thread_id: str, policy: CompactionPolicy) -> int:
        """Rewrite the payloads ``policy`` reduces, in one transaction; seq and kind stay.

        Returns:
            The number of events rewritten.

        Raises:
            CorruptRecordError: If a stored event cannot be decoded (nothing is rewritten).
        """


class AsyncRecoveryStore(Protocol):
    """Asynchronous twin of :class:`RecoveryStore`."""

    async def setup(self, inner_setup: Callable[[], Awaitable[None]] | None = None) -> None:
        """Async twin of :meth:`RecoveryStore.setup`."""

    async def append_events(self, records: Sequence[PendingRecord]) -> list[Event]:
        """Append events (and write decisions) in one transaction; durable on return."""

    async def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        """The thread's events with ``seq > after_seq``, in order."""

    async def delete_thread(self, thread_id: str) -> None:
        """Remove everything stored for the thread."""

    async def ledger_get(self, key: str) -> LedgerEntry | None:
        """The entry recorded under ``key``, if any."""

    async def ledger_write(
        self,
        entry: LedgerEntry,
        *,
        expect: tuple[LedgerStatus, int] | None,
        events: Sequence[PendingRecord] = (),
    ) -> list[Event]:
        """Async twin of :meth:`RecoveryStore.ledger_write`."""

    async def ledger(self, thread_id: str | None = None) -> list[LedgerEntry]:
        """Entries of one thread, or of all threads, oldest first."""

    async def ledger_repeat(
        self, thread_id: str, tool: str, args_digest: str
    ) -> CommittedEffect | None:
        """Async twin of :meth:`RecoveryStore.ledger_repeat`."""

    async def ledger_committed_digests(self, thread_id: str) -> list[tuple[str, str]]:
        """Async twin of :meth:`RecoveryStore.ledger_committed_digests`."""

    async def decision_get(
        self, thread_id: str, checkpoint_ns: str, input_digest: str
    ) -> str | None:
        """A model decision recorded for exactly this input, if any."""

    async def decision_digests(self, thread_id: str, checkpoint_ns: str) -> list[str]:
        """The input digests of every decision recorded for the thread and namespace."""

    async def decision_forget(self, thread_id: str, since: float) -> int:
        """Delete the thread's decisions recorded after ``since`` (epoch seconds)."""

    async def put_artifact(self, artifact: PreparedArtifact) -> None:
        """Async twin of :meth:`RecoveryStore.put_artifact`."""

    async def get_artifact(self, artifact_id: str) -> bytes | None:
        """Async twin of :meth:`RecoveryStore.get_artifact`."""

    async def delete_artifacts(self, thread_id: str) -> None:
        """Async twin of :meth:`RecoveryStore.delete_artifacts`."""

    async def compact_events(self, thread_id: str, policy: CompactionPolicy) -> int:
        """Async twin of :meth:`RecoveryStore.compact_events`."""


class MessageStore(Protocol):
    """A recovery store that also keeps a thread's messages once (:mod:`.messages`).

    Every built-in store is one. A store without these methods still works: the
    checkpointer then leaves message lists inside the checkpoints, as LangGraph does.
    """

    def messages_write(self, rows: MessageRows) -> None:
        """Insert new sequences, references and (if the thread lacks their key) messages,
        atomically; durable on return. Inside a ride (:func:`.messages.riding`, opened
        only for a saver declaring ``rides_messages``) a built-in store hands the rows to
        the saver's ``put`` instead, which commits them with the checkpoint."""

    def messages_read(self, thread_id: str, seq: int, length: int) -> list[LoadedRow]:
        """The rows of positions ``0..length-1`` of sequence ``seq`` (following its
        parents), ordered by position; missing rows are left out, not invented."""


class AsyncMessageStore(Protocol):
    """Async twin of :class:`MessageStore`."""

    async def messages_write(self, rows: MessageRows) -> None:
        """Async twin of :meth:`MessageStore.messages_write`."""

    async def messages_read(self, thread_id: str, seq: int, length: int) -> list[LoadedRow]:
        """Async twin of :meth:`MessageStore.messages_read`."""


def require_override(saver: BaseCheckpointSaver[Any], method: str) -> None:
    """Raise :class:`UnsupportedOperation` if ``saver`` inherits ``method`` from the base.

    LangGraph's base class raises a bare ``NotImplementedError`` for optional operations;
    naming the backend tells the user which storage to switch to.
    """
    if getattr(type(saver), method) is getattr(BaseCheckpointSaver, method):
        raise UnsupportedOperation(method, type(saver).__name__)
