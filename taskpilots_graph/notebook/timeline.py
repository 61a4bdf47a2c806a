"""Notebook views of one thread: its timeline and its side-effect ledger.

Both are frozen snapshots read once from the store; a notebook cell ending with one shows a
colour-coded HTML table (``_repr_html_``), ``repr()`` gives the same facts as text.

Example:
    >>> from taskpilots_graph import notebook
    >>> notebook.timeline(cp, "t-1")  # doctest: +SKIP
    >>> notebook.ledger_view(cp, "t-1")  # doctest: +SKIP
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver

from taskpilots_graph.errors import ThreadNotFound
from taskpilots_graph.events import EventKind
from taskpilots_graph.ledger import LedgerEntry
from taskpilots_graph.notebook import html
from taskpilots_graph.replay import ReplayStep, areplay, replay
from taskpilots_graph.threads import athread_info, recovery_api, thread_info

__all__ = ["LedgerView", "Timeline", "aledger_view", "atimeline", "ledger_view", "timeline"]


@dataclass(frozen=True, slots=True)
class Timeline:
    """A thread's events, ready to show: what happened, when, and how it was recovered.

    Attributes:
        thread_id: The thread.
        steps: Its events as replay steps (superseded ones included, flagged).
        status: The thread's status when read (``None`` for a thread with events only).
    """

    thread_id: str
    steps: tuple[ReplayStep, ...] = ()
    status: str | None = None

    def count(self, kind: EventKind | str) -> int:
        """How many events of ``kind`` count (superseded ones are left out)."""
        wanted = EventKind(kind)
        return sum(1 for s in self.steps if s.kind is wanted and not s.superseded)

    @property
    def states(self) -> tuple[str, ...]:
        """The colour class of every step (see :data:`html.STEP_STATES`)."""
        return tuple(html.step_state(s.kind, s.payload) for s in self.steps)

    def __repr__(self) -> str:
        head = (
            f"Timeline({self.thread_id!r}, status={self.status!r}, {len(self.steps)} events, "
            f"{self.count(EventKind.TOOL_INVOKED)} tool calls, "
            f"{self.count(EventKind.TOOL_FAILED)} failures, "
            f"{self.count(EventKind.TAKEOVER_REQUESTED)} takeovers, "
            f"{self.count(EventKind.RUN_RESUMED)} resumes)"
        )
        lines = (replace(s, summary=html.what_happened(s)).render() for s in self.steps)
        return "\n".join([head, *lines])

    def _repr_html_(self) -> str:
        return html.timeline_html(self.thread_id, self.steps, status=self.status)


@dataclass(frozen=True, slots=True)
class LedgerView:
    """Side-effect ledger entries, ready to show.

    Attributes:
        entries: The entries, in the store's order.
        thread_id: The thread they were read for (``None``: every thread).
    """

    entries: tuple[LedgerEntry, ...] = ()
    thread_id: str | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def by_status(self) -> dict[str, int]:
        """Entries per ledger status."""
        return dict(sorted(Counter(e.status.value for e in self.entries).items()))

    def __repr__(self) -> str:
        scope = f"thread {self.thread_id!r}" if self.thread_id else "all threads"
        lines = [f"LedgerView({scope}, {len(self.entries)} entries, {self.by_status()})"]
        lines += [
            f"  {e.status.value:<11} {e.tool} key={e.key} attempt={e.attempt}"
            + (f" proof={e.proof!r}" if e.proof is not None else "")
            for e in self.entries
        ]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return html.ledger_html(self.entries, thread_id=self.thread_id)


def timeline(checkpointer: BaseCheckpointSaver[Any], thread_id: str) -> Timeline:
    """Read a thread's timeline (its event log and current status).

    Raises:
        ThreadNotFound: If the thread has neither an event nor a checkpoint.
        ConfigurationError: If ``checkpointer`` is not a recovery checkpointer.
    """
    steps = replay(checkpointer, thread_id).steps
    try:
        status: str | None = thread_info(checkpointer, thread_id).status
    except ThreadNotFound:  # events without a checkpoint
        status = None
    return Timeline(thread_id=thread_id, steps=steps, status=status)


async def atimeline(checkpointer: BaseCheckpointSaver[Any], thread_id: str) -> Timeline:
    """Async form of :func:`timeline`."""
    steps = (await areplay(checkpointer, thread_id)).steps
    try:
        status: str | None = (await athread_info(checkpointer, thread_id)).status
    except ThreadNotFound:
        status = None
    return Timeline(thread_id=thread_id, steps=steps, status=status)


def ledger_view(checkpointer: BaseCheckpointSaver[Any], thread_id: str | None = None) -> LedgerView:
    """Read the side-effect ledger of one thread (or of every thread).

    Raises:
        ConfigurationError: If ``checkpointer`` is not a recovery checkpointer.
    """
    return LedgerView(tuple(recovery_api(checkpointer).ledger(thread_id)), thread_id)


async def aledger_view(
    checkpointer: BaseCheckpointSaver[Any], thread_id: str | None = None
) -> LedgerView:
    """Async form of :func:`ledger_view`."""
    return LedgerView(tuple(await recovery_api(checkpointer).aledger(thread_id)), thread_id)
