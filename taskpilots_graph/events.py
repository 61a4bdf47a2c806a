"""Typed, append-only event log records.

Every task keeps one ordered log of what happened while it ran: what the agent planned, which
tool it called with which arguments, what came back, which failures happened and how they were
recovered. Events are written *as execution happens* (before a tool call and after it), never
reconstructed after the fact, so a crash leaves an honest trail.

This module is I/O free: it defines the record types and their JSON encoding. Storage lives
in :mod:`taskpilots_graph.checkpointers`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from taskpilots_graph.errors import ConfigurationError, CorruptRecordError

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "MAX_THREAD_ID_BYTES",
    "Event",
    "EventKind",
    "EventRecord",
    "check_thread_id",
    "encode_payload",
    "event_from_row",
    "mark_superseded",
    "prepare_event",
]

MAX_PAYLOAD_BYTES = 256 * 1024
"""Upper bound on one event's encoded payload; large results belong in the artifact store."""


class EventKind(StrEnum):
    """What an event records. The first eight are the lifecycle of a task."""

    AGENT_STARTED = "agent_started"
    PLAN_CREATED = "plan_created"
    TOOL_INVOKED = "tool_invoked"
    TOOL_SUCCEEDED = "tool_succeeded"
    TOOL_FAILED = "tool_failed"
    LLM_DECIDED = "llm_decided"
    STEP_COMPLETED = "step_completed"
    AGENT_FINISHED = "agent_finished"
    # Recovery events.
    RUN_RESUMED = "run_resumed"
    RESUME_CONTEXT = "resume_context"
    MODEL_FAILED = "model_failed"
    TOOL_SKIPPED = "tool_skipped"
    TOOL_PAUSED = "tool_paused"
    EFFECT_RECONCILED = "effect_reconciled"
    EFFECT_UNCERTAIN = "effect_uncertain"
    RETRY_SCHEDULED = "retry_scheduled"
    DEGRADED = "degraded"
    TAKEOVER_REQUESTED = "takeover_requested"
    DECISION_RECORDED = "decision_recorded"
    COMPENSATED = "compensated"
    MILESTONE_REACHED = "milestone_reached"
    REWOUND = "rewound"
    STUCK_DETECTED = "stuck_detected"
    RESULT_DRIFTED = "result_drifted"  # the same call answered differently when run again
    REPEAT_CAUGHT = "repeat_caught"  # a committed effect asked for again: recorded result returned
    INTENT_AWAITED = "intent_awaited"  # a live intent of another runner was waited for
    CALLS_CLOSED = "calls_closed"  # open tool calls answered before new input was taken


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of a thread's event log.

    Attributes:
        thread_id: The LangGraph thread the event belongs to.
        seq: Position in the thread's log, starting at 1, without gaps.
        kind: What happened.
        ts: When it was appended (UTC).
        payload: JSON data of the event (read-only).
        checkpoint_id: The checkpoint the run was at, when known.
        checkpoint_ns: The checkpoint namespace ("" for the root graph).
        superseded: A later ``rewind`` went back before this event: it is kept for audit
            and left out of summaries and metrics.
    """

    thread_id: str
    seq: int
    kind: EventKind
    ts: datetime
    payload: Mapping[str, Any] = field(default_factory=dict)
    checkpoint_id: str | None = None
    checkpoint_ns: str = ""
    superseded: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.payload, MappingProxyType):
            object.__setattr__(self, "payload", MappingProxyType(dict(self.payload)))


def encode_payload(payload: Mapping[str, Any] | None) -> str:
    """Encode an event payload as canonical JSON.

    Raises:
        ConfigurationError: If the payload is not JSON-serialisable (including NaN and
            infinities) or exceeds :data:`MAX_PAYLOAD_BYTES` once encoded.
    """
    try:
        text = json.dumps(
            dict(payload or {}),
            ensure_ascii=False,
            sort_keys=True,
            separators=(",", ":"),
            allow_nan=False,
        )
        text.encode()  # lone surrogates cannot be stored by any backend
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"event payload must be JSON-serialisable: {exc}; convert values to str, "
            "numbers, lists or dicts, or store large data as an artifact"
        ) from exc
    if "\\u0000" in text.replace("\\\\", ""):
        # PostgreSQL cannot store NUL in text or JSONB; refuse it on every backend alike.
        raise ConfigurationError("event payload contains a NUL character (\\x00); remove it")
    if len(text.encode()) > MAX_PAYLOAD_BYTES:
        raise ConfigurationError(
            f"event payload is {len(text.encode())} bytes, over the {MAX_PAYLOAD_BYTES} byte "
            "limit; store the raw data as an artifact and log its id instead"
        )
    return text


def mark_superseded(events: list[Event]) -> list[Event]:
    """Flag the events that a later ``rewound`` event superseded (seq ranges it names)."""
    ranges = [
        (int(e.payload.get("from_seq", 0)), int(e.payload.get("to_seq", -1)))
        for e in events
        if e.kind is EventKind.REWOUND
    ]
    if not ranges:
        return events
    return [
        replace(e, superseded=True) if any(a <= e.seq <= b for a, b in ranges) else e
        for e in events
    ]


def event_from_row(
    *,
    thread_id: str,
    seq: int,
    kind: Any,
    ts: Any,
    payload: Any,
    checkpoint_id: str | None,
    checkpoint_ns: str | None,
) -> Event:
    """Rebuild an :class:`Event` from a stored row.

    Raises:
        CorruptRecordError: If the kind is unknown, the timestamp is not a time, or the
            payload is not a JSON object. Corrupt rows are never skipped.
    """
    key = f"{thread_id}#{seq}"
    try:
        event_kind = EventKind(kind)
    except ValueError as exc:
        raise CorruptRecordError(f"unknown event kind {kind!r}", table=_TABLE, key=key) from exc
    return Event(
        thread_id=thread_id,
        seq=seq,
        kind=event_kind,
        ts=_decode_ts(ts, key),
        payload=_decode_payload(payload, key),
        checkpoint_id=checkpoint_id,
        checkpoint_ns=checkpoint_ns or "",
    )


_TABLE = "taskpilots_events"


def _decode_payload(raw: Any, key: str) -> dict[str, Any]:
    if isinstance(raw, str | bytes):
        try:
            value = json.loads(raw, parse_constant=_reject_constant)
        except ValueError as exc:
            raise CorruptRecordError(
                f"event payload is not valid JSON: {exc}", table=_TABLE, key=key
            ) from exc
    else:
        value = raw
    if not isinstance(value, dict):
        raise CorruptRecordError(
            f"event payload must be a JSON object, found {type(value).__name__}",
            table=_TABLE,
            key=key,
        )
    return value


def _decode_ts(raw: Any, key: str) -> datetime:
    if isinstance(raw, datetime):
        return raw if raw.tzinfo else raw.replace(tzinfo=UTC)
    if isinstance(raw, int | float) and not isinstance(raw, bool) and math.isfinite(raw):
        return datetime.fromtimestamp(raw, UTC)
    raise CorruptRecordError(f"event timestamp {raw!r} is not a time", table=_TABLE, key=key)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


MAX_THREAD_ID_BYTES = 1024
"""The longest thread id stored, in UTF-8 bytes (every backend indexes it; PostgreSQL's
index rows stop near 2.7 KB)."""


def check_thread_id(thread_id: object) -> str:
    """``thread_id`` if every backend can store it; the one rule, checked before any write.

    Raises:
        ConfigurationError: For a non-string or empty id, a NUL character, a lone surrogate
            (not encodable as UTF-8) or an id longer than :data:`MAX_THREAD_ID_BYTES`.
    """
    if not isinstance(thread_id, str) or not thread_id:
        raise ConfigurationError(
            f"thread_id must be a non-empty string, got {_shown(thread_id)} "
            f"({type(thread_id).__name__})"
        )
    if "\x00" in thread_id:
        raise ConfigurationError(
            f"thread_id {_shown(thread_id)} contains a NUL character, which no backend stores"
        )
    try:
        size = len(thread_id.encode())
    except UnicodeEncodeError as exc:
        raise ConfigurationError(
            f"thread_id {_shown(thread_id)} is not valid Unicode text (a lone surrogate at "
            f"position {exc.start}); it cannot be stored"
        ) from exc
    if size > MAX_THREAD_ID_BYTES:
        raise ConfigurationError(
            f"thread_id {_shown(thread_id)} is {size} bytes long in UTF-8; at most "
            f"{MAX_THREAD_ID_BYTES} are stored (use a hash or a shorter id)"
        )
    return thread_id


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


@dataclass(frozen=True, slots=True)
class EventRecord:
    """An event validated and encoded, ready for a store to insert."""

    thread_id: str
    kind: EventKind
    ts: float
    checkpoint_ns: str
    checkpoint_id: str | None
    payload: str

    def to_event(self, seq: int) -> Event:
        """The :class:`Event` this record becomes once stored at ``seq``."""
        return event_from_row(seq=seq, **{f.name: getattr(self, f.name) for f in fields(self)})


def prepare_event(
    thread_id: str,
    kind: EventKind | str,
    payload: Mapping[str, Any] | None,
    *,
    checkpoint_id: str | None,
    checkpoint_ns: str,
) -> EventRecord:
    """Validate an event before anything is written.

    Raises:
        ConfigurationError: For a thread id :func:`check_thread_id` refuses, an unknown
            kind or a payload that is not JSON-serialisable or too large.
    """
    check_thread_id(thread_id)
    if not isinstance(checkpoint_ns, str):
        raise ConfigurationError("checkpoint_ns must be a string")
    if "\x00" in checkpoint_ns or _unencodable(checkpoint_ns):
        raise ConfigurationError(
            f"checkpoint_ns {checkpoint_ns!r} contains characters no backend can store"
        )
    try:
        event_kind = EventKind(kind)
    except ValueError as exc:
        known = ", ".join(k.value for k in EventKind)
        raise ConfigurationError(f"unknown event kind {kind!r}; known kinds: {known}") from exc
    return EventRecord(
        thread_id=thread_id,
        kind=event_kind,
        ts=time.time(),
        checkpoint_ns=checkpoint_ns,
        checkpoint_id=checkpoint_id,
        payload=encode_payload(payload),
    )


def _unencodable(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return True
    return False
