"""The resume prompt: the scene of an interrupted task, rebuilt from structured state.

Pure functions. :func:`resume_facts` gathers the four layers (task meta; trajectory of done
steps with key inputs and outputs; to-do and blockers; the latest observation and refreshed
data) from the graph state and the ledger; :func:`build_resume_prompt` writes them in the
chosen language within a size budget. Exact facts are never cut: every uncertain effect, the
pending steps and the latest observation stay; committed effects come next (newest first),
and the trajectory is summarised from the oldest end when the budget runs short.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage

from taskpilots_graph.ledger import LedgerEntry, LedgerStatus
from taskpilots_graph.prompts.templates import TEMPLATES, Language
from taskpilots_graph.state import StepRecord

__all__ = ["DEFAULT_MAX_CHARS", "ResumeFacts", "build_resume_prompt", "resume_facts"]

DEFAULT_MAX_CHARS = 6000
"""About 1,500 tokens."""

_ITEM = 160  # characters of one input or output summary


def _short(value: Any, limit: int = _ITEM) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True, slots=True)
class ResumeFacts:
    """What the resumed model must know, in structured form."""

    goal: str
    done: list[tuple[str, str, str]] = field(default_factory=list)  # tool, inputs, output
    committed: list[tuple[str, str]] = field(default_factory=list)  # tool, key
    uncertain: list[tuple[str, str]] = field(default_factory=list)  # tool, key
    todo: list[tuple[str, str, str]] = field(default_factory=list)  # tool, inputs, status
    blockers: list[str] = field(default_factory=list)
    observation: str = ""
    refreshed: dict[str, str] = field(default_factory=dict)


def resume_facts(
    state: Mapping[str, Any],
    ledger: Sequence[LedgerEntry],
    *,
    refreshed: Mapping[str, Any] | None = None,
) -> ResumeFacts:
    """Gather the resume facts of a thread from its state and ledger entries."""
    messages: Sequence[BaseMessage] = state.get("messages") or []
    steps: Mapping[str, StepRecord] = state.get("steps") or {}
    flow = state.get("flow") or {}
    human = next((m for m in reversed(messages) if isinstance(m, HumanMessage)), None)
    done = [
        (
            str(r.get("using") or r.get("tool")),
            _short(r.get("args") or {}),
            _short(r.get("result") or ""),
        )
        for r in steps.values()
        if r.get("status") == "closed" and not r.get("failure")
    ]
    todo = [
        (
            str(r.get("using") or r.get("tool")),
            _short(r.get("args") or {}),
            str(r.get("status"))
            + (f", {(r.get('failure') or {}).get('kind')}" if r.get("failure") else ""),
        )
        for r in steps.values()
        if r.get("status") != "closed"
    ]
    observation = next((m for m in reversed(messages) if isinstance(m, ToolMessage)), None)
    blockers = [str(flow["reason"])] if flow.get("reason") else []
    return ResumeFacts(
        goal=_short(human.content if human is not None else "", 400),
        done=done,
        committed=[(e.tool, e.key) for e in ledger if e.status is LedgerStatus.COMMITTED],
        uncertain=[(e.tool, e.key) for e in ledger if e.status is LedgerStatus.UNCERTAIN],
        todo=todo,
        blockers=blockers,
        observation=_short(observation.content, 400) if observation is not None else "",
        refreshed={k: _short(v) for k, v in (refreshed or {}).items()},
    )


def build_resume_prompt(
    facts: ResumeFacts,
    *,
    language: Language = "en",
    max_chars: int = DEFAULT_MAX_CHARS,
    acknowledge: bool = False,
) -> str:
    """Write the resume prompt, at most ``max_chars`` long whatever the history's length.

    The budget must leave room for the exact facts (uncertain effects, pending steps,
    blockers, the last observation), which are never cut; ``ResumeContext`` asks for at
    least 1,000 characters.

    Args:
        facts: From :func:`resume_facts`.
        language: ``"en"`` or ``"zh"``.
        max_chars: The budget (roughly 4 characters per token).
        acknowledge: Ask the model to restate the state and its next action first.
    """
    t = TEMPLATES[language]
    pending = t["pending"].format(number=len(facts.done) + 1) if facts.todo else ""
    head = [
        t["header"],
        t["goal"].format(goal=facts.goal),
        t["progress"].format(done=len(facts.done), pending=pending),
    ]
    # Exact facts: always kept.
    exact: list[str] = []
    if facts.uncertain:
        exact.append(t["uncertain_title"])
        exact += [t["uncertain_item"].format(tool=tool, key=key) for tool, key in facts.uncertain]
    if facts.todo:
        exact.append(t["todo_title"])
        exact += [t["todo_item"].format(tool=a, inputs=b, status=c) for a, b, c in facts.todo]
    if facts.blockers:
        exact.append(t["blockers_title"])
        exact += [f"- {_short(b, 300)}" for b in facts.blockers]
    if facts.refreshed:
        exact.append(t["refreshed_title"])
        exact += [t["refreshed_item"].format(name=k, value=v) for k, v in facts.refreshed.items()]
    if facts.observation:
        exact.append(t["observation"].format(observation=facts.observation))
    tail = [t["instruction"]] + ([t["acknowledge"]] if acknowledge else [])

    def size(lines: list[str]) -> int:
        return sum(len(line) + 1 for line in lines)

    budget = max_chars - size(head) - size(exact) - size(tail)
    # Committed effects (newest first) may take two thirds of what is left; the trajectory
    # gets the rest, so both keep at least their summary line.
    committed = _fit(
        [t["committed_item"].format(tool=tool, key=key) for tool, key in reversed(facts.committed)],
        budget * 2 // 3 - len(t["committed_title"]) - 1,
        lambda n: t["committed_more"].format(
            count=n, tools=_counts([tool for tool, _ in facts.committed[:n]])
        ),
    )
    committed_block = [t["committed_title"], *committed] if committed else []
    budget -= size(committed_block) if committed_block else 0
    done_lines = [
        t["done_item"].format(number=i + 1, tool=tool, inputs=inputs, output=output)
        for i, (tool, inputs, output) in enumerate(facts.done)
    ]
    done = list(
        reversed(
            _fit(
                list(reversed(done_lines)),
                budget - len(t["done_title"]) - 1,
                lambda n: t["done_more"].format(
                    count=n, tools=_counts([d[0] for d in facts.done[:n]])
                ),
            )
        )
    )
    done_block = [t["done_title"], *done] if done else []
    # Sections are sized to the budget, so only exact facts alone larger than the budget can
    # exceed it; those are never cut (a person-facing fact must not vanish).
    return "\n".join([*head, *done_block, *committed_block, *exact, *tail])


def _counts(tools: Sequence[str]) -> str:
    return ", ".join(f"{tool} x{n}" for tool, n in Counter(tools).most_common(6))


def _fit(lines: list[str], budget: int, more: Any) -> list[str]:
    """The first lines that fit ``budget``, plus a line summarising the rest if it fits too.

    Never more than ``budget`` characters (newlines counted): lines are dropped, never cut.
    """
    kept: list[str] = []
    used = 0
    for line in lines:
        if used + len(line) + 1 > budget:
            break
        kept.append(line)
        used += len(line) + 1
    else:
        return kept
    # Make room for the summary of what was left out, dropping kept lines if needed.
    while True:
        summary = more(len(lines) - len(kept))
        if used + len(summary) + 1 <= budget:
            return [*kept, summary]
        if not kept:
            return []
        used -= len(kept.pop()) + 1
