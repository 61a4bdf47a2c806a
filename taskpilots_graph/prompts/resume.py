"""The resume prompt: the scene of an interrupted task, rebuilt from structured state.

Pure functions. :func:`resume_facts` gathers the four layers (task meta; trajectory of done
steps with key inputs and outputs; to-do and blockers; the latest observation and refreshed
data) from the graph state and the ledger; :func:`build_resume_prompt` writes them in the
chosen language within a size budget. Exact facts are never cut: every uncertain effect, the
pending steps and the latest observation stay; committed effects come next (newest first),
and the trajectory is summarised from the oldest end when the budget runs short.

Every finished step counts, including those the memory window folded out of the messages:
the ones it still lists (``memory["earlier"]``) are named like the others, the ones it only
counts (``memory["folded_done"]``, by tool) join the summary line of the oldest steps. The
step count is exact; only names beyond the budget are summarised (per tool).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

from taskpilots_graph.ledger import LedgerEntry, LedgerStatus
from taskpilots_graph.prompts.templates import TEMPLATES, Language
from taskpilots_graph.state import StepRecord
from taskpilots_graph.window import folded_done

__all__ = [
    "DEFAULT_MAX_CHARS",
    "RESUME_NAME",
    "ResumeFacts",
    "build_resume_prompt",
    "conversation_steps",
    "resume_facts",
    "resume_message",
]

RESUME_NAME = "taskpilots_resume"
"""The ``name`` of the messages a resumed run puts in front of the model (never stored)."""


class ResumeSettings(Protocol):
    """How the resume prompt is written (``taskpilots_graph.nodes.think.ResumeContext`` is one)."""

    @property
    def language(self) -> Language: ...
    @property
    def max_chars(self) -> int: ...
    @property
    def refreshers(self) -> Mapping[str, Callable[[Mapping[str, Any]], Any]]: ...
    @property
    def refresh_after(self) -> float: ...
    @property
    def acknowledge(self) -> bool: ...


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
    folded: dict[str, int] = field(default_factory=dict)
    """Finished steps before ``done``, known by tool and count only (the memory window kept
    no more of them): they are counted and come first in the numbering."""


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
    memory = state.get("memory")
    # Oldest first: the steps the window only counts, those it lists, those still in view.
    done = [
        (s["tool"], _short(s["args"]), _short(s["result"]))
        for s in (memory or {}).get("earlier", [])
        if s.get("status") == "ok"
    ] + [
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
        folded={tool: n for tool, n in folded_done(memory).items() if n > 0},
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
    folded = sum(facts.folded.values())
    finished = folded + len(facts.done)
    pending = t["pending"].format(number=finished + 1) if facts.todo else ""
    head = [
        t["header"],
        t["goal"].format(goal=facts.goal),
        t["progress"].format(done=finished, pending=pending),
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
        t["done_item"].format(number=folded + i + 1, tool=tool, inputs=inputs, output=output)
        for i, (tool, inputs, output) in enumerate(facts.done)
    ]
    # The steps known only by count always take the summary line, with the oldest listed
    # steps that do not fit.
    done = list(
        reversed(
            _fit(
                list(reversed(done_lines)),
                budget - len(t["done_title"]) - 1,
                lambda n: t["done_more"].format(
                    count=folded + n, tools=_counts([d[0] for d in facts.done[:n]], facts.folded)
                ),
                always=folded > 0,
            )
        )
    )
    done_block = [t["done_title"], *done] if done else []
    # Sections are sized to the budget, so only exact facts alone larger than the budget can
    # exceed it; those are never cut (a person-facing fact must not vanish).
    return "\n".join([*head, *done_block, *committed_block, *exact, *tail])


def _counts(tools: Sequence[str], counted: Mapping[str, int] | None = None) -> str:
    tally = Counter(counted or {})
    tally.update(tools)
    return ", ".join(f"{tool} x{n}" for tool, n in tally.most_common(6))


def _fit(lines: list[str], budget: int, more: Any, *, always: bool = False) -> list[str]:
    """The first lines that fit ``budget``, plus a line summarising the rest if it fits too.

    With ``always`` the summary line is written even when every line fits (it then
    summarises what ``more`` knows beyond ``lines``). Never more than ``budget`` characters
    (newlines counted): lines are dropped, never cut.
    """
    kept: list[str] = []
    used = 0
    for line in lines:
        if used + len(line) + 1 > budget:
            break
        kept.append(line)
        used += len(line) + 1
    else:
        if not always:
            return kept
    # Make room for the summary of what was left out, dropping kept lines if needed.
    while True:
        summary = more(len(lines) - len(kept))
        if used + len(summary) + 1 <= budget:
            return [*kept, summary]
        if not kept:
            return []
        used -= len(kept.pop()) + 1


def resume_message(
    state: Mapping[str, Any],
    messages: Sequence[BaseMessage],
    ledger: Sequence[LedgerEntry],
    marker: Mapping[str, Any],
    settings: ResumeSettings,
) -> tuple[HumanMessage, list[str]]:
    """The resume prompt of a resumed run, as the message its next model call gets, and the
    refreshers that ran for it (both agent forms give the model this same message).

    A state without the recovery agent's ``steps`` channel (``create_agent``) gets its steps
    from the conversation (:func:`conversation_steps`).

    Args:
        state: The thread's state (the refreshers read it).
        messages: The conversation the model is about to get (tool calls left without an
            answer already closed).
        ledger: The thread's ledger entries.
        marker: The resume marker of the run's config (``age``: how long it was paused).
        settings: Language, budget, refreshers and acknowledgement of the prompt.
    """
    stale = float(marker.get("age") or 0) > settings.refresh_after
    refreshed = {name: fn(state) for name, fn in settings.refreshers.items()} if stale else {}
    view = {**state, "messages": messages}
    if "steps" not in state:
        view["steps"] = conversation_steps(messages)
    facts = resume_facts(view, ledger, refreshed=refreshed)
    prompt = build_resume_prompt(
        facts,
        language=settings.language,
        max_chars=settings.max_chars,
        acknowledge=settings.acknowledge,
    )
    return HumanMessage(prompt, name=RESUME_NAME), sorted(refreshed)


def conversation_steps(messages: Sequence[BaseMessage]) -> dict[str, StepRecord]:
    """The steps of the tool calls answered in ``messages``, in the order of the answers:
    what the recovery agent's ``steps`` channel holds, for a graph that keeps only the
    conversation. An error answer (a failure, a person's skip) is a step that failed."""
    calls = {
        call["id"]: call
        for m in messages
        if isinstance(m, AIMessage)
        for call in m.tool_calls
        if call["id"]
    }
    steps: dict[str, StepRecord] = {}
    for m in messages:
        call = calls.get(m.tool_call_id) if isinstance(m, ToolMessage) else None
        if call is None or not isinstance(m, ToolMessage):
            continue
        failed = m.status == "error"
        steps[m.tool_call_id] = {
            "tool_call_id": m.tool_call_id,
            "tool": call["name"],
            "args": dict(call["args"]),
            "status": "closed",
            "failure": {"message": _short(m.content, 400)} if failed else None,
            "result": str(m.content),
        }
    return steps
