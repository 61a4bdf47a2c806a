"""Replay a run for debugging: the run step by step, read from its event log alone.

:func:`replay` turns a thread's events into :class:`ReplayStep` records: what the model was
given and what it decided, which tool was called with which arguments and what came back,
failures, retries, degradations, takeovers and decisions, resumes. No tool, pre-check or model
is called and no graph is needed: the log is written as execution happens, so it is the
record of what happened.

What the model saw is reconstructed from the log: each model decision lists what was new to
the model since its previous decision (the user's goal, tool results, the resume prompt, a
person's decision). The full prompt is not stored; the log holds the facts that went into it.

Example:
    >>> from taskpilots_graph.replay import replay
    >>> print(replay(cp, "t-1"))  # doctest: +SKIP
    Replay of thread 't-1': 19 steps, 3 tool calls, 2 failures
      1. 18:05:27.252 user    asks: go
      2. 18:05:27.260 model   decides: create_ticket({"ref": "A"})
      ...
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Literal

from langgraph.checkpoint.base import BaseCheckpointSaver

from taskpilots_graph._twins import Steps, asynced, io, synced
from taskpilots_graph.errors import ThreadNotFound
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.reprs import html_view
from taskpilots_graph.threads import recovery_api, root_config

__all__ = ["Actor", "Replay", "ReplayStep", "areplay", "build_replay", "replay"]

Actor = Literal["user", "model", "tool", "engine", "person"]

_TEXT = 200  # characters of a result or message shown in a step's summary


def _short(value: Any, limit: int = _TEXT) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _call(name: Any, args: Any) -> str:
    return f"{name}({_short(args if args is not None else {})})"


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """One step of a replayed run (one event of its log).

    Attributes:
        index: Position in the replay, from 1.
        seq: The event's position in the thread's log.
        at: When it happened.
        kind: The event kind.
        actor: Who acted: ``user``, ``model``, ``tool``, ``engine`` or ``person``.
        summary: One line saying what happened.
        tool: The tool concerned, if any.
        tool_call_id: The model's id for the call, if any.
        args: The call's arguments (for ``tool_invoked`` and ``tool_failed``).
        result: What came back (truncated as logged).
        failure: The classified failure (kind, error type, message).
        attempt: The attempt number under the ledger key.
        key: The ledger / invocation key.
        calls: For a model decision: the tool calls it asked for (name, id, args).
        saw: For a model decision: what was new to the model since its previous decision.
        superseded: A later rewind went back before this step.
        payload: The event's whole payload.
    """

    index: int
    seq: int
    at: datetime
    kind: EventKind
    actor: Actor
    summary: str
    tool: str | None = None
    tool_call_id: str | None = None
    args: Mapping[str, Any] | None = None
    result: str | None = None
    failure: Mapping[str, Any] | None = None
    attempt: int | None = None
    key: str | None = None
    calls: tuple[Mapping[str, Any], ...] = ()
    saw: tuple[str, ...] = ()
    superseded: bool = False
    payload: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def render(self) -> str:
        """The step as one line (plus one indented line per thing the model saw)."""
        at = self.at.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3]
        line = f"{self.index:>4}. {at} {self.actor:<7} {self.summary}"
        if self.superseded:
            line += "  [superseded]"
        return "\n".join([line, *(f"{'':>20}saw: {s}" for s in self.saw)])

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {
            **{f.name: getattr(self, f.name) for f in fields(self)},
            "at": self.at.isoformat(),
            "kind": self.kind.value,
            "args": dict(self.args) if self.args is not None else None,
            "failure": dict(self.failure) if self.failure is not None else None,
            "calls": [dict(c) for c in self.calls],
            "saw": list(self.saw),
            "payload": dict(self.payload),
        }


@dataclass(frozen=True, slots=True)
class Replay:
    """A run reconstructed from its event log.

    Attributes:
        thread_id: The thread replayed.
        steps: Its steps in log order (superseded ones included, flagged).
    """

    thread_id: str
    steps: tuple[ReplayStep, ...] = ()

    @property
    def tool_calls(self) -> tuple[ReplayStep, ...]:
        """The ``tool_invoked`` steps that count: every attempt of every call."""
        return tuple(s for s in self.steps if s.kind is EventKind.TOOL_INVOKED and not s.superseded)

    @property
    def failures(self) -> tuple[ReplayStep, ...]:
        """The ``tool_failed`` and ``model_failed`` steps that count."""
        failed = (EventKind.TOOL_FAILED, EventKind.MODEL_FAILED)
        return tuple(s for s in self.steps if s.kind in failed and not s.superseded)

    def render(self) -> str:
        """A readable text timeline of the run."""
        head = (
            f"Replay of thread {self.thread_id!r}: {len(self.steps)} steps, "
            f"{len(self.tool_calls)} tool calls, {len(self.failures)} failures"
        )
        return "\n".join([head, *(s.render() for s in self.steps)])

    def __str__(self) -> str:
        return self.render()

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {"thread_id": self.thread_id, "steps": [s.as_dict() for s in self.steps]}

    def _repr_html_(self) -> str | None:
        # Drawn by the notebook package once imported (see taskpilots_graph.reprs).
        return html_view(self)


def _failure_text(failure: Mapping[str, Any]) -> str:
    error_type = str(failure.get("error_type") or "Error").rsplit(".", 1)[-1]
    message = _short(failure.get("message") or "", 160)
    return f"{failure.get('kind', 'unknown')} {error_type}" + (f": {message}" if message else "")


def _model_step(p: Mapping[str, Any]) -> str:
    if p.get("replayed"):
        return f"decision replayed from the record ({p.get('tool_calls', 0)} tool calls); not asked"
    if "acknowledgement" in p:
        return f"restates the state: {_short(p['acknowledgement'])}"
    if calls := p.get("tool_calls"):
        return "decides: " + ", ".join(_call(c.get("name"), c.get("args")) for c in calls)
    return f"answers: {_short(p.get('content', ''))}"


def _summary(kind: EventKind, p: Mapping[str, Any]) -> tuple[Actor, str]:
    tool = p.get("using") or p.get("tool")
    attempt = f" (attempt {p['attempt']})" if p.get("attempt") else ""
    if kind is EventKind.AGENT_STARTED:
        return "user", f"asks: {_short(p.get('goal', ''))}"
    if kind is EventKind.LLM_DECIDED:
        return "model", _model_step(p)
    if kind is EventKind.MODEL_FAILED:
        failure = _failure_text(p.get("failure") or {})
        return "model", f"call failed (model {p.get('model')}){attempt}: {failure}"
    if kind is EventKind.TOOL_INVOKED:
        return "tool", f"call {_call(tool, p.get('args'))}{attempt}"
    if kind is EventKind.TOOL_SUCCEEDED:
        return "tool", f"{tool} returned{attempt}: {_short(p.get('result', ''))}"
    if kind is EventKind.TOOL_FAILED:
        sent = "; may have reached the service" if p.get("maybe_sent") else ""
        return "tool", f"{tool} failed{attempt}: {_failure_text(p.get('failure') or {})}{sent}"
    if kind is EventKind.TOOL_SKIPPED:
        return "engine", f"{tool} not called again ({p.get('reason')}); recorded result returned"
    if kind is EventKind.TOOL_PAUSED:
        return "tool", f"{tool} paused on interrupt()"
    if kind is EventKind.STEP_COMPLETED:
        seen = [
            f"{o.get('tool')} {o.get('status')}{' (replayed)' if o.get('replayed') else ''}"
            for o in p.get("observations") or []
        ]
        return "engine", f"observed: {', '.join(seen) or 'nothing'}"
    return _recovery_summary(kind, p, tool)


def _recovery_summary(kind: EventKind, p: Mapping[str, Any], tool: Any) -> tuple[Actor, str]:
    reason = f" ({p['reason']})" if p.get("reason") else ""
    if kind is EventKind.EFFECT_RECONCILED:
        outcome = p.get("outcome")
        proof = f", proof {_short(p['proof'], 80)}" if p.get("proof") is not None else ""
        return "engine", f"pre-check of {tool}: {outcome}{proof}"
    if kind is EventKind.EFFECT_UNCERTAIN:
        return "engine", f"{tool} effect uncertain, not executed again{reason}"
    if kind is EventKind.REPEAT_CAUGHT:
        step = p.get("step")
        return "engine", f"{tool} already done at step {step}: not executed again, result returned"
    if kind is EventKind.RETRY_SCHEDULED:
        due = p.get("retry_at")
        when = datetime.fromtimestamp(due, UTC).isoformat(timespec="seconds") if due else "now"
        return "engine", f"retry of {tool} scheduled for {when}{reason}"
    if kind is EventKind.DEGRADED:
        return "engine", f"{tool} degraded to fallback {p.get('fallback')}{reason}"
    if kind is EventKind.STUCK_DETECTED:
        return "engine", f"stuck loop detected{reason}"
    if kind is EventKind.TAKEOVER_REQUESTED:
        about = f" about {tool}" if tool else ""
        return "engine", f"a person is asked to decide{about}{reason}"
    if kind is EventKind.DECISION_RECORDED:
        decision = p.get("decision") or {}
        note = f": {_short(decision['note'], 80)}" if decision.get("note") else ""
        return "person", f"{p.get('decided_by', 'someone')} decided {decision.get('action')}{note}"
    if kind is EventKind.RUN_RESUMED:
        if "decision" in p:
            return "engine", f"run continued with a person's decision: {p['decision']}"
        return "engine", f"run resumed (next: {', '.join(map(str, p.get('next') or [])) or '-'})"
    if kind is EventKind.RESUME_CONTEXT:
        refreshed = ", ".join(p.get("refreshed") or [])
        extra = f"; refreshed {refreshed}" if refreshed else ""
        return "engine", f"resume prompt given to the model{extra}"
    if kind is EventKind.COMPENSATED:
        if "without_compensator" in p:
            return "engine", f"no compensator for: {', '.join(p['without_compensator'])}"
        return "engine", f"undid {tool} ({p.get('key')})"
    if kind is EventKind.MILESTONE_REACHED:
        return "engine", f"milestone {p.get('name')!r} reached"
    if kind is EventKind.REWOUND:
        return "engine", f"rewound: {_short(dict(p), 160)}"
    if kind is EventKind.AGENT_FINISHED:
        status = p.get("status", "closed")
        detail = _short(p.get("answer") or p.get("reason") or "", 160)
        return "engine", f"run {status}" + (f": {detail}" if detail else "")
    return "engine", f"{kind.value}: {_short(dict(p), 160)}"


def _seen(event: Event) -> list[str]:
    """What this event adds to what the model is given next."""
    p = event.payload
    if event.kind is EventKind.AGENT_STARTED:
        return [f"user: {_short(p.get('goal', ''), 120)}"]
    if event.kind is EventKind.RESUME_CONTEXT:
        return [f"resume prompt: {_short(p.get('context', ''), 120)}"]
    if event.kind is EventKind.DECISION_RECORDED:
        return [f"person: {(p.get('decision') or {}).get('action')}"]
    if event.kind is EventKind.STEP_COMPLETED:
        # Failed attempts go to the recovery router, not to the model: only results count.
        return [
            f"{o.get('tool')} → {_short(o.get('summary', ''), 120)}"
            for o in p.get("observations") or []
            if o.get("status") == "ok"
        ]
    return []


def build_replay(thread_id: str, events: Sequence[Event]) -> Replay:
    """Build the replay of one thread from its events (I/O free)."""
    steps: list[ReplayStep] = []
    pending: list[str] = []
    for index, event in enumerate(events, start=1):
        p = event.payload
        actor, summary = _summary(event.kind, p)
        decision = event.kind is EventKind.LLM_DECIDED
        failure = p.get("failure")
        args = p.get("args")
        steps.append(
            ReplayStep(
                index=index,
                seq=event.seq,
                at=event.ts,
                kind=event.kind,
                actor=actor,
                summary=summary,
                tool=p.get("using") or p.get("tool"),
                tool_call_id=p.get("tool_call_id"),
                args=MappingProxyType(dict(args)) if isinstance(args, Mapping) else None,
                result=p.get("result") if isinstance(p.get("result"), str) else None,
                failure=MappingProxyType(dict(failure)) if isinstance(failure, Mapping) else None,
                attempt=p.get("attempt") if isinstance(p.get("attempt"), int) else None,
                key=p.get("key"),
                calls=tuple(MappingProxyType(dict(c)) for c in p.get("tool_calls") or [])
                if decision and isinstance(p.get("tool_calls"), list)
                else (),
                saw=tuple(pending) if decision and not event.superseded else (),
                superseded=event.superseded,
                payload=event.payload,
            )
        )
        if event.superseded:
            continue
        if decision and "acknowledgement" not in p:
            pending = []
        else:
            pending += _seen(event)
    return Replay(thread_id=thread_id, steps=tuple(steps))


def _replay(checkpointer: BaseCheckpointSaver[Any], thread_id: str) -> Steps[Replay]:
    """Reconstruct a run step by step from its event log, calling no tool and no model.

    Raises:
        ThreadNotFound: If the thread has neither an event nor a checkpoint.
        ConfigurationError: If ``checkpointer`` is not a recovery checkpointer.
        CorruptRecordError: If a stored event cannot be decoded.
    """
    cp = recovery_api(checkpointer)
    events = yield io(cp, "events", thread_id)
    if not events and (yield io(cp, "get_tuple", root_config(thread_id))) is None:
        raise ThreadNotFound(thread_id)
    return build_replay(thread_id, events)


replay = synced(_replay)
areplay = asynced(_replay)
