"""What a re-run sub-agent is handed (I/O free): its earlier attempts' committed effects,
kept, and those the coordinator undid.

A re-run continues the sub-agent's own thread, so its conversation and its ledger are still
there: a call repeating a committed effect gets the recorded result (the repeat guard), and
nothing depends on the model remembering. The notice says it in words as well, so a model
reading its messages plans the rest instead of redoing what stands, and redoes what the
coordinator undid.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from langchain_core.messages import HumanMessage

from taskpilots_graph.ledger import LedgerEntry

__all__ = ["NOTICE_NAME", "notice_id", "rerun_input", "rerun_notice"]

NOTICE_NAME: Final = "taskpilots_coordinator"
"""The ``name`` of the user message that hands a re-run its notice."""

_LINES: Final = 20  # effects listed per section; the rest are counted
_ARGS_CHARS: Final = 160
_RESULT_CHARS: Final = 160


def notice_id(thread_id: str, attempt: int) -> str:
    """The id of attempt ``attempt``'s notice: handed twice (after a crash of the
    coordinator), it replaces itself in the conversation instead of appearing twice."""
    return f"{NOTICE_NAME}:{thread_id}:{attempt}"


def _brief(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _lines(entries: Sequence[LedgerEntry], undone: bool) -> list[str]:
    out = []
    for entry in entries[:_LINES]:
        args = _brief(dict(entry.args), _ARGS_CHARS)
        result = _brief(entry.result, _RESULT_CHARS)
        tail = f" (it had returned {result})" if undone else f" -> {result}"
        out.append(f"- {entry.tool} {args}{tail}")
    if len(entries) > _LINES:
        out.append(f"- ... and {len(entries) - _LINES} more")
    return out


def _why(subagent: str, why: Mapping[str, Any], objects: Sequence[str]) -> str:
    failed = str(why.get("subagent") or "")
    where = f" at {why['tool']}" if why.get("tool") else ""
    kind = f" ({why['kind']})" if why.get("kind") else ""
    message = f": {why['message']}" if why.get("message") else ""
    if failed == subagent:
        return f"Your earlier attempt failed{where}{kind}{message}."
    shared = ", ".join(objects) or "shared data"
    return (
        f"Sub-agent {failed!r} failed{where}{kind} after changing {shared}, which you share; "
        "the coordinator undid the effects on it."
    )


def rerun_notice(
    subagent: str,
    *,
    attempt: int,
    max_attempts: int,
    why: Mapping[str, Any],
    kept: Sequence[LedgerEntry],
    undone: Sequence[LedgerEntry],
    objects: Sequence[str] = (),
) -> str:
    """The notice a re-run sub-agent receives.

    Args:
        subagent: The sub-agent running again.
        attempt: This attempt's number.
        max_attempts: Attempts allowed.
        why: The attribution of the failure (``FailureAttribution.payload()``).
        kept: Its committed effects that stand, oldest first.
        undone: Its effects the coordinator undid for this attempt.
        objects: The shared objects whose effects were undone.
    """
    parts = [
        f"The coordinator runs this task again (attempt {attempt} of {max_attempts}). "
        + _why(subagent, why, objects)
    ]
    if kept:
        parts.append(
            "Done by your earlier attempts and kept; do not repeat them (a call with the same "
            "arguments returns its recorded result and is not performed again):\n"
            + "\n".join(_lines(kept, undone=False))
        )
    if undone:
        parts.append(
            "Undone by the coordinator; do them again if the task still needs them:\n"
            + "\n".join(_lines(undone, undone=True))
        )
    parts.append("Continue the original request from where it stands.")
    return "\n\n".join(parts)


def rerun_input(original: Any, notice: str, message_id: str) -> Any:
    """The input of a re-run on the sub-agent's own thread.

    A messages graph (its input has ``messages``) gets the notice as one user message: the
    rest of its state is on the thread already. Any other graph gets its input again; its
    ledger still returns what was committed.
    """
    if isinstance(original, Mapping) and "messages" in original:
        return {"messages": [HumanMessage(notice, id=message_id, name=NOTICE_NAME)]}
    return original
