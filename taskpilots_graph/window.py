"""The memory window: what the model sees of its conversation (I/O free).

By default the model sees its whole conversation. A :class:`MemoryWindow` is an opt-in
*context budget* in tokens: above it, the oldest model turns (a model message with its tool
calls and their answers, always together) are folded into lines of the system message (the
README's "What the model sees"). Folding is deterministic and calls no model, so a replayed
step sees the same input.

Folding is a view, never a storage trick: the state and its checkpoints keep every message,
so the step budget, the resume prompt and every later model call work from the whole run.
Large single results are bounded separately by :class:`ObservationPolicy` (an artifact plus
a summary).

Threads written by earlier versions, whose window removed turns from the state, carry a
``memory`` channel (:class:`MemoryState`): its lines are still shown to the model
(:func:`earlier_text`) and its counts still reach the resume prompt (:func:`folded_done`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypedDict

from langchain_core.language_models import BaseLanguageModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.messages.utils import count_tokens_approximately
from langchain_core.runnables import Runnable, RunnableBinding

from taskpilots_graph._fold import fold_to_budget, with_system
from taskpilots_graph.compression import (
    DEFAULT_SUMMARY_CHARS,
    DEFAULT_THRESHOLD_BYTES,
    Summarizer,
    check_int,
    structural_summary,
)
from taskpilots_graph.conversation import grew_from
from taskpilots_graph.errors import ConfigurationError

__all__ = [
    "EarlierStep",
    "MemoryState",
    "MemoryWindow",
    "ObservationPolicy",
    "TokenCounter",
    "decisions_this_turn",
    "earlier_text",
    "folded_done",
    "model_input",
    "model_summarizer",
    "model_token_counter",
]

TokenCounter = Callable[[Sequence[BaseMessage]], int]
"""Counts the tokens of a model input (the shape of langchain's ``count_tokens_approximately``
and of ``SummarizationMiddleware(token_counter=...)``)."""


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


_NO_BUDGET = (
    "the model sees its whole conversation unless memory_window=MemoryWindow(max_tokens=N) "
    "sets a context budget; memory_window=None (the default) sets none"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryWindow:
    """A context budget: how the model's view of a long conversation is folded to fit.

    Nothing is folded while the model's input (system prompt, conversation and tool schemas,
    as ``token_counter`` counts them) is at most ``max_tokens``. Above it, the oldest model
    turns are folded, each whole, into one line per tool call in the system message:
    ``- tool({"arg": ...}) -> ok: <outcome>``, followed by ``ledger key: ...`` for a side
    effect, until the input fits. Never folded: the user's messages, the model's answers to
    them, the last ``keep_turns`` turns and a turn with a call still unanswered. When even
    the lines do not fit, the oldest lines become a count per tool; a budget smaller than
    what never folds is exceeded by as little as possible.

    The trade-off: folding keeps long runs within the model's context, at the price of
    detail: a folded result is cut to ``line_chars`` characters, and a model that needs an
    old result verbatim must ask again (``cp.artifact(id)`` holds large ones). The state
    keeps every message either way: the budget changes what one model call sees, never what
    is stored.

    Example:
        >>> window = MemoryWindow(max_tokens=100_000)  # about 3/4 of a 128k-token model

    Attributes:
        max_tokens: The budget of one model input, in tokens.
        keep_turns: The latest model turns never folded (the last observation among them).
        line_chars: Bound on the arguments and on the outcome in a folded line.
        token_counter: Counts a model input; by default the model's own counter
            (``get_num_tokens_from_messages``) where it has one, else langchain's
            ``count_tokens_approximately`` (see :func:`model_token_counter`).
        raw_turns: Removed: the window no longer keeps a number of turns in the state.
        summaries: Removed with ``raw_turns``.

    Raises:
        ConfigurationError: Without ``max_tokens``, with the removed ``raw_turns`` or
            ``summaries``, or for a value out of range.
    """

    max_tokens: int | None = None
    keep_turns: int = 1
    line_chars: int = 160
    token_counter: TokenCounter | None = field(default=None, compare=False)
    raw_turns: None = field(default=None, repr=False, compare=False)
    summaries: None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.raw_turns is not None or self.summaries is not None:
            raise ConfigurationError(
                "MemoryWindow(raw_turns=..., summaries=...) was removed: the window no longer "
                f"trims the state by turns; {_NO_BUDGET}"
            )
        if self.max_tokens is None:
            raise ConfigurationError(f"MemoryWindow needs max_tokens=N: {_NO_BUDGET}")
        check_int("max_tokens", self.max_tokens, 1)
        check_int("keep_turns", self.keep_turns, 1)
        check_int("line_chars", self.line_chars, 20)
        if self.token_counter is not None and not callable(self.token_counter):
            raise ConfigurationError("token_counter must be callable")

    @property
    def budget(self) -> int:
        """``max_tokens``, known to be set once the window is built."""
        assert self.max_tokens is not None
        return self.max_tokens


# -- token counting ---------------------------------------------------------------------------


def _has_own_counter(model: BaseLanguageModel[Any]) -> bool:
    # The base class's counter is a GPT-2 tokenizer (and needs ``transformers``): only an
    # override, or a tokenizer the user gave the model, is the model's own.
    cls = type(model)
    return (
        cls.get_num_tokens_from_messages is not BaseLanguageModel.get_num_tokens_from_messages
        or cls.get_num_tokens is not BaseLanguageModel.get_num_tokens
        or cls.get_token_ids is not BaseLanguageModel.get_token_ids
        or model.custom_get_token_ids is not None
    )


def model_token_counter(model: Any, tools: Sequence[Any] = ()) -> TokenCounter:
    """The token counter of ``model``'s input with ``tools`` bound.

    The model's own ``get_num_tokens_from_messages`` when it has one (a provider's
    tokenizer, or a ``custom_get_token_ids``); otherwise langchain's
    ``count_tokens_approximately`` (about 4 characters per token, 3.3 for Anthropic models,
    scaled by the token usage the provider reported on the latest answer when there is one),
    as ``SummarizationMiddleware`` does. A ``RunnableBinding`` (``model.bind(...)``,
    ``with_config``) is counted as the model it wraps.

    Once the budget folds, a model call counts the whole input once and a few folded
    candidates: a counter that asks the provider over the network (Anthropic's does) makes
    that many requests; give ``MemoryWindow(token_counter=...)`` a local one to avoid them.
    """
    while isinstance(model, RunnableBinding):
        model = model.bound
    tool_list = list(tools)
    if isinstance(model, BaseLanguageModel) and _has_own_counter(model):
        own = model
        if type(own).get_num_tokens_from_messages is BaseLanguageModel.get_num_tokens_from_messages:
            # The base method counts messages with the model's tokenizer but warns about
            # (and skips) tool schemas: add those approximately.
            schemas = count_tokens_approximately([], tools=tool_list) if tool_list else 0
            return lambda messages: own.get_num_tokens_from_messages(list(messages)) + schemas
        return lambda messages: own.get_num_tokens_from_messages(
            list(messages), tools=tool_list or None
        )
    llm_type = str(getattr(model, "_llm_type", ""))
    chars_per_token = 3.3 if llm_type.startswith("anthropic") else 4.0
    # The tool schemas are counted once: converting them is most of a short count's cost,
    # and the fold counts several inputs per model call.
    schemas = (
        count_tokens_approximately([], chars_per_token=chars_per_token, tools=tool_list)
        if tool_list
        else 0
    )
    approximate = partial(
        count_tokens_approximately, chars_per_token=chars_per_token, use_usage_metadata_scaling=True
    )
    return lambda messages: approximate(messages) + schemas


def model_input(
    prompt: str | None,
    memory: MemoryState | None,
    messages: Sequence[BaseMessage],
    window: MemoryWindow | None = None,
    *,
    steps: Mapping[str, Mapping[str, Any]] | None = None,
    count_tokens: TokenCounter | None = None,
) -> list[BaseMessage]:
    """What the model sees: the system prompt (with any folded steps), then the messages.

    Without ``window`` that is the whole conversation. With one, the input is counted
    (``window.token_counter``, else ``count_tokens``, else the approximate count) and, above
    ``window.max_tokens``, folded as :class:`MemoryWindow` describes; ``steps`` (the step
    records by tool-call id) give the folded calls their ledger keys.
    """
    system = "\n\n".join(part for part in (prompt, earlier_text(memory)) if part)
    whole = with_system(system, messages)
    if window is None:
        return whole
    count = window.token_counter or count_tokens or model_token_counter(None)
    total = count(whole)
    if total <= window.budget:
        return whole
    return fold_to_budget(
        system,
        messages,
        total,
        budget=window.budget,
        keep_turns=window.keep_turns,
        line_chars=window.line_chars,
        steps=steps or {},
        count=count,
    )


# -- the memory channel of earlier versions ---------------------------------------------------


class EarlierStep(TypedDict):
    """One tool call that an earlier version's window folded out of the state."""

    tool: str
    args: str
    status: str
    result: str


class MemoryState(TypedDict, total=False):
    """The ``memory`` channel: what an earlier version kept of the turns it removed.

    The window no longer removes messages from the state; threads written before keep this
    channel, and it is read, never written.

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


def _last_user(messages: Sequence[BaseMessage], stop: int = 0) -> int:
    """Index of the user's last message at or after ``stop`` (``-1``: none there)."""
    for index in range(len(messages) - 1, stop - 1, -1):
        message = messages[index]
        if isinstance(message, HumanMessage) and message.name != "taskpilots_resume":
            return index
    return -1


def _decisions(messages: Sequence[BaseMessage]) -> int:
    return sum(1 for m in messages if isinstance(m, AIMessage) and m.tool_calls)


_turn_memo: tuple[list[BaseMessage], int, int] = ([], -1, 0)
"""``(conversation, index of its last user message, decisions since)`` of the last count.

The count runs before every model call over a conversation that only grows (the same
message objects, ``add_messages`` keeps them), so only the new tail is scanned. Replacing
the tuple is atomic; a conversation that does not start with the remembered one is
counted from scratch."""


def _turn(messages: Sequence[BaseMessage]) -> tuple[int, int]:
    global _turn_memo
    known, known_last, known_count = _turn_memo
    n = len(known)
    if n and grew_from(known, messages):
        last = _last_user(messages, n)
        if last < 0:
            last, count = known_last, known_count + _decisions(messages[n:])
        else:
            count = _decisions(messages[last + 1 :])
    else:
        last = _last_user(messages)
        count = _decisions(messages[last + 1 :])
    _turn_memo = (list(messages), last, count)
    return last, count


def decisions_this_turn(
    messages: Sequence[BaseMessage], memory: MemoryState | None
) -> tuple[str | None, int]:
    """``(id of the user's last message, model decisions with tool calls since it)``,
    counting those an earlier version folded out of the state."""
    last, in_view = _turn(messages)
    user = messages[last].id if last >= 0 else None
    folded = (
        int((memory or {}).get("decisions", 0)) if (memory or {}).get("user_turn") == user else 0
    )
    return user, folded + in_view


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
    """The calls an earlier version folded out of the state, as text for the model, or
    ``""`` when there are none."""
    earlier = (memory or {}).get("earlier", [])
    folded = int((memory or {}).get("folded", 0))
    if not earlier and not folded:
        return ""
    lines = ["Earlier steps of this task (summarised; full record in the event log):"]
    if folded:
        lines.append(f"- {folded} earlier tool call(s) not listed")
    lines += [f"- {s['tool']}({s['args']}) -> {s['status']}: {s['result']}" for s in earlier]
    return "\n".join(lines)
