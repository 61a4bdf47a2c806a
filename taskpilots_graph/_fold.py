"""Folding a model input to a token budget: the algorithm behind ``MemoryWindow`` (I/O free).

A *turn* is a model message with tool calls plus the answers to them; it folds whole (a
provider rejects a call without its answer) into one line per call in the system message.
The user's messages and the model's answers to them are the conversation itself and never
fold. :func:`fold_to_budget` folds the fewest oldest turns that make the input fit, then, if
the lines themselves are too many, reduces the oldest lines to counts per tool.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolCall,
    ToolMessage,
)

__all__ = ["FOLD_HEADER", "fold_to_budget", "with_system"]


def _short(value: Any, limit: int) -> str:
    whole = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    # Whitespace collapses, so the first 2 x limit characters hold all that will be kept.
    text = " ".join(whole[: 2 * limit].split())
    if len(text) <= limit and len(whole) <= 2 * limit:
        return text
    return text[: limit - 1] + "…"


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


def _complete(turn: Sequence[BaseMessage]) -> bool:
    ai = turn[0]
    assert isinstance(ai, AIMessage)
    answered = {m.tool_call_id for m in turn if isinstance(m, ToolMessage)}
    return all(call["id"] in answered for call in ai.tool_calls)


# -- folding to the budget ---------------------------------------------------------------------

FOLD_HEADER = (
    "Earlier steps of this task, folded out of the conversation to fit the context budget "
    "(full record in the event log). Calls marked ok are done: do not repeat them."
)


@dataclass(frozen=True, slots=True)
class _Call:
    """One tool call of a foldable turn, with its answer and step record."""

    call: ToolCall
    answer: ToolMessage
    record: Mapping[str, Any]
    tool: str
    ok: bool

    def text(self, limit: int) -> str:
        """The call's line for the model."""
        # The arguments the model wrote (what it would write again), in JSON it can read.
        text = (
            f"- {self.tool}({_short(self.call['args'], limit)}) -> "
            f"{'ok' if self.ok else 'failed'}: {_short(self.answer.content, limit)}"
        )
        # Further facts go on an indented line, so that a reader of "- tool(args) -> ..."
        # lines (the earlier format) still finds each call on one line.
        facts = []
        using = self.record.get("using")
        if using and using != self.tool:
            facts.append(f"ran {using}")
        if self.record.get("key"):
            facts.append(f"ledger key: {self.record['key']}")
        return text + ("\n  " + "; ".join(facts) if facts else "")

    def size(self, limit: int) -> int:
        """About ``len(self.text(limit))``, without writing it."""
        content = self.answer.content
        answer = len(content) if isinstance(content, str) else limit
        return (
            24
            + len(self.tool)
            + min(limit, len(str(self.call["args"])))
            + min(limit, answer)
            + len(str(self.record.get("key") or ""))
        )


def _calls(turn: Sequence[BaseMessage], steps: Mapping[str, Mapping[str, Any]]) -> list[_Call]:
    ai = turn[0]
    assert isinstance(ai, AIMessage)
    answers = {m.tool_call_id: m for m in turn if isinstance(m, ToolMessage)}
    calls = []
    for call in ai.tool_calls:
        answer = answers[call["id"] or ""]
        record = steps.get(call["id"] or "") or {}
        calls.append(_Call(call, answer, record, call["name"], answer.status != "error"))
    return calls


def _count_text(calls: Sequence[_Call]) -> str:
    by_tool: dict[str, list[int]] = {}
    for call in calls:
        ok_failed = by_tool.setdefault(call.tool, [0, 0])
        ok_failed[0 if call.ok else 1] += 1
    tools = ", ".join(
        f"{tool} " + ", ".join(f"{n} {what}" for n, what in ((ok, "ok"), (failed, "failed")) if n)
        for tool, (ok, failed) in by_tool.items()
    )
    return f"- {len(calls)} earlier tool call(s) not listed\n  by tool: {tools}"


