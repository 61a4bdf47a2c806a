"""What the model may be shown: a conversation in which every tool call is answered.

Providers reject a conversation in which an AI message's tool call has no ``ToolMessage``
before the next human or AI message (OpenAI-compatible APIs answer HTTP 400, and a retry
sends the same invalid body). Both agent forms pass the model's input through
:func:`valid_conversation`; the state itself is left as it is. I/O free.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from operator import is_

from langchain_core.messages import AIMessage, BaseMessage, SystemMessage, ToolCall, ToolMessage

__all__ = ["NO_ANSWER", "close_dangling", "grew_from", "valid_conversation"]

NO_ANSWER = "Error: no answer was recorded for this call; it may not have run."
"""What the model reads for a tool call found without an answer (see
:func:`valid_conversation`)."""


def valid_conversation(messages: Sequence[BaseMessage]) -> list[BaseMessage]:
    """``messages`` with every tool call answered exactly once, before the next message.

    Providers reject a conversation in which an AI message's tool call has no
    ``ToolMessage`` before the next human or AI message (OpenAI-compatible APIs: HTTP 400,
    and a retry sends the same invalid body). A call left open gets :data:`NO_ANSWER` right
    after its last answered sibling; an answer to no open call (a duplicate, or one whose
    call left the conversation) is dropped. A valid conversation is returned unchanged.
    """
    if _answered(messages):
        return list(messages)
    out: list[BaseMessage] = []
    open_calls: dict[str, ToolCall] = {}
    changed = False

    def close() -> None:
        nonlocal changed
        for call_id, call in open_calls.items():
            out.append(
                ToolMessage(
                    content=NO_ANSWER, tool_call_id=call_id, name=call["name"], status="error"
                )
            )
            changed = True
        open_calls.clear()

    for message in messages:
        if isinstance(message, ToolMessage):
            if open_calls.pop(message.tool_call_id, None) is not None:
                out.append(message)
            else:
                changed = True
            continue
        close()
        out.append(message)
        if isinstance(message, AIMessage):
            open_calls = {c["id"] or "": c for c in message.tool_calls}
    close()
    return out if changed else list(messages)


_valid_prefix: list[BaseMessage] = []
"""The longest conversation (after its leading system messages) found valid with no call
open at its end, by message identity.

``add_messages`` keeps earlier messages as the same objects, so the next model call's
conversation starts with it, and only the new tail needs checking: the check stays linear
over a run instead of quadratic. Shared by every thread of the process; replacing the list
is atomic, and a conversation that does not start with it is checked from its start."""


def grew_from(
    known: Sequence[BaseMessage], messages: Sequence[BaseMessage], start: int = 0
) -> bool:
    """Whether ``messages`` from position ``start`` on begins with exactly the message
    objects of ``known`` (an identity pass in C, no message is read; see ``_valid_prefix``)."""
    return len(known) <= len(messages) - start and all(
        map(is_, known, islice(messages, start, None))
    )


def _answered(messages: Sequence[BaseMessage]) -> bool:
    """Whether every tool call is answered exactly once before the next message.

    The model is called with the whole conversation at every step, so this check runs on
    every model call: a pass that builds nothing over the messages not already known valid
    (the repair above runs only when it finds a fault).
    """
    global _valid_prefix
    # A system message (the prompt) is built anew for every call, so the memo covers the
    # conversation after the leading ones: they open no call, and would otherwise make
    # every call re-check the whole conversation.
    head = 0
    while head < len(messages) and isinstance(messages[head], SystemMessage):
        head += 1
    known = _valid_prefix
    start = head + len(known) if grew_from(known, messages, head) else head
    open_ids: set[str] = set()
    balanced = start  # messages[:balanced] is valid with no call open
    for index in range(start, len(messages)):
        message = messages[index]
        if isinstance(message, ToolMessage):
            if message.tool_call_id not in open_ids:
                return False
            open_ids.remove(message.tool_call_id)
            if not open_ids:
                balanced = index + 1
            continue
        if open_ids:
            return False
        if isinstance(message, AIMessage) and message.tool_calls:
            open_ids = {c["id"] or "" for c in message.tool_calls}
            if len(open_ids) != len(message.tool_calls):
                return False  # two calls under one id: the repair keeps the last
        else:
            balanced = index + 1
    if balanced > start:
        _valid_prefix = list(messages[head:balanced])
    return not open_ids


def close_dangling(messages: Sequence[BaseMessage]) -> list[ToolMessage]:
    """Answers for tool calls left without one (a provider rejects such a history)."""
    answered = {m.tool_call_id for m in messages if isinstance(m, ToolMessage)}
    return [
        ToolMessage(
            content="Error: interrupted before an answer; the call may not have run.",
            tool_call_id=call["id"] or "",
            name=call["name"],
            status="error",
        )
        for m in messages
        if isinstance(m, AIMessage)
        for call in m.tool_calls
        if call["id"] not in answered
    ]
