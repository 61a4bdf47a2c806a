"""What the model may be shown: a conversation in which every tool call is answered.

Providers reject a conversation in which an AI message's tool call has no ``ToolMessage``
before the next human or AI message (OpenAI-compatible APIs answer HTTP 400, and a retry
sends the same invalid body). Both agent forms pass the model's input through
:func:`valid_conversation`; the state itself is left as it is. I/O free.
"""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.messages import AIMessage, BaseMessage, ToolCall, ToolMessage

__all__ = ["NO_ANSWER", "close_dangling", "valid_conversation"]

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
