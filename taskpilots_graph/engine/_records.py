"""What a call leaves on record: the value the ledger keeps of its result, its events, and
the answer the model reads.

A tool may return anything, and the effect happened whatever it returned: the ledger keeps
a JSON value (reduced, flagged, when it must be), and the events keep bounded summaries
with the context that explains a failure.
"""

from __future__ import annotations

import contextlib
import json
import platform
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from langchain_core.messages import ToolCall, ToolMessage

from taskpilots_graph.checkpointers._rows import MAX_RESULT_BYTES, dump_json, dump_json_unchecked
from taskpilots_graph.drift import (
    brief_value,
    is_placeholder,
    placeholder,
    result_digest,
    unserialisable,
)
from taskpilots_graph.engine._call import CallContext
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import EventKind, EventRecord, prepare_event
from taskpilots_graph.failures import Failure, failure_payload

__all__ = [
    "SUMMARY_CHARS",
    "brief",
    "call_event",
    "error_message",
    "failure_event",
    "now",
    "recordable",
    "result_extra",
    "stand_in",
    "step_event",
    "success_payload",
    "tool_content",
]

UNSERIALISABLE_FLAG = "result_unserialisable"
"""Flag in ``LedgerEntry.extra``: the tool returned a value that cannot be serialised at all
(a cyclic structure, an object whose ``str()`` raises); the entry's result is a placeholder
text saying so and why (:func:`taskpilots_graph.drift.placeholder`). ``result_reduced`` is
set too."""

SUMMARY_CHARS = 2048
"""Raw responses and errors are truncated to this many characters in events."""
RESULT_CHARS = 256
"""Bound on a successful result in its event: a summary of what came back. The ledger keeps
a side effect's whole result, and the checkpoint writes the one the model saw."""


def _library_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("taskpilots-graph")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


ENVIRONMENT: dict[str, str] = {
    "library_version": _library_version(),
    "python_version": platform.python_version(),
    "host": socket.gethostname(),
}
"""Recorded with every failure: where it happened."""


def now() -> datetime:
    """The time a ledger entry is written at (UTC)."""
    return datetime.now(UTC)


def _truncate(text: str, limit: int = SUMMARY_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _text(value: Any) -> str:
    """``str(value)``, or its placeholder when that raises (e.g. a member whose repr()
    raises, though JSON could hold it)."""
    try:
        return str(value)
    except Exception as exc:
        return placeholder(value, f"{type(exc).__name__} from str()")


def recordable(result: Any) -> tuple[Any, bool]:
    """The JSON value the ledger keeps for a result, and whether it had to be reduced.

    A value the store accepts as it is (JSON, at most :data:`MAX_RESULT_BYTES` once encoded
    the way the store encodes it) is kept; anything else is kept as its text, cut until its
    encoding fits: the effect happened and must be committed whatever the tool returned. A
    value that has no text either (cyclic, ``str()`` raises) is kept as its placeholder.
    """
    with contextlib.suppress(ConfigurationError):
        dump_json(result, what="result")
        return result, False
    text = stand_in(result)
    if not isinstance(text, str):
        text = _text(text)
    while len(encoded := dump_json_unchecked(text)) > MAX_RESULT_BYTES:
        # Escapes make the encoding longer than the text: keep the share that fits.
        text = text[: max(0, len(text) * MAX_RESULT_BYTES // len(encoded) - 1)]
    return text, True


def stand_in(result: Any) -> Any:
    """``result`` itself, or its placeholder text when it cannot be serialised at all.

    Applied to a tool's result as soon as the tool returns, so that the ledger, the events,
    the drift digest and the model's message all carry the same faithful text instead of
    failing (after the effect happened) on a value nothing can encode.
    """
    why = unserialisable(result)
    return result if why is None else placeholder(result, why)


def tool_content(result: Any) -> str:
    """A tool result as ``ToolMessage`` content: text as is, anything else as JSON."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, default=str, ensure_ascii=False)
    except Exception:  # cyclic, or a str() that raises: say so rather than fail the step
        why = unserialisable(result)
        return placeholder(result, why or "it cannot be encoded as JSON")


def error_message(call: ToolCall, text: str) -> ToolMessage:
    """The error answer to a tool call, as the model will see it."""
    return ToolMessage(
        content=text, tool_call_id=call["id"] or "", name=call["name"], status="error"
    )


def result_extra(extra: Mapping[str, Any], recorded: Any, reduced: bool) -> Mapping[str, Any]:
    """The entry's ``extra`` for a recorded result: flagged when it had to be reduced."""
    if is_placeholder(recorded):
        return {**extra, "result_reduced": True, UNSERIALISABLE_FLAG: True}
    return {**extra, "result_reduced": True} if reduced else extra


def brief(value: Any) -> Any:
    """``value`` itself when its JSON fits an event summary, else its truncated text."""
    with contextlib.suppress(TypeError, ValueError):
        if len(dump_json_unchecked(value)) <= SUMMARY_CHARS:
            return value
    return _truncate(str(value))


def step_event(
    thread_id: str, checkpoint_ns: str, kind: EventKind, /, **payload: Any
) -> EventRecord:
    """An event of the run, written before the checkpoint of its step exists."""
    return prepare_event(thread_id, kind, payload, checkpoint_id=None, checkpoint_ns=checkpoint_ns)


def call_event(ctx: CallContext, kind: EventKind, /, **payload: Any) -> EventRecord:
    """An event about the call of ``ctx``, naming its tool, key and tool-call id."""
    body = {"tool": ctx.tool, "key": ctx.key, "tool_call_id": ctx.tool_call_id, **payload}
    return step_event(ctx.thread_id, ctx.checkpoint_ns, kind, **body)


def failure_event(
    ctx: CallContext, failure: Failure, maybe_sent: bool, attempt: int
) -> EventRecord:
    """``tool_failed`` with the complete failure context, so the log alone explains it."""
    return call_event(
        ctx,
        EventKind.TOOL_FAILED,
        args=dict(ctx.args),
        attempt=attempt,
        maybe_sent=maybe_sent,
        failure=failure_payload(failure),
        at=now().isoformat(),
        **ENVIRONMENT,
    )


def success_payload(ctx: CallContext, result: Any) -> dict[str, Any]:
    """The payload of a ``tool_succeeded`` event: a summary, and a digest of the whole
    result so that a later run of the same call can tell whether it drifted."""
    payload: dict[str, Any] = {
        "result": _truncate(_text(result), RESULT_CHARS),
        "digest": result_digest(result),
    }
    if is_placeholder(result):
        payload[UNSERIALISABLE_FLAG] = True
    if ctx.keeps_value:
        payload["value"] = brief_value(result)
    return payload
