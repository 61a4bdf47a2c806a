"""What the inbox shows, built from what was read (I/O free).

For every pending :class:`~taskpilots_graph.takeover.TakeoverRequest` a :class:`TakeoverView`:
how risky it is, what is known about the effect in question (arguments, ledger key and
status, the pre-check's last answer, how to verify it in the service when the tool says
so), and each option with its consequence in plain words, worked out from the tool's
declaration and the ledger rather than from the request's own one-line summaries: a
``retry`` of an effect that may have happened and that the service does not deduplicate
carries the warning that it may perform it twice, and ``abandon`` lists which committed
effects have an undo and which stay done.

A tool documents how to check its effect in the service with a line of its description
starting with ``Verify:`` (e.g. ``"Verify: search the carrier portal for the order id"``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from langchain_core.tools import BaseTool

from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus, SideEffectSpec
from taskpilots_graph.recovery_map import effect_class
from taskpilots_graph.takeover import TakeoverRequest
from taskpilots_graph.threads import ThreadInfo
from taskpilots_graph.tools import spec_of

__all__ = [
    "Effect",
    "Option",
    "Outcome",
    "Risk",
    "TakeoverView",
    "failed_steps",
    "outcome_of",
    "takeover_view",
    "verify_hint",
]

Risk = Literal["high", "medium", "low"]
RISK_ORDER: Mapping[Risk, int] = {"high": 0, "medium": 1, "low": 2}

TWICE = "may perform it twice"
"""The words of the warning on an option that may repeat an effect nobody can confirm."""

_UNDO = "undo:"
"""Key prefix of the ledger entry of an undo (a compensation is a side effect too): an undo
committed is the effect undone, not one more effect that stays done."""

_VERIFY = re.compile(r"^\s*verify\s*:\s*(?P<how>.+)$", re.IGNORECASE | re.MULTILINE)
_RECONCILED = {
    "done": "done: the service has it (committed from the pre-check's proof)",
    "not_done": "not done: the service has no trace of it",
    "unknown_idempotent": "unknown (the service deduplicates by key)",
}


@dataclass(frozen=True, slots=True)
class Effect:
    """What is known about one effect a takeover is about.

    Attributes:
        tool: The tool.
        key: Its ledger key (also the idempotency key the service was given), if any.
        args: The call's arguments.
        kind: ``read``, ``idempotent``, ``pre-checked`` or ``may become uncertain``.
        status: Its ledger status (``uncertain``, ``failed``, ...) or ``not recorded``.
        attempts: Executions under the key so far.
        precheck: The pre-check's last answer about the key, in words.
        verify: How to check it in the service, from the tool's description, if it says.
        uncertain: It may or may not have happened.
    """

    tool: str
    key: str | None
    args: Mapping[str, Any]
    kind: str
    status: str
    attempts: int
    precheck: str
    verify: str | None
    uncertain: bool


@dataclass(frozen=True, slots=True)
class Option:
    """One answer to a takeover.

    Attributes:
        action: The decision's action.
        consequence: What it does, in plain words.
        warning: What may go wrong with it (shown prominently), if anything.
    """

    action: str
    consequence: str
    warning: str | None = None


@dataclass(frozen=True, slots=True)
class TakeoverView:
    """One pending takeover as the inbox shows it.

    Attributes:
        request: The takeover request.
        tool: The tool of the (first) waiting step.
        tool_call_id: Its call id: every form names it.
        since: When the thread started waiting, if known.
        risk: ``high``, ``medium`` or ``low``.
        risk_why: Why, in words.
        effects: What is known about each effect in question.
        options: The answers, in the request's order.
        undo: Committed effects ``(tool, key)`` that ``abandon`` undoes, newest first.
        stay: Committed effects ``(tool, key)`` without an undo: ``abandon`` leaves them.
    """

    request: TakeoverRequest
    tool: str
    tool_call_id: str | None
    since: datetime | None
    risk: Risk
    risk_why: str
    effects: tuple[Effect, ...]
    options: tuple[Option, ...]
    undo: tuple[tuple[str, str], ...]
    stay: tuple[tuple[str, str], ...]

    @property
    def anchor(self) -> str:
        """The element id of the takeover on its thread page."""
        return f"takeover-{self.request.interrupt_id or 'current'}"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a thread ended, when a person's abandon ended it.

    Attributes:
        label: What the thread page shows as its status (``abandoned``, or the status).
        not_undone: Committed effects ``(tool, key)`` left done (no compensator).
        uncertain: Effects ``(tool, key)`` that may have happened; nothing undid them.
    """

    label: str
    not_undone: tuple[tuple[str, str], ...] = ()
    uncertain: tuple[tuple[str, str], ...] = ()


