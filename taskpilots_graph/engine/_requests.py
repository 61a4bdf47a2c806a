"""What the ledger protocol asks for, and what it is answered.

:func:`~._protocol.run_call` is a generator of these requests; the drivers of :mod:`._drive`
carry them out and send the answers back, and the generator returns a
:class:`CallOutcome`.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard, TypeVar

from taskpilots_graph.engine._call import CallContext
from taskpilots_graph.events import Event, EventKind, EventRecord
from taskpilots_graph.failures import Failure
from taskpilots_graph.ledger import PAUSED, LedgerEntry, LedgerStatus
from taskpilots_graph.tools import Invocation

__all__ = [
    "Asks",
    "AwaitOwner",
    "Awaited",
    "CallOutcome",
    "CheckArgs",
    "FindPrevious",
    "FindRepeat",
    "Protocol",
    "ReadEntry",
    "Request",
    "RunPrecheck",
    "RunTool",
    "WriteEntry",
    "WriteEvent",
    "in_flight",
    "latest_successes",
]


@dataclass(frozen=True, slots=True)
class CallOutcome:
    """How a call ended: a result (fresh or recorded), or the tool's exception classified."""

    result: Any = None
    error: BaseException | None = None
    failure: Failure | None = None
    replayed: bool = False
    repeat_of: str | None = None  # the key of the committed effect a caught repeat returned
    refused: bool = False  # the business lock could not be taken: nothing was written or run


@dataclass(frozen=True, slots=True)
class CheckArgs:
    """Validate the arguments against the tool's schema (``tools.check_args``).

    Answered with ``None``, or with the schema's error thrown in: the body never ran, so
    the call fails as "not sent" without a ledger entry.
    """

    args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FindRepeat:
    """The thread's earliest committed effect of ``tool`` with these canonical arguments.

    Answered with a :class:`~taskpilots_graph.ledger.CommittedEffect` or ``None``
    (``RecoveryAPI.committed_effect``).
    """

    thread_id: str
    tool: str
    args_digest: str


@dataclass(frozen=True, slots=True)
class ReadEntry:
    """The ledger entry under ``key``, or ``None``.

    ``thread_id`` names the thread whose runs alone write ``key`` (a default key): under
    that thread's lease, its keys are then known without a read per call.
    """

    key: str
    thread_id: str | None = None


@dataclass(frozen=True, slots=True)
class FindPrevious:
    """The ``tool_succeeded`` payload of the call's latest earlier execution, or ``None``
    (asked before a call that may have run before, to compare its result: drift)."""

    thread_id: str
    key: str
    tool_call_id: str | None


def latest_successes(events: Iterable[Event]) -> dict[tuple[Any, Any], Mapping[str, Any]]:
    """The latest ``tool_succeeded`` payload of each (key, tool-call id) in ``events``."""
    latest: dict[tuple[Any, Any], Mapping[str, Any]] = {}
    for event in events:
        if event.kind is EventKind.TOOL_SUCCEEDED and not event.superseded:
            latest[(event.payload.get("key"), event.payload.get("tool_call_id"))] = event.payload
    return latest


@dataclass(frozen=True, slots=True)
class WriteEntry:
    """Write the entry and its event durably, together with any events buffered so far."""

    entry: LedgerEntry
    expect: tuple[LedgerStatus, int] | None
    event: EventRecord
    may_ride: bool = False
    """A commit whose loss the tool settles itself (idempotent, or with a pre-check): it
    may be written in the transaction of its task's ``put_writes`` instead of its own."""


@dataclass(frozen=True, slots=True)
class WriteEvent:
    """Record an event that needs no durability of its own (flushed with the next write)."""

    event: EventRecord


@dataclass(frozen=True, slots=True)
class RunPrecheck:
    """Ask the call's pre-check about its key (``call``: whose spec holds the pre-check)."""

    key: str
    args: dict[str, Any]
    call: CallContext | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class RunTool:
    """Run the tool; ``effect``: a side effect, whose thread lease and business lock are
    checked just before it runs."""

    invocation: Invocation
    effect: bool = True


@dataclass(frozen=True, slots=True)
class AwaitOwner:
    """Wait while the runner that wrote this ``intended`` entry may still be performing it.

    The driver checks the entry's thread lease (``thread:<entry.thread_id>``): held by
    another runner than the current one, the effect is in progress elsewhere, so it
    re-reads the entry until it leaves ``intended`` or the lease is gone, at most for its
    timeout. It answers :class:`Awaited`.
    """

    entry: LedgerEntry


@dataclass(frozen=True, slots=True)
class Awaited:
    """What waiting for an intent's owner found.

    Attributes:
        entry: The entry as last read (``None`` if it was deleted meanwhile).
        holder: The owner's lease holder that was waited for; ``None`` when nobody else
            held the lease (an orphan intent, or the current runner's own).
        waited: Seconds spent waiting.
        timed_out: The owner still held its lease and the entry was still ``intended``.
    """

    entry: LedgerEntry | None
    holder: str | None = None
    waited: float = 0.0
    timed_out: bool = False


def in_flight(entry: LedgerEntry | None) -> TypeGuard[LedgerEntry]:
    """Whether ``entry`` is an intent whose call may still be running (not one paused on an
    ``interrupt()``, which its own thread continues)."""
    return (
        entry is not None and entry.status is LedgerStatus.INTENDED and not entry.extra.get(PAUSED)
    )


Request = (
    CheckArgs
    | FindRepeat
    | FindPrevious
    | ReadEntry
    | AwaitOwner
    | WriteEntry
    | WriteEvent
    | RunPrecheck
    | RunTool
)
_T = TypeVar("_T")
Asks = Generator[Request, Any, _T]
"""A part of the protocol: it yields requests and returns a ``_T``."""
Protocol = Asks[CallOutcome]