def _chars(message: BaseMessage) -> int:
    """The size of ``message`` for an estimate: its text, tool calls and role."""
    content = message.content
    size = len(content) if isinstance(content, str) else len(repr(content))
    if isinstance(message, AIMessage):
        size += sum(
            len(c["name"]) + len(str(c["args"])) + len(c["id"] or "") for c in message.tool_calls
        )
    return size + 16  # role, ids, the provider's framing


def with_system(system: str, messages: Iterable[BaseMessage]) -> list[BaseMessage]:
    """``messages`` after a system message holding ``system`` (none when it is empty)."""
    # A summary joins the system message rather than a message of its own in the middle of
    # the conversation, which several providers reject.
    return [SystemMessage(system), *messages] if system else list(messages)


class _Fold:
    """Builds the model input with the oldest turns folded; line texts are written once,
    and only for the calls that are listed."""

    def __init__(
        self,
        system: str,
        messages: Sequence[BaseMessage],
        foldable: Sequence[Sequence[BaseMessage]],
        steps: Mapping[str, Mapping[str, Any]],
        limit: int,
    ) -> None:
        self.system = system
        self.messages = messages
        self.limit = limit
        # Turns are runs of consecutive messages: the input with k turns folded is the
        # messages before the end of turn k that belong to no foldable turn, then all
        # messages from there on.
        position = {id(m): i for i, m in enumerate(messages)}
        folding = {id(m) for turn in foldable for m in turn}
        self.ends = [0] + [max(position[id(m)] for m in turn) + 1 for turn in foldable]
        self.stay = [i for i, m in enumerate(messages) if id(m) not in folding]
        self.calls = [_calls(turn, steps) for turn in foldable]
        self.texts: dict[int, str] = {}

    def flat(self, turns: int) -> list[_Call]:
        return [call for group in self.calls[:turns] for call in group]

    def _text(self, call: _Call) -> str:
        key = id(call)
        if key not in self.texts:
            self.texts[key] = call.text(self.limit)
        return self.texts[key]

    def build(self, turns: int, counted: int = 0) -> list[BaseMessage]:
        """The input with the ``turns`` oldest foldable turns folded and the ``counted``
        oldest of their calls reduced to counts."""
        calls = self.flat(turns)
        text = [FOLD_HEADER]
        if counted:
            text.append(_count_text(calls[:counted]))
        text += [self._text(call) for call in calls[counted:]]
        system = "\n\n".join(part for part in (self.system, "\n".join(text)) if part)
        end = self.ends[turns]
        before = [self.messages[i] for i in self.stay[: bisect.bisect_left(self.stay, end)]]
        return with_system(system, [*before, *self.messages[end:]])