def verify_hint(tool: BaseTool | None) -> str | None:
    """The ``Verify: ...`` line of a tool's description, if it has one."""
    found = _VERIFY.search(getattr(tool, "description", "") or "") if tool else None
    return found.group("how").strip() if found else None


def _precheck_answer(spec: SideEffectSpec | None, key: str | None, events: Sequence[Event]) -> str:
    if spec is None:
        return "none needed: the tool has no side effect"
    if spec.precheck is None:
        return "none: the tool has no pre-check, nothing can ask the service"
    for event in reversed(events):
        if event.payload.get("key") != key or event.superseded:
            continue
        if event.kind is EventKind.EFFECT_RECONCILED:
            outcome = str(event.payload.get("outcome"))
            return _RECONCILED.get(outcome, outcome)
        if event.kind is EventKind.EFFECT_UNCERTAIN:
            return f"could not tell ({event.payload.get('reason')})"
    return "not asked yet"


def _effect(
    tool: str,
    key: str | None,
    args: Mapping[str, Any],
    tools: Mapping[str, BaseTool],
    entries: Mapping[str, LedgerEntry],
    events: Sequence[Event],
    failure_kind: str | None,
) -> Effect:
    spec = spec_of(tools[tool]) if tool in tools else None
    entry = entries.get(key or "")
    maybe_sent = bool((entry.error or {}).get("maybe_sent")) if entry is not None else False
    uncertain = spec is not None and (
        (entry is not None and entry.status is LedgerStatus.UNCERTAIN)
        or (entry is not None and entry.status is LedgerStatus.FAILED and maybe_sent)
        or (entry is None and failure_kind == "side_effect_uncertain")
    )
    return Effect(
        tool=tool,
        key=key,
        args=dict(args),
        kind=effect_class(spec),
        status=entry.status.value if entry is not None else "not recorded",
        attempts=entry.attempt if entry is not None else 0,
        precheck=_precheck_answer(spec, key, events),
        verify=verify_hint(tools.get(tool)),
        uncertain=uncertain,
    )


def named_effects(pairs: Iterable[tuple[str, str]]) -> str:
    """Effects ``(tool, key)`` as ``tool (key), ...``."""
    return ", ".join(f"{tool} ({key})" for tool, key in pairs)


def _options(
    request: TakeoverRequest,
    first: Effect | None,
    spec: SideEffectSpec | None,
    undo: Sequence[tuple[str, str]],
    stay: Sequence[tuple[str, str]],
) -> list[Option]:
    tool = first.tool if first is not None else "the step"
    key = first.key if first is not None else None
    uncertain = first is not None and first.uncertain
    # Only a service that deduplicates by key makes running an effect of unknown outcome
    # again safe: the pre-check already answered "cannot tell" (or there is none), and a
    # person's retry executes without asking it again.
    repeats = uncertain and spec is not None and not spec.idempotent
    twice = (
        f"{TWICE}: nothing can tell whether {tool} already happened"
        + (f" (the pre-check said: {first.precheck})" if first and spec and spec.precheck else "")
        + (f". Verify first: {first.verify}" if first and first.verify else "")
    )
    words: dict[str, Option] = {}
    if spec is None:
        retry = f"calls {tool} again (it has no side effect)"
    elif spec.idempotent:
        retry = (
            f"calls {tool} again with the same key {key}; the service deduplicates by "
            "that key, so the effect happens at most once"
        )
    else:
        retry = f"calls {tool} again with the same key {key}"
    words["retry"] = Option("retry", retry, twice if repeats else None)
    words["skip"] = Option(
        "skip",
        f"continues without {tool}; the model is told it was skipped",
        f"if {tool} did happen, it stays done and is not undone" if uncertain else None,
    )
    words["provide_result"] = Option(
        "provide_result",
        f"records your result as {tool}'s result"
        + (" (committed in the ledger with a manual proof)" if key else "")
        + f" without calling {tool}, and continues",
    )
    words["edit_args"] = Option(
        "edit_args",
        f"calls {tool} with your arguments, under a new key",
        f"{TWICE}: if the first call happened, this is a second {tool}" if repeats else None,
    )
    undone = f"undoes {named_effects(undo)} (newest first)" if undo else "undoes nothing"
    left = [f"{named_effects(stay)} stay(s) done: no undo is declared"] if stay else []
    if uncertain and first is not None:
        left.append(f"{tool} ({key}) may have happened and is not undone either")
    words["abandon"] = Option(
        "abandon", f"stops the run: {undone}, then closes it", "; ".join(left) or None
    )
    if request.drift is not None:
        # A drifted result is known, not uncertain: the request's own words fit its answers.
        words = {"abandon": words["abandon"]}
    return [words.get(action) or Option(action, text) for action, text in request.options.items()]


