"""Bounded state: observation summaries (I/O free).

Plain LangGraph re-stores every changed channel at every step, so a state that accumulates raw
tool outputs grows quadratically with the run. Two remedies, both pure functions; the first
lives here, the second in :mod:`taskpilots_graph.compaction`:

* :func:`compress_observation` turns a tool result into an :class:`Observation` for the graph
  state: small results pass through whole; large ones become a bounded, structured summary
  plus the id of an artifact holding the raw bytes (which the caller stores with
  ``checkpointer.put_artifact``). Summaries come from a pluggable :class:`Summarizer`; the
  default, :func:`structural_summary`, is deterministic and needs no model.
* :class:`~taskpilots_graph.compaction.CompactionPolicy` /
  :func:`~taskpilots_graph.compaction.compact_events` decide which events older than the last
  *N* of a thread are reduced to their kind plus key parameters. Ledger-relevant fields
  (:data:`LEDGER_FIELDS`) are never dropped, and events whose whole payload is a ledger or
  human fact (:data:`DEFAULT_PROTECTED_KINDS`) are never reduced. The checkpointers apply
  the plan with ``checkpointer.compact_events(thread_id, keep_last=N)``.

"Recovery is not archaeology": the resume path needs ids, statuses, proofs and summaries, not
every byte a tool ever returned.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Final, Protocol, TypedDict

from taskpilots_graph.errors import ConfigurationError

__all__ = [
    "DEFAULT_SUMMARY_CHARS",
    "DEFAULT_THRESHOLD_BYTES",
    "CompressedObservation",
    "Observation",
    "Summarizer",
    "artifact_id_for",
    "compress_observation",
    "structural_summary",
]

DEFAULT_THRESHOLD_BYTES: Final = 4096
"""Results larger than this (UTF-8 bytes) go to the artifact store."""

DEFAULT_SUMMARY_CHARS: Final = 1000
"""Upper bound on the length of a summary kept in state."""

_HEX_BYTES = 16
_EXCERPT_CHARS = 40
_INLINE_KEYS = 8
_LINE_CHARS = 240
_NESTING = 2


def artifact_id_for(data: bytes) -> str:
    """The content address of ``data``: ``"sha256:<hex>"`` (the artifact store's ids)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


# -- observations ---------------------------------------------------------------------------


class Observation(TypedDict):
    """A tool result as kept in graph state (JSON only, so every serializer handles it).

    Attributes:
        summary: The whole result as text when it was small (``artifact_id`` is ``None``);
            otherwise a bounded summary of it.
        artifact_id: Id of the artifact holding the raw bytes, or ``None`` when ``summary``
            is the complete result.
        size: Size of the raw result in bytes.
        media_type: Media type of the raw result.
    """

    summary: str
    artifact_id: str | None
    size: int
    media_type: str


class Summarizer(Protocol):
    """Produces the summary kept in state for a large result.

    It receives the tool's result as returned (``str``, ``bytes`` or a JSON value) and must
    return text of at most ``max_chars`` characters (longer text is cut). A model-based
    summarizer fits here too; it should be deterministic for the same input if resumed runs
    are to see the same state.
    """

    def __call__(self, payload: Any, /, *, max_chars: int) -> str:
        """Summarize ``payload`` in at most ``max_chars`` characters."""
        ...


@dataclass(frozen=True, slots=True)
class CompressedObservation:
    """What :func:`compress_observation` decided.

    Attributes:
        observation: The value for graph state.
        payload: The raw bytes the caller must store as an artifact (its id is
            ``observation["artifact_id"]``), or ``None`` when nothing needs storing.
    """

    observation: Observation
    payload: bytes | None

    @property
    def needs_artifact(self) -> bool:
        """Whether :attr:`payload` must be stored before the observation enters state."""
        return self.payload is not None


def compress_observation(
    content: Any,
    *,
    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
    summarizer: Summarizer | None = None,
    max_chars: int = DEFAULT_SUMMARY_CHARS,
    media_type: str | None = None,
) -> CompressedObservation:
    """Decide how a tool result is kept: whole in state, or summarized with an artifact.

    Text and JSON results of at most ``threshold_bytes`` (UTF-8) pass through whole. Larger
    ones, and binary data of any size (state holds text), are summarized by ``summarizer``
    (default :func:`structural_summary`) and must be stored as an artifact::

        done = compress_observation(result, threshold_bytes=4096)
        if done.needs_artifact:
            cp.put_artifact(thread_id, done.payload, media_type=done.observation["media_type"])
        state_update = {"observation": done.observation}

    The artifact id is the content hash, so it is known before anything is stored and the
    same result always yields the same observation.

    Args:
        content: The tool result: ``str``, ``bytes`` or a JSON value (other objects are
            kept as their ``str()``).
        threshold_bytes: Largest result kept whole.
        summarizer: Summary function for large results.
        max_chars: Bound on the summary's length.
        media_type: Overrides the detected media type.

    Raises:
        ConfigurationError: For a negative threshold, a ``max_chars`` below 1, or a
            summarizer that does not return text.
    """
    if not isinstance(threshold_bytes, int) or isinstance(threshold_bytes, bool):
        raise ConfigurationError(f"threshold_bytes must be an int, got {threshold_bytes!r}")
    if threshold_bytes < 0:
        raise ConfigurationError(f"threshold_bytes must be >= 0, got {threshold_bytes}")
    check_int("max_chars", max_chars, 1)
    data, detected, text, value = _encode(content)
    kind = media_type or detected
    if text is not None and len(data) <= threshold_bytes:
        return CompressedObservation(
            Observation(summary=text, artifact_id=None, size=len(data), media_type=kind), None
        )
    summary = (summarizer or structural_summary)(value, max_chars=max_chars)
    if not isinstance(summary, str):
        raise ConfigurationError(
            f"the summarizer returned {type(summary).__name__}; it must return str"
        )
    observation = Observation(
        summary=_bound(summary, max_chars),
        artifact_id=artifact_id_for(data),
        size=len(data),
        media_type=kind,
    )
    return CompressedObservation(observation, data)


def _encode(content: Any) -> tuple[bytes, str, str | None, Any]:
    """(bytes, media type, text form or None for binary, value handed to the summarizer)."""
    if isinstance(content, bytes | bytearray | memoryview):
        raw = bytes(content)
        try:
            return raw, "application/octet-stream", raw.decode(), raw
        except UnicodeDecodeError:
            return raw, "application/octet-stream", None, raw
    if isinstance(content, str):
        try:
            raw = content.encode()
        except UnicodeEncodeError:
            # Lone surrogates cannot be stored anywhere; keep what can be represented.
            content = content.encode(errors="replace").decode()
            raw = content.encode()
        is_json = _parse_json(content) is not _NOT_JSON
        return raw, "application/json" if is_json else "text/plain; charset=utf-8", content, content
    try:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        raw = text.encode()
    except (TypeError, ValueError, RecursionError, UnicodeEncodeError):
        return _encode(str(content))
    return raw, "application/json", text, content


# -- structural summary ---------------------------------------------------------------------

_NOT_JSON: Final = object()


def structural_summary(payload: Any, /, *, max_chars: int = DEFAULT_SUMMARY_CHARS) -> str:
    """A deterministic summary of a result's structure, at most ``max_chars`` characters.

    * JSON (a value, or text/bytes that parse as a JSON object or array): the keys with
      their types and encoded sizes, element counts and types of arrays, their first items.
    * Text: its length and line count, then its head and tail.
    * Other bytes: the length and the first bytes in hex.

    Raises:
        ConfigurationError: If ``max_chars`` is below 1.
    """
    check_int("max_chars", max_chars, 1)
    if isinstance(payload, bytes | bytearray | memoryview):
        raw = bytes(payload)
        try:
            payload = raw.decode()
        except UnicodeDecodeError:
            head = " ".join(f"{b:02x}" for b in raw[:_HEX_BYTES])
            more = " …" if len(raw) > _HEX_BYTES else ""
            return _bound(f"binary: {len(raw):,} bytes; starts with: {head}{more}", max_chars)
    if isinstance(payload, str):
        parsed = _parse_json(payload)
        if parsed is _NOT_JSON:
            return _text_summary(payload, max_chars)
        return _json_summary(parsed, len(payload.encode(errors="replace")), max_chars)
    size = _size(payload)
    if size < 0:
        return _text_summary(str(payload), max_chars)
    return _json_summary(payload, size, max_chars)


def check_int(name: str, value: Any, minimum: int) -> None:
    """Raise :class:`ConfigurationError` unless ``value`` is an int (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}")


def _bound(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def _parse_json(text: str) -> Any:
    # Only documents (objects, arrays) count as JSON: "42" or "true" read better as text.
    if not text.lstrip().startswith(("{", "[")):
        return _NOT_JSON
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _size(value: Any) -> int:
    """Encoded JSON size in bytes, or -1 if ``value`` is not JSON."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return len(text.encode())
    except (TypeError, ValueError, RecursionError, UnicodeEncodeError):
        return -1


def _count(n: int, unit: str) -> str:
    return f"{n:,} {unit}" + ("" if n == 1 else "s")


def _type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    return type(value).__name__


def _element_types(items: Sequence[Any]) -> str:
    if not items:
        return ""
    counts = Counter(_type(v) for v in items)
    if len(counts) == 1:
        return f" of {next(iter(counts))}"
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return " of mixed " + ", ".join(f"{name} x{n:,}" for name, n in ranked)


def _quote(text: str) -> str:
    cut = text[:_EXCERPT_CHARS]
    return json.dumps(cut, ensure_ascii=False) + ("…" if len(text) > _EXCERPT_CHARS else "")


def _key(key: Any) -> str:
    text = str(key)
    return text if len(text) <= _EXCERPT_CHARS else text[:_EXCERPT_CHARS] + "…"


def _describe(value: Any, depth: int) -> str:
    """One line about ``value``; ``depth`` levels of its content are shown inline."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        return f"number {_bound(repr(value), _EXCERPT_CHARS)}"
    if isinstance(value, str):
        return f"string({len(value):,}) {_quote(value)}"
    if isinstance(value, Mapping):
        head = f"object({_count(len(value), 'key')}, {_size(value):,} bytes)"
        if depth <= 0 or not value:
            return head
        parts = [
            f"{_key(k)}: {_describe(v, depth - 1)}" for k, v in islice(value.items(), _INLINE_KEYS)
        ]
        if len(value) > _INLINE_KEYS:
            parts.append(f"… {len(value) - _INLINE_KEYS:,} more")
        return f"{head} {{{', '.join(parts)}}}"
    if isinstance(value, list | tuple):
        head = f"array({_count(len(value), 'item')}{_element_types(value)}, {_size(value):,} bytes)"
        if depth <= 0 or not value:
            return head
        return f"{head}; first: {_describe(value[0], depth - 1)}"
    return _quote(str(value))


def _json_summary(value: Any, size: int, max_chars: int) -> str:
    lines: Iterator[str]
    if isinstance(value, Mapping):
        header = f"JSON object: {_count(len(value), 'key')}, {size:,} bytes"
        lines = (f"- {_key(k)}: {_describe(v, _NESTING)}" for k, v in value.items())
        total, unit = len(value), "key"
    elif isinstance(value, list | tuple):
        header = f"JSON array: {_count(len(value), 'item')}{_element_types(value)}, {size:,} bytes"
        lines = (f"- [{i}] {_describe(v, _NESTING)}" for i, v in enumerate(value))
        total, unit = len(value), "item"
    else:
        return _bound(f"JSON {_type(value)}: {_describe(value, 0)}", max_chars)
    return _fit(header, lines, total, unit, max_chars)


def _fit(header: str, lines: Iterator[str], total: int, unit: str, max_chars: int) -> str:
    """The header and as many lines as fit, then how many were left out."""
    out = [header]
    used = len(header)
    shown = 0
    for line in lines:
        line = _bound(line, _LINE_CHARS)
        remaining = total - shown - 1
        # Keep room for the "… N more" line unless this is the last line.
        reserve = len(f"\n… {_count(remaining, unit)} more") if remaining else 0
        if used + 1 + len(line) + reserve > max_chars:
            break
        out.append(line)
        used += 1 + len(line)
        shown += 1
    if shown < total:
        out.append(f"… {_count(total - shown, unit)} more")
    return _bound("\n".join(out), max_chars)


def _text_summary(text: str, max_chars: int) -> str:
    lines = text.count("\n") + (1 if text and not text.endswith("\n") else 0)
    header = f"text: {len(text):,} chars, {_count(lines, 'line')}"
    if len(header) + 1 + len(text) <= max_chars:
        return f"{header}\n{text}" if text else header
    budget = max_chars - len(header) - len("\nhead:\n") - len("\n…\ntail:\n")
    if budget < 2:
        return _bound(header, max_chars)
    head = text[: budget - budget // 2]
    tail = text[len(text) - budget // 2 :] if budget // 2 else ""
    # Whole lines read better: drop a partial last head line / first tail line if possible.
    if "\n" in head[:-1]:
        head = head[: head.rstrip("\n").rfind("\n") + 1].rstrip("\n")
    if "\n" in tail[1:]:
        tail = tail[tail.find("\n", 1) + 1 :]
    return f"{header}\nhead:\n{head}\n…\ntail:\n{tail}"
