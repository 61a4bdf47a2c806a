"""Encoding of ledger entries to rows and back, shared by every backend (I/O free)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from taskpilots_graph.checkpointers._schema import LEDGER, LEDGER_FIELDS, Dialect
from taskpilots_graph.errors import ConfigurationError, CorruptRecordError
from taskpilots_graph.ledger import CommittedEffect, LedgerEntry, LedgerStatus

__all__ = [
    "MAX_RESULT_BYTES",
    "decision_params",
    "dump_json",
    "dump_json_unchecked",
    "entry_params",
    "ledger_list_sql",
    "ledger_write_sql",
    "repeat_params",
    "row_to_committed",
    "row_to_entry",
]

MAX_RESULT_BYTES = 256 * 1024
"""Largest recorded result or proof; bigger tool outputs belong in the artifact store."""

_TABLE = "taskpilots_ledger"


def dump_json_unchecked(value: Any) -> str:
    """The encoding of ledger fields (compact, sorted, strict), without the size check."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def dump_json(value: Any, *, what: str) -> str:
    """Strict JSON for a ledger field, or a :class:`ConfigurationError` naming the field."""
    try:
        text = dump_json_unchecked(value)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"{what} must be JSON-serialisable: {exc}") from exc
    if len(text) > MAX_RESULT_BYTES:
        raise ConfigurationError(f"{what} is {len(text)} bytes, over {MAX_RESULT_BYTES}")
    return text


def _dump_optional(value: Any, what: str) -> str | None:
    return None if value is None else dump_json(value, what=what)


def entry_params(entry: LedgerEntry) -> dict[str, Any]:
    """Named parameters for the ledger ``insert`` statement."""
    return {
        "key": entry.key,
        "thread_id": entry.thread_id,
        "checkpoint_ns": entry.checkpoint_ns,
        "tool": entry.tool,
        "tool_call_id": entry.tool_call_id,
        "status": entry.status.value,
        "attempt": entry.attempt,
        "args": dump_json(dict(entry.args), what="tool arguments"),
        "args_digest": entry.args_digest,
        "result": _dump_optional(entry.result, "tool result"),
        "proof": _dump_optional(entry.proof, "proof"),
        "error": _dump_optional(None if entry.error is None else dict(entry.error), "error"),
        "lock": entry.lock,
        "extra": dump_json(dict(entry.extra), what="extra"),
        "created_at": entry.created_at.timestamp(),
        "updated_at": entry.updated_at.timestamp(),
    }


def row_to_entry(row: Sequence[Any]) -> LedgerEntry:
    """Rebuild an entry from a row in ``LEDGER_FIELDS`` order.

    Raises:
        CorruptRecordError: For an unknown status or a field that is not valid JSON.
    """
    data = dict(zip(LEDGER_FIELDS, row, strict=True))
    key = str(data["key"])
    try:
        status = LedgerStatus(data["status"])
    except ValueError as exc:
        raise CorruptRecordError(
            f"unknown ledger status {data['status']!r}", table=_TABLE, key=key
        ) from exc
    return LedgerEntry(
        key=key,
        thread_id=data["thread_id"],
        checkpoint_ns=data["checkpoint_ns"] or "",
        tool=data["tool"],
        tool_call_id=data["tool_call_id"],
        status=status,
        attempt=int(data["attempt"]),
        args=_load(data["args"], key, "args", mapping=True),
        args_digest=data["args_digest"],
        result=_load(data["result"], key, "result"),
        proof=_load(data["proof"], key, "proof"),
        error=_load(data["error"], key, "error", mapping=True),
        lock=data["lock"],
        extra=_load(data["extra"], key, "extra", mapping=True) or {},
        created_at=_ts(data["created_at"], key),
        updated_at=_ts(data["updated_at"], key),
    )


def row_to_committed(row: Sequence[Any]) -> CommittedEffect:
    """Rebuild the repeat guard's find from a ``LEDGER["repeat"]`` row (the entry's
    columns, then its position in the thread)."""
    *columns, step = row
    return CommittedEffect(row_to_entry(columns), int(step))


def repeat_params(thread_id: str, tool: str, args_digest: str) -> dict[str, Any]:
    """Parameters of the repeat guard's lookup (``LEDGER["repeat"]``)."""
    return {"thread_id": thread_id, "tool": tool, "args_digest": args_digest}


def _load(raw: Any, key: str, column: str, *, mapping: bool = False) -> Any:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise CorruptRecordError(
            f"ledger column {column!r} is not valid JSON: {exc}", table=_TABLE, key=key
        ) from exc
    if mapping and not isinstance(value, Mapping):
        raise CorruptRecordError(
            f"ledger column {column!r} must hold a JSON object", table=_TABLE, key=key
        )
    return value


def _ts(raw: Any, key: str) -> datetime:
    if isinstance(raw, int | float) and not isinstance(raw, bool) and math.isfinite(raw):
        return datetime.fromtimestamp(raw, UTC)
    raise CorruptRecordError(f"ledger timestamp {raw!r} is not a time", table=_TABLE, key=key)


def ledger_write_sql(
    dialect: Dialect, entry: LedgerEntry, expect: tuple[LedgerStatus, int] | None
) -> tuple[str, dict[str, Any]]:
    """The insert (``expect=None``) or compare-and-set update for ``entry``, with params."""
    params = entry_params(entry)
    if expect is None:
        return LEDGER[dialect]["insert"], params
    params["expect_status"], params["expect_attempt"] = expect[0].value, expect[1]
    return LEDGER[dialect]["update"], params


def ledger_list_sql(dialect: Dialect, thread_id: str | None) -> tuple[str, dict[str, Any]]:
    """The listing of one thread's entries, or of all."""
    if thread_id is None:
        return LEDGER[dialect]["all"], {}
    return LEDGER[dialect]["by_thread"], {"thread_id": thread_id}


def decision_params(thread_id: str, checkpoint_ns: str, input_digest: str) -> dict[str, Any]:
    """Parameters of the decision lookup (inserts take ``DecisionRecord.params()``)."""
    return {"thread_id": thread_id, "checkpoint_ns": checkpoint_ns, "input_digest": input_digest}
