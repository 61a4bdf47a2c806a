"""Drifted results: the same tool call answered differently when it runs again.

A call runs again with the same tool-call id when its step is replayed: the act step after a
crash, or a person's ``retry``. Every ``tool_succeeded`` event keeps a digest of the full
result, so the new result can be compared with the one recorded before (by digest, or by a
user comparator when the earlier value was kept). What a difference leads to depends on the
tool:

* high risk (``side_effect(..., confirm_drift=True)`` or ``ToolPolicy(confirm_drift=True)``):
  the step stops with :class:`ResultDrifted` (a ``data_uncertain`` failure), so a person
  sees both values and their difference and answers ``accept`` (keep the new result),
  ``retry``, ``skip``, ``provide_result`` or ``abandon``;
* low risk (every other tool): the new result is taken and a ``result_drifted`` event
  records both values.

This module is I/O free.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from taskpilots_graph.ledger import canonical_json

__all__ = [
    "DRIFT_VALUE_CHARS",
    "UNSERIALISABLE",
    "Comparator",
    "brief_value",
    "detect_drift",
    "difference",
    "is_placeholder",
    "placeholder",
    "result_digest",
    "unserialisable",
]

Comparator = Callable[[Any, Any], bool]
"""``comparator(previous, current) -> bool``: true when the two results mean the same."""

DRIFT_VALUE_CHARS = 2048
"""A value kept in an event (the earlier result, either side of a drift) is at most this
long once encoded; a longer one is kept as its truncated text."""

_MAX_LINES = 20


UNSERIALISABLE = "[result not serialisable: "
"""How the text standing in for a result that cannot be serialised begins."""

_PLACEHOLDER_TEXT_CHARS = 2048


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # an exception whose own message cannot be built
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def unserialisable(result: Any) -> str | None:
    """Why ``result`` cannot be serialised at all, or ``None`` when it can.

    "At all" means even with the text of values JSON cannot hold (:func:`canonical_json`):
    a cyclic structure, an object whose ``str()`` raises, nesting too deep to encode. A
    value that is merely not JSON (a ``datetime``, a model object) is serialisable.
    """
    if result is None or isinstance(result, str | int | float | bool):
        return None  # the common answers need no trial encoding
    try:
        canonical_json(result)
    except Exception as exc:  # RecursionError included
        return _describe(exc)
    return None


def placeholder(result: Any, reason: str) -> str:
    """The text kept (and shown to the model) instead of a result that cannot be serialised.

    Faithful: it says the tool did return (its effect, if any, happened), that its result
    could not be serialised and why, its type, and as much of its text as ``str()`` gives.
    """
    kind = type(result)
    try:
        text = str(result)
    except Exception as exc:
        shown = f"Its text is unavailable ({_describe(exc)})."
    else:
        if len(text) > _PLACEHOLDER_TEXT_CHARS:
            text = text[:_PLACEHOLDER_TEXT_CHARS] + "…"
        shown = f"Its text: {text}"
    return (
        f"{UNSERIALISABLE}{reason}] The tool returned a {kind.__module__}.{kind.__qualname__} "
        f"that cannot be recorded; the call itself completed. {shown}"
    )


def is_placeholder(value: Any) -> bool:
    """Whether ``value`` is a text made by :func:`placeholder`."""
    return isinstance(value, str) and value.startswith(UNSERIALISABLE)


def result_digest(result: Any) -> str:
    """SHA-256 of a result's canonical JSON (text of values JSON cannot hold).

    Never raises: a result that cannot be serialised is digested as its placeholder.
    """
    try:
        text = canonical_json(result)
    except Exception as exc:
        text = canonical_json(placeholder(result, _describe(exc)))
    return hashlib.sha256(text.encode()).hexdigest()


def brief_value(value: Any, limit: int = DRIFT_VALUE_CHARS) -> Any:
    """``value`` itself when its JSON fits ``limit`` characters, else its truncated text."""
    try:
        if len(json.dumps(value, ensure_ascii=False, allow_nan=False)) <= limit:
            return value
    except (TypeError, ValueError):
        pass
    try:
        text = str(value)
    except Exception as exc:
        text = placeholder(value, _describe(exc))
    return text if len(text) <= limit else text[:limit] + "…"


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str, sort_keys=True)
    return text if len(text) <= 120 else text[:119] + "…"


def _walk(old: Any, new: Any, path: str, out: list[str]) -> None:
    if len(out) > _MAX_LINES:
        return
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for name in sorted(set(old) | set(new), key=str):
            where = f"{path}.{name}" if path else str(name)
            if name not in old:
                out.append(f"{where}: added {_show(new[name])}")
            elif name not in new:
                out.append(f"{where}: removed (was {_show(old[name])})")
            else:
                _walk(old[name], new[name], where, out)
        return
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for index, (a, b) in enumerate(zip(old, new, strict=True)):
            _walk(a, b, f"{path}[{index}]", out)
        return
    if canonical_json(old) != canonical_json(new):
        out.append(f"{path or 'result'}: {_show(old)} → {_show(new)}")


def difference(previous: Any, current: Any) -> list[str]:
    """The differences between two results, one line each (``path: old → new``).

    Mappings and equally long lists are compared member by member; anything else as a
    whole. At most 20 lines; a last line says how many more there were.
    """
    out: list[str] = []
    _walk(previous, current, "", out)
    if len(out) > _MAX_LINES:
        return [*out[:_MAX_LINES], "… more differences not shown"]
    return out


def detect_drift(
    previous: Mapping[str, Any], current: Any, *, comparator: Comparator | None = None
) -> dict[str, Any] | None:
    """Compare a result with the ``tool_succeeded`` payload recorded for the same call.

    Args:
        previous: The earlier event's payload: ``digest`` of the full result, ``result``
            (its truncated text) and, for tools that keep it, ``value`` (the JSON value).
        current: The new result.
        comparator: Decides when the digests differ and the earlier value was kept. A
            comparator that raises counts as "different" (a person looks at it).

    Returns:
        ``None`` when nothing drifted (or the earlier event has no digest to compare
        with), else the drift: ``previous``, ``current``, both digests and ``difference``.
    """
    before = previous.get("digest")
    digest = result_digest(current)
    if not isinstance(before, str) or before == digest:
        return None
    kept = "value" in previous
    old = previous["value"] if kept else previous.get("result")
    if comparator is not None and kept:
        try:
            if comparator(old, current):
                return None
        except Exception:  # a broken comparator must not hide a change: treat it as drift
            pass
    new = brief_value(current)
    # Without the earlier value only its text is known: compare text with text.
    shown_new = new if kept else (current if isinstance(current, str) else _show(current))
    return {
        "previous": old,
        "current": new,
        "previous_digest": before,
        "current_digest": digest,
        "difference": difference(old, shown_new),
    }