def _risk(first: Effect | None, spec: SideEffectSpec | None, drift: bool) -> tuple[Risk, str]:
    if first is not None and first.uncertain and spec is not None and not spec.idempotent:
        return "high", f"{first.tool} may have happened and the service does not deduplicate it"
    if drift:
        return "medium", f"{first.tool if first else 'a tool'} answered differently than before"
    if spec is not None:
        return "medium", f"{first.tool if first else 'the step'} has a side effect"
    return "low", "no side effect waits"


def takeover_view(
    request: TakeoverRequest,
    *,
    tools: Mapping[str, BaseTool],
    ledger: Sequence[LedgerEntry],
    events: Sequence[Event],
    since: datetime | None = None,
) -> TakeoverView:
    """The inbox's view of one pending takeover.

    Args:
        request: The takeover.
        tools: The graph's tools by name (their declarations say what each option does).
        ledger: The thread's ledger, plus the entries of the waiting steps' keys.
        events: The thread's event log.
        since: When the wait began, if the log does not say (the checkpoint's time).
    """
    entries = {e.key: e for e in ledger}
    failure_kind = str((request.failure or {}).get("kind") or "") or None

    def known(step: Mapping[str, Any], kind: str | None) -> Effect:
        tool, key = str(step.get("tool") or ""), step.get("key")
        return _effect(tool, key, step.get("args") or {}, tools, entries, events, kind)

    pending = [known(p, failure_kind) for p in request.pending]
    shown = {e.key for e in pending}
    others = [known(u, None) for u in request.uncertain_effects if u.get("key") not in shown]
    first = pending[0] if pending else None
    spec = spec_of(tools[first.tool]) if first is not None and first.tool in tools else None
    committed = [
        (e.tool, e.key)
        for e in reversed(ledger)
        if e.status is LedgerStatus.COMMITTED
        and e.thread_id == request.thread_id
        and not e.key.startswith(_UNDO)
    ]
    has_undo = {
        name for name, tool in tools.items() if (s := spec_of(tool)) is not None and s.compensate
    }
    undo = tuple(c for c in committed if c[0] in has_undo)
    stay = tuple(c for c in committed if c[0] not in has_undo)
    risk, why = _risk(first, spec, request.drift is not None)
    requested = [
        e.ts for e in events if e.kind is EventKind.TAKEOVER_REQUESTED and not e.superseded
    ]
    return TakeoverView(
        request=request,
        tool=first.tool if first is not None else "",
        tool_call_id=str(request.pending[0].get("tool_call_id")) if request.pending else None,
        since=requested[-1] if requested else since,
        risk=risk,
        risk_why=why,
        effects=tuple(pending + others),
        options=tuple(_options(request, first, spec, undo, stay)),
        undo=undo,
        stay=stay,
    )


def failed_steps(events: Sequence[Event]) -> int:
    """Tool calls that failed at least once (an uncertain effect counts: its call failed)."""
    failed = {
        str(e.payload.get("tool_call_id") or e.payload.get("key") or e.seq)
        for e in events
        if e.kind in (EventKind.TOOL_FAILED, EventKind.EFFECT_UNCERTAIN) and not e.superseded
    }
    return len(failed)


def outcome_of(info: ThreadInfo, events: Sequence[Event], ledger: Sequence[LedgerEntry]) -> Outcome:
    """The status a thread page shows: a run a person abandoned is not shown as a success.

    After an ``abandon`` the run is closed; effects still ``committed`` had no undo and
    stay done, and are named.
    """
    decisions = [e for e in events if e.kind is EventKind.DECISION_RECORDED and not e.superseded]
    last = decisions[-1].payload.get("decision") if decisions else None
    abandoned = isinstance(last, Mapping) and last.get("action") == "abandon"
    if not abandoned or info.status not in ("closed", "failed"):
        return Outcome(info.status)
    own = [e for e in ledger if e.thread_id == info.thread_id]
    return Outcome(
        "abandoned",
        tuple(
            (e.tool, e.key)
            for e in own
            if e.status is LedgerStatus.COMMITTED and not e.key.startswith(_UNDO)
        ),
        tuple((e.tool, e.key) for e in own if e.status is LedgerStatus.UNCERTAIN),
    )
