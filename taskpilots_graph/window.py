"""The memory window: bounded graph state, rebuilt model input (I/O free).

A conversation that keeps every raw tool result grows with the run, and LangGraph re-stores
the whole ``messages`` channel at every step, so the stored bytes grow quadratically. Here the
state keeps:

* the user's messages and the model's answers to them (never dropped: they are the goal,
  its later changes and what the user was told),
* the last ``raw_turns`` model turns whole (a turn is a model message with tool calls plus
  the answers to them),
* a short structured record of the ``summaries`` turns before those (tool, arguments, outcome),
  and a count of the turns folded away before that.

Older turns leave the state; the event log keeps their full trail once. The model sees the
system prompt with the earlier steps appended, then the kept messages (:func:`model_input`).
Large single results are bounded separately by :class:`ObservationPolicy` (an artifact plus a
summary).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.runnables import Runnable

from taskpilots_graph.compression import (
    DEFAULT_SUMMARY_CHARS,
    DEFAULT_THRESHOLD_BYTES,
    Summarizer,
    structural_summary,
)
from taskpilots_graph.errors import ConfigurationError

__all__ = [
    "EarlierStep",
    "MemoryState",
    "MemoryWindow",
    "ObservationPolicy",
    "Trim",
    "decisions_this_turn",
    "earlier_text",
    "folded_done",
    "model_input",
    "model_summarizer",
    "plan_trim",
]


@dataclass(frozen=True, slots=True)
class ObservationPolicy:
    """How tool results enter the state.

    Results above ``threshold_bytes`` are stored as an artifact (``cp.artifact(id)`` returns
    them byte for byte) and replaced in state, and so for the model, by a summary of at most
    ``summary_chars`` characters plus the artifact id.

    Attributes:
        threshold_bytes: Largest result (UTF-8 bytes) kept whole.
        summary_chars: Bound on a summary's length.
        summarizer: Produces the summary; default
            :func:`~taskpilots_graph.compression.structural_summary` (deterministic, no model).
            A model-based summarizer should be deterministic for the same input, since a
            repeated step must produce the same state.
    """

    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES
    summary_chars: int = DEFAULT_SUMMARY_CHARS
    summarizer: Summarizer | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.threshold_bytes, int) or self.threshold_bytes < 0:
            raise ConfigurationError(
                f"threshold_bytes must be an int >= 0, got {self.threshold_bytes!r}"
            )
        if not isinstance(self.summary_chars, int) or self.summary_chars < 100:
            raise ConfigurationError(
                f"summary_chars must be an int >= 100, got {self.summary_chars!r}"
            )
        if self.summarizer is not None and not callable(self.summarizer):
            raise ConfigurationError("summarizer must be callable")


_SUMMARY_PROMPT = (
    "Summarize this tool result for an agent that will not see it again. Keep ids, numbers, "
    "names, statuses and anything the next steps may need; at most {max_chars} characters."
)


def model_summarizer(
    model: Runnable[LanguageModelInput, BaseMessage],
    *,
    max_input_chars: int = 20_000,
    prompt: str = _SUMMARY_PROMPT,
) -> Callable[..., str]:
    """A :class:`~taskpilots_graph.compression.Summarizer` that asks a chat model.

    The model sees the structural summary followed by the start of the result (at most
    ``max_input_chars``). Use a model at temperature 0: a step replayed after a crash
    summarizes again, and the state should come out the same. A model that fails falls back
    to the structural summary, so a summary never costs the observation.
    """

    def summarize(payload: Any, /, *, max_chars: int) -> str:
        text = payload if isinstance(payload, str) else json.dumps(payload, default=str)
        head = text[:max_input_chars]
        outline = structural_summary(payload, max_chars=max_chars)
        try:
            answer = model.invoke(
                [
                    SystemMessage(prompt.format(max_chars=max_chars)),
                    HumanMessage(f"Outline:\n{outline}\n\nResult (start):\n{head}"),
                ]
            )
        except Exception:
            return outline
        summary = str(answer.content).strip()
        return summary[:max_chars] if summary else outline

    return summarize


@dataclass(frozen=True, slots=True)
class MemoryWindow:
    """How much of the conversation the state keeps.

    Every turn kept whole is stored again with each checkpoint: the default keeps a run of
    1,600 steps with 1 KB results under 25 MB of storage. Raise ``raw_turns`` when the model
    needs more verbatim context.

    Attributes:
        raw_turns: Model turns kept whole (``None``: all of them, the state is unbounded).
        summaries: Earlier turns kept as one structured line each; older ones are counted.
        line_chars: Bound on each part (arguments, outcome) of such a line.
    """

    raw_turns: int | None = 2
    summaries: int = 6
    line_chars: int = 120

    def __post_init__(self) -> None:
        if self.raw_turns is not None and (
            not isinstance(self.raw_turns, int) or self.raw_turns < 1
        ):
            raise ConfigurationError(
                f"raw_turns must be None or an int >= 1, got {self.raw_turns!r}"
            )
        if not isinstance(self.summaries, int) or self.summaries < 0:
            raise ConfigurationError(f"summaries must be an int >= 0, got {self.summaries!r}")
        if not isinstance(self.line_chars, int) or self.line_chars < 20:
            raise ConfigurationError(f"line_chars must be an int >= 20, got {self.line_chars!r}")


class EarlierStep(TypedDict):
    """One tool call of a turn that left the window."""

    tool: str
    args: str
    status: str
    result: str


class MemoryState(TypedDict, total=False):
    """The ``memory`` channel: what remains of the turns that left the window.

    Attributes:
        earlier: The most recent folded calls, oldest first.
        folded: Calls folded away before those (their trail is in the event log).
        folded_done: How many of the ``folded`` calls finished (status ``ok``), by tool:
            the resume prompt counts and names every finished step with it. Missing in
            states written before it existed (see :func:`folded_done`).
        user_turn: Id of the user message the folded decisions below answer.
        decisions: Model decisions folded away since that user message (the step budget
            counts them with those still in view).
    """

    earlier: list[EarlierStep]
    folded: int
    folded_done: dict[str, int]
    user_turn: str | None
    decisions: int


@dataclass(frozen=True, slots=True)
class Trim:
    """What leaves the state after a step.

    Attributes:
        messages: ``RemoveMessage`` updates for the ``messages`` channel.
        steps: Tool-call ids whose step records leave the ``steps`` channel.
        memory: The new value of the ``memory`` channel.
    """

    messages: list[RemoveMessage]
    steps: list[str]
    memory: MemoryState


def _short(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _turns(messages: Sequence[BaseMessage]) -> list[list[BaseMessage]]:
    """Model turns with tool calls, oldest first: the model message with its answers (and
    anything the agent inserted between them). The user's messages and the model's answers
    to them (messages without tool calls) are the conversation itself and stay."""
    turns: list[list[BaseMessage]] = []
    current: list[BaseMessage] | None = None
    for message in messages:
        if isinstance(message, AIMessage) and message.tool_calls:
            current = [message]
            turns.append(current)
        elif isinstance(message, HumanMessage | AIMessage):
            current = None
        elif current is not None:
            current.append(message)
    return turns


def _last_user(messages: Sequence[BaseMessage]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, HumanMessage) and message.name != "taskpilots_resume":
            return index
    return -1


def decisions_this_turn(
    messages: Sequence[BaseMessage], memory: MemoryState | None
) -> tuple[str | None, int]:
    """``(id of the user's last message, model decisions with tool calls since it)``,
    counting those folded out of the window."""
    last = _last_user(messages)
    user = messages[last].id if last >= 0 else None
    in_view = sum(1 for m in messages[last + 1 :] if isinstance(m, AIMessage) and m.tool_calls)
    folded = (
        int((memory or {}).get("decisions", 0)) if (memory or {}).get("user_turn") == user else 0
    )
    return user, folded + in_view


def _complete(turn: Sequence[BaseMessage]) -> bool:
    ai = turn[0]
    assert isinstance(ai, AIMessage)
    answered = {m.tool_call_id for m in turn if isinstance(m, ToolMessage)}
    return all(call["id"] in answered for call in ai.tool_calls)


def plan_trim(
    messages: Sequence[BaseMessage],
    steps: Mapping[str, Mapping[str, Any]],
    memory: MemoryState | None,
    window: MemoryWindow,
) -> Trim | None:
    """The turns that leave the state so that at most ``window.raw_turns`` remain.

    Only complete turns (every call answered) that precede the kept ones leave, each as a
    whole: a provider rejects a tool call without its answer. Returns ``None`` when nothing
    leaves.
    """
    if window.raw_turns is None:
        return None
    turns = _turns(messages)
    excess = len(turns) - window.raw_turns
    if excess <= 0:
        return None
    leaving = []
    for turn in turns[:excess]:
        if not _complete(turn):
            break  # keep order: an older turn still open keeps every later one too
        leaving.append(turn)
    if not leaving:
        return None
    earlier = list((memory or {}).get("earlier", []))
    folded = int((memory or {}).get("folded", 0))
    last = _last_user(messages)
    this_turn = {id(m) for m in messages[last + 1 :]}
    user, _ = decisions_this_turn(messages, None)
    decisions = int((memory or {}).get("decisions", 0))
    if (memory or {}).get("user_turn") != user:
        decisions = 0
    decisions += sum(1 for turn in leaving if id(turn[0]) in this_turn)
    removed: list[RemoveMessage] = []
    step_ids: list[str] = []
    for turn in leaving:
        for message in turn:
            if message.id:
                removed.append(RemoveMessage(id=message.id))
            if isinstance(message, ToolMessage):
                record = steps.get(message.tool_call_id) or {}
                step_ids.append(message.tool_call_id)
                earlier.append(_earlier(message, record, window.line_chars))
    overflow = max(0, len(earlier) - window.summaries)
    done = folded_done(memory)
    for step in earlier[:overflow]:
        if step["status"] == "ok":
            done[step["tool"]] = done.get(step["tool"], 0) + 1
    return Trim(
        messages=removed,
        steps=[s for s in step_ids if s in steps],
        memory={
            "earlier": earlier[overflow:],
            "folded": folded + overflow,
            "folded_done": done,
            "user_turn": user,
            "decisions": decisions,
        },
    )


def _earlier(message: ToolMessage, record: Mapping[str, Any], limit: int) -> EarlierStep:
    status = "failed" if message.status == "error" else "ok"
    return EarlierStep(
        tool=str(record.get("using") or message.name or record.get("tool") or "?"),
        args=_short(record.get("args") or {}, limit),
        status=status,
        result=_short(message.content, limit),
    )


def folded_done(memory: MemoryState | None) -> dict[str, int]:
    """The finished calls among those folded beyond ``earlier``, by tool (a new dict).

    A state written before ``folded_done`` existed counts each of its ``folded`` calls as
    finished, under the tool name ``"?"``: it did not record which of them failed.
    """
    memory = memory or {}
    if "folded_done" in memory:
        return dict(memory["folded_done"])
    folded = int(memory.get("folded", 0))
    return {"?": folded} if folded else {}


def earlier_text(memory: MemoryState | None) -> str:
    """The folded turns as text for the model, or ``""`` when there are none."""
    earlier = (memory or {}).get("earlier", [])
    folded = int((memory or {}).get("folded", 0))
    if not earlier and not folded:
        return ""
    lines = ["Earlier steps of this task (summarised; full record in the event log):"]
    if folded:
        lines.append(f"- {folded} earlier tool call(s) not listed")
    lines += [f"- {s['tool']}({s['args']}) -> {s['status']}: {s['result']}" for s in earlier]
    return "\n".join(lines)


def model_input(
    prompt: str | None, memory: MemoryState | None, messages: Sequence[BaseMessage]
) -> list[BaseMessage]:
    """What the model sees: the system prompt with the earlier steps, then the messages.

    The earlier steps join the system message rather than a message of their own in the
    middle of the conversation, which several providers reject.
    """
    system = "\n\n".join(part for part in (prompt, earlier_text(memory)) if part)
    return [SystemMessage(system), *messages] if system else list(messages)