def _least(
    estimate: int,
    upper: int,
    tokens: Callable[[int], int],
    budget: int,
    saving: Sequence[float],
    lower: int = 1,
) -> int | None:
    """The least ``k`` in ``lower..upper`` with ``tokens(k) <= budget``, or ``None``.

    ``tokens`` falls as ``k`` grows, and ``saving[k - 1]`` is about what step ``k`` saves.
    From ``estimate``, a few jumps use measured counts (move on until the estimated savings
    cover the excess, or back while the slack allows); gallop and bisection then settle the
    exact answer, so a good guess costs a handful of counts, not a scan.
    """
    measured: dict[int, int] = {}

    def fits(k: int) -> bool:
        if k not in measured:
            measured[k] = tokens(k)
        return measured[k] <= budget

    k = min(max(estimate, lower), upper)
    for _ in range(3):
        fits(k)
        excess: float = measured[k] - budget
        j = k
        if excess > 0:
            while j < upper and excess > 0:
                excess -= saving[j]
                j += 1
        else:
            while j > lower and saving[j - 1] <= -excess:
                excess += saving[j - 1]
                j -= 1
        if j == k:
            break
        k = j
    if fits(k):
        good, step = k, 1
        bad = good - step
        while bad >= lower and fits(bad):
            good, step = bad, step * 2
            bad = good - step
        bad = max(bad, lower - 1)  # below lower: known not to fit
    else:
        bad, step = k, 1
        while True:
            if bad >= upper:
                return None
            good = min(bad + step, upper)
            if fits(good):
                break
            bad, step = good, step * 2
    while good - bad > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def fold_to_budget(
    system: str,
    messages: Sequence[BaseMessage],
    whole: int,
    *,
    budget: int,
    keep_turns: int,
    line_chars: int,
    steps: Mapping[str, Mapping[str, Any]],
    count: Callable[[Sequence[BaseMessage]], int],
) -> list[BaseMessage]:
    """The model input folded until ``count`` finds it within ``budget``: whole turns
    first (all but the last ``keep_turns``), then the oldest lines into counts.

    The least folding that fits is found by counting folded inputs with ``count``, from
    an estimate: each message's and line's size in characters, scaled so that the unfolded
    conversation comes to ``whole`` (less what ``count([])`` gives the tool schemas). The
    model's counter thus runs over the whole conversation once (``whole``), then over a few
    inputs of about the budget's size, never once per message.
    """
    turns = _turns(messages)
    foldable: list[list[BaseMessage]] = []
    for turn in turns[: max(0, len(turns) - keep_turns)]:
        if not _complete(turn):
            break  # keep order: an older turn still open keeps every later one too
        foldable.append(turn)
    if not foldable:
        return with_system(system, messages)
    fold = _Fold(system, messages, foldable, steps, line_chars)
    fixed = count([])  # tool schemas and the like: folding does not change them
    sizes = {id(m): _chars(m) for m in messages}
    lines = [[call.size(line_chars) for call in group] for group in fold.calls]
    chars = sum(sizes.values()) + len(system)
    per_char = (whole - fixed) / chars if chars else 1.0
    # What folding each turn saves, then what counting each line saves, in tokens.
    turn_saving = [
        (sum(sizes[id(m)] for m in turn) - sum(group)) * per_char
        for turn, group in zip(foldable, lines, strict=True)
    ]
    turn_saving[0] -= len(FOLD_HEADER) * per_char
    flat = [size for group in lines for size in group]
    line_saving = [size * per_char for size in flat]
    line_saving[0] -= len(_count_text(fold.calls[0][:1])) * per_char
    inputs: dict[tuple[int, int], list[BaseMessage]] = {}

    def tokens(turns_folded: int, counted: int = 0) -> int:
        inputs[turns_folded, counted] = fold.build(turns_folded, counted)
        return count(inputs[turns_folded, counted])

    every = len(foldable)
    excess: float = whole - budget
    needed = next(
        (k for k, total in enumerate(itertools.accumulate(turn_saving), 1) if total >= excess),
        None,
    )
    # Unless the estimate says that even every line is well over the budget (a long run,
    # where writing each line to find that out would cost more than the fold), look for the
    # fewest turns to fold.
    searched = needed is not None or sum(turn_saving) >= excess - 0.25 * budget
    if searched:
        least = _least(needed or every, every, tokens, budget, turn_saving)
        if least is not None:
            return inputs[least, 0]
    # Every foldable turn is folded and its lines still do not fit: the oldest become counts.
    excess -= sum(turn_saving)
    counted = next(
        (n for n, total in enumerate(itertools.accumulate(line_saving), 1) if total >= excess),
        len(flat),
    )
    # Counting none (every line listed) is a candidate unless the search above tried it.
    least = _least(
        counted, len(flat), lambda n: tokens(every, n), budget, line_saving, lower=int(searched)
    )
    if least is not None:
        return inputs[every, least]
    # Nothing fits: the user's messages and the turns kept whole never fold. Send the
    # smaller input; counting lines can cost more than it saves (a count line for one call).
    counts = inputs[every, len(flat)]
    listed = inputs.get((every, 0))
    return listed if listed is not None and count(listed) <= count(counts) else counts
