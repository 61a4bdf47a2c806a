"""Where each thread stands: list the threads of a store and describe one.

:func:`thread_info` reads a thread's latest checkpoint (its ``flow`` channel and pending
interrupts) and its event log, and answers with a :class:`ThreadInfo`:

==================  ============================================================================
status              meaning
==================  ============================================================================
``running``         not finished and not waiting: being executed right now, *or* stopped by a
                    crash (a killed process leaves the same state behind; no lease is read
                    here). ``resume`` continues it either way. A run compensating effects
                    counts as running.
``waiting_tool``    stopped to wait for a tool until ``retry_at``; ``resume`` then continues.
``awaiting_human``  waits on a person (a pending interrupt or the flow says so); answer with
                    ``decide``. ``takeover_pending`` says whether the takeover request is there.
``closed``          finished (answered, or abandoned by a person and compensated).
``failed``          ended failed.
==================  ============================================================================

Nothing is hidden behind ``closed`` or ``failed``: a thread with a ledger entry left
``intended`` by a run that stopped is ``running`` (``resume`` or new input reconciles it),
and one with an ``uncertain`` entry is ``awaiting_human``, whatever its flow says; the reason
names the entries.

The flow stage is taken from the checkpoint, with the writes pending on it applied (after a
crash between a node's writes and the next checkpoint they hold the newest stage). A thread
whose flow says ``closed`` or ``failed`` but whose log shows a newer turn (a user message
after the last ``agent_finished``) is ``running``. Graphs without the recovery agent's
``flow`` channel get their status from the event log alone (:func:`status_from_events`).

Listing the threads of a store is :mod:`taskpilots_graph.thread_listing`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any, Literal, cast, get_args

from langgraph.checkpoint.base import BaseCheckpointSaver, CheckpointTuple

from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.errors import ConfigurationError, ThreadNotFound
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.ledger import PAUSED, LedgerEntry, LedgerStatus
from taskpilots_graph.reprs import html_view
from taskpilots_graph.state import FlowState, StepRecord, merge_flow, merge_steps

__all__ = [
    "THREAD_STATUSES",
    "OpenStep",
    "ThreadInfo",
    "ThreadStatus",
    "athread_info",
    "describe_thread",
    "listed_thread_info",
    "recovery_api",
    "root_config",
    "status_from_events",
    "thread_info",
    "undecided_uncertain",
]

ThreadStatus = Literal["running", "waiting_tool", "awaiting_human", "closed", "failed"]
THREAD_STATUSES: tuple[ThreadStatus, ...] = get_args(ThreadStatus)

_INTERRUPT = "__interrupt__"
# A run compensating effects counts as running; every other stage is its own status.
_STAGE_STATUS: Mapping[str, ThreadStatus] = {
    **{status: status for status in THREAD_STATUSES},
    "compensating": "running",
}


@dataclass(frozen=True, slots=True)
class OpenStep:
    """A tool call of the thread that is not settled yet.

    Attributes:
        tool_call_id: The model's id for the call.
        tool: The tool the model asked for.
        using: The tool being called (a fallback after degradation).
        status: The step's status (``waiting_tool``, ``awaiting_human``, ...).
        attempts: Calls of ``using`` so far.
        retry_at: When the next attempt is due (epoch seconds), if scheduled.
    """

    tool_call_id: str
    tool: str
    using: str
    status: str
    attempts: int
    retry_at: float | None = None


@dataclass(frozen=True, slots=True)
class ThreadInfo:
    """Where one thread stands (see the module docstring for the statuses).

    Attributes:
        thread_id: The thread.
        status: ``running``, ``waiting_tool``, ``awaiting_human``, ``closed`` or ``failed``.
        stage: The raw flow stage of the checkpoint (``None`` for graphs without one).
        reason: Why the run waits, escalated or failed, as the flow records it.
        retry_at: When a ``waiting_tool`` run is due (epoch seconds).
        takeover_pending: A takeover request waits for a person's decision.
        current_step: The first unsettled tool call, if any.
        superstep: LangGraph's step number of the latest checkpoint.
        checkpoint_id: The latest checkpoint's id (``None`` for a thread with events only).
        updated_at: When the latest checkpoint was written.
        last_event_at: When the last event was appended.
        last_event: The kind of the last event.
        events: Events in the log (superseded ones included).
        tool_calls: ``tool_invoked`` events (every attempt counts).
        tool_failures: ``tool_failed`` events.
        retries: ``retry_scheduled`` events.
        takeovers: ``takeover_requested`` events.
        effects: Ledger entries recorded by the thread.
        intended_effects: Of those, entries left ``intended`` by a run that stopped (not
            paused on a person): an effect that may have happened and is not reconciled
            yet (``resume`` or new input reconciles it first).
        uncertain_effects: Of those, entries nobody could confirm: a person decides.
        corrupt_events: Keys (``thread#seq``) of event rows that could not be decoded and
            were left out (listings only: :func:`~.thread_listing.list_threads` skips and
            reports them instead of failing the whole store; ``thread_info`` raises).

    The event counts are over the whole log, superseded events included. A thread with an
    intended or uncertain entry is never ``closed`` (nor ``failed``): ``running`` while an
    intent waits to be reconciled, ``awaiting_human`` while an effect is uncertain.
    """

    thread_id: str
    status: ThreadStatus
    stage: str | None = None
    reason: str | None = None
    retry_at: float | None = None
    takeover_pending: bool = False
    current_step: OpenStep | None = None
    superstep: int | None = None
    checkpoint_id: str | None = None
    updated_at: datetime | None = None
    last_event_at: datetime | None = None
    last_event: str | None = None
    events: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    retries: int = 0
    takeovers: int = 0
    effects: int = 0
    intended_effects: int = 0
    uncertain_effects: int = 0
    corrupt_events: tuple[str, ...] = ()

    @property
    def unsettled_effects(self) -> int:
        """Entries that are neither settled nor known not to have happened."""
        return self.intended_effects + self.uncertain_effects

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (times as ISO 8601 strings)."""
        data = asdict(self)
        for name in ("updated_at", "last_event_at"):
            value = data[name]
            data[name] = value.isoformat() if value is not None else None
        return data

    def _repr_html_(self) -> str | None:
        # Drawn by the notebook package once imported (see taskpilots_graph.reprs).
        return html_view(self)


def status_from_events(events: Sequence[Event]) -> ThreadStatus:
    """A thread's status read from its event log alone (I/O free).

    The last ``agent_finished`` gives ``closed`` / ``failed`` unless a newer turn started;
    an unanswered ``takeover_requested`` gives ``awaiting_human``; a ``retry_scheduled`` not
    yet followed by another call gives ``waiting_tool``; anything else is ``running``.
    Superseded events are ignored.
    """
    status: ThreadStatus = "running"
    for event in events:
        if event.superseded:
            continue
        kind = event.kind
        if kind is EventKind.AGENT_FINISHED:
            status = "failed" if event.payload.get("status") == "failed" else "closed"
        elif kind is EventKind.TAKEOVER_REQUESTED:
            status = "awaiting_human"
        elif kind is EventKind.RETRY_SCHEDULED:
            if status != "awaiting_human":
                status = "waiting_tool"
        elif kind in (EventKind.DECISION_RECORDED, EventKind.AGENT_STARTED) or (
            kind is EventKind.TOOL_INVOKED and status == "waiting_tool"
        ):
            status = "running"
    return status


def _flow(found: CheckpointTuple) -> FlowState | None:
    values = found.checkpoint.get("channel_values") or {}
    flow = values.get("flow")
    if not isinstance(flow, Mapping):
        flow = None
    # Writes of a finished task not yet folded into a checkpoint (a crash in between) are
    # newer than the channel value: apply them as the reducer would.
    for _task, channel, value in found.pending_writes or ():
        if channel == "flow" and isinstance(value, Mapping):
            flow = merge_flow(cast(FlowState, flow or {}), cast(FlowState, value))
    return cast(FlowState, flow) if flow is not None else None


def _interrupts(found: CheckpointTuple) -> tuple[bool, bool]:
    """(any interrupt pending, a takeover request among them)."""
    pending = takeover = False
    for _task, channel, value in found.pending_writes or ():
        if channel != _INTERRUPT:
            continue
        for item in value if isinstance(value, list | tuple) else [value]:
            pending = True
            data = getattr(item, "value", None)
            takeover = takeover or (isinstance(data, Mapping) and "options" in data)
    return pending, takeover


def _open_step(found: CheckpointTuple) -> OpenStep | None:
    steps = (found.checkpoint.get("channel_values") or {}).get("steps")
    merged = dict(cast(Mapping[str, StepRecord], steps)) if isinstance(steps, Mapping) else {}
    for _task, channel, value in found.pending_writes or ():
        if channel == "steps" and isinstance(value, Mapping):
            merged = merge_steps(merged, cast(Mapping[str, StepRecord], value))
    for call_id, record in merged.items():
        if record.get("status", "closed") == "closed":
            continue
        tool = str(record.get("tool") or "")
        return OpenStep(
            tool_call_id=str(record.get("tool_call_id") or call_id),
            tool=tool,
            using=str(record.get("using") or tool),
            status=str(record.get("status")),
            attempts=int(record.get("attempts") or 0),
            retry_at=record.get("retry_at"),
        )
    return None


def _newer_turn(events: Sequence[Event]) -> bool:
    """A turn started after the last ``agent_finished`` (the flow stage lags behind it)."""
    live = [e for e in events if not e.superseded]
    finished = [i for i, e in enumerate(live) if e.kind is EventKind.AGENT_FINISHED]
    if not finished:
        return False
    return any(e.kind is EventKind.AGENT_STARTED for e in live[finished[-1] + 1 :])


def describe_thread(
    thread_id: str,
    found: CheckpointTuple | None,
    events: Sequence[Event],
    ledger: Iterable[LedgerEntry] = (),
) -> ThreadInfo:
    """Build a :class:`ThreadInfo` from what was read (I/O free).

    Raises:
        ThreadNotFound: If there is neither a checkpoint, nor an event, nor a ledger entry.
    """
    own = [e for e in ledger if e.thread_id == thread_id]
    if found is None and not events and not own:
        raise ThreadNotFound(thread_id)
    flow = _flow(found) if found is not None else None
    interrupted, takeover = _interrupts(found) if found is not None else (False, False)
    status: ThreadStatus
    if interrupted:
        status = "awaiting_human"
    elif flow is not None and flow.get("stage") in _STAGE_STATUS:
        status = _STAGE_STATUS[str(flow.get("stage"))]
        if status in ("closed", "failed") and _newer_turn(events):
            status = "running"
    else:
        status = status_from_events(events)
    intended = [e for e in own if e.status is LedgerStatus.INTENDED and not e.extra.get(PAUSED)]
    uncertain = [e for e in own if e.status is LedgerStatus.UNCERTAIN]
    reason = flow.get("reason") if flow else None
    # Nothing hidden: an effect that may have happened and is not settled keeps the thread
    # open, whatever its flow says (a crash after the effect, a stopped run). An uncertain
    # effect a person already decided on (e.g. abandoned) stays counted, not waiting.
    undecided = undecided_uncertain(uncertain, events)
    if undecided and status != "awaiting_human":
        status = "awaiting_human"
        reason = _unsettled_reason("uncertain", undecided)
    elif intended and status in ("closed", "failed"):
        status = "running"
        reason = _unsettled_reason("not reconciled", intended)
    counts = Counter(event.kind for event in events)
    last = events[-1] if events else None
    checkpoint_ts = found.checkpoint.get("ts") if found is not None else None
    step = (found.metadata or {}).get("step") if found is not None else None
    return ThreadInfo(
        thread_id=thread_id,
        status=status,
        stage=str(flow["stage"]) if flow and flow.get("stage") else None,
        reason=reason,
        retry_at=flow.get("retry_at") if flow and status == "waiting_tool" else None,
        takeover_pending=takeover,
        current_step=_open_step(found) if found is not None else None,
        superstep=step if isinstance(step, int) else None,
        checkpoint_id=found.config["configurable"].get("checkpoint_id") if found else None,
        updated_at=datetime.fromisoformat(checkpoint_ts) if checkpoint_ts else None,
        last_event_at=last.ts if last is not None else None,
        last_event=last.kind.value if last is not None else None,
        events=len(events),
        tool_calls=counts[EventKind.TOOL_INVOKED],
        tool_failures=counts[EventKind.TOOL_FAILED],
        retries=counts[EventKind.RETRY_SCHEDULED],
        takeovers=counts[EventKind.TAKEOVER_REQUESTED],
        effects=len(own),
        intended_effects=len(intended),
        uncertain_effects=len(uncertain),
    )


def undecided_uncertain(
    entries: Sequence[LedgerEntry], events: Sequence[Event]
) -> list[LedgerEntry]:
    """The ``uncertain`` entries no person has decided on since they became uncertain.

    A decision recorded after the entry last changed (a takeover answered, whatever the
    action) means a person has seen it; the entry may stay ``uncertain`` (``abandon``).
    """
    decided = [e.ts for e in events if e.kind is EventKind.DECISION_RECORDED and not e.superseded]
    return [
        e
        for e in entries
        if e.status is LedgerStatus.UNCERTAIN and not any(t >= e.updated_at for t in decided)
    ]


def _unsettled_reason(what: str, entries: Sequence[LedgerEntry]) -> str:
    named = ", ".join(f"{e.tool} ({e.key})" for e in entries[:3])
    more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
    return f"{len(entries)} effect(s) {what}: {named}{more}"


def recovery_api(checkpointer: BaseCheckpointSaver[Any]) -> RecoveryAPI:
    """``checkpointer`` as a recovery checkpointer (it has an event log and a ledger).

    Raises:
        ConfigurationError: For a plain LangGraph saver.
    """
    if not isinstance(checkpointer, RecoveryAPI):
        raise ConfigurationError(
            "threads, metrics and replay need a RecoveryCheckpointer or "
            "AsyncRecoveryCheckpointer (they read its event log), "
            f"got {type(checkpointer).__name__}"
        )
    return checkpointer


def root_config(thread_id: str) -> Any:
    """The config addressing a thread's root graph.

    Raises:
        ConfigurationError: For an empty or non-string thread id.
    """
    if not isinstance(thread_id, str) or not thread_id:
        raise ConfigurationError("thread_id must be a non-empty string")
    return {"configurable": {"thread_id": thread_id}}


def thread_info(checkpointer: BaseCheckpointSaver[Any], thread_id: str) -> ThreadInfo:
    """Where one thread stands.

    Example:
        >>> tp.thread_info(cp, "t-1").status  # doctest: +SKIP
        'awaiting_human'

    Raises:
        ThreadNotFound: If the thread has neither a checkpoint, nor an event, nor a ledger
            entry.
        ConfigurationError: If ``checkpointer`` is not a recovery checkpointer.
    """
    cp = recovery_api(checkpointer)
    found = cp.get_tuple(root_config(thread_id))
    return describe_thread(thread_id, found, cp.events(thread_id), cp.ledger(thread_id))


async def athread_info(checkpointer: BaseCheckpointSaver[Any], thread_id: str) -> ThreadInfo:
    """Async form of :func:`thread_info`."""
    cp = recovery_api(checkpointer)
    found = await cp.aget_tuple(root_config(thread_id))
    events = await cp.aevents(thread_id)
    return describe_thread(thread_id, found, events, await cp.aledger(thread_id))


def listed_thread_info(
    thread_id: str,
    found: CheckpointTuple | None,
    events: Sequence[Event],
    ledger: Sequence[LedgerEntry],
    corrupt: tuple[str, ...],
) -> ThreadInfo:
    """:func:`describe_thread` for a listing: the keys of corrupt event rows left out of
    ``events`` are reported, and a thread whose only events were corrupt is still listed."""
    if not corrupt:
        return describe_thread(thread_id, found, events, ledger)
    try:
        info = describe_thread(thread_id, found, events, ledger)
    except ThreadNotFound:  # its only events were corrupt: still listed, not hidden
        info = ThreadInfo(thread_id=thread_id, status=status_from_events(()))
    return replace(info, corrupt_events=corrupt)
