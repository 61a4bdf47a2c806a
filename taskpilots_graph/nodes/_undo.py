"""Undoing one committed effect through the ledger, as an I/O-free generator.

Compensation is a side effect of its own: a compensator that cancels a booking or refunds
a charge reaches a service exactly like the call it undoes, and a crash in its middle
leaves the same question ("did it happen?"). So the undo of the effect recorded under
``key`` runs the ledger protocol of :mod:`taskpilots_graph.engine._protocol` unchanged, under
its own entry:

* key ``undo:<key>``, tool ``undo:<tool>``, the effect's arguments, ``extra["undo_of"]``
  naming the effect; written by the thread whose run performs the undo;
* intent (durable) → ``compensate(key, args, result)`` → commit (durable), then the effect's
  entry becomes ``compensated`` (compare-and-set, with its ``compensated`` event);
* found ``intended`` (a crash inside the compensator) or failed after its request may have
  left: ``side_effect(compensate_precheck=...)`` is asked, ``compensate_precheck(key, args,
  result)`` with the *effect's* key: ``Done`` → the undo is committed with its proof and
  not run again; ``NotDone`` → the compensator runs again under the same undo key;
  ``Unknown``, a broken answer or no pre-check → the undo is ``uncertain`` and a person
  decides (:class:`AskPerson`); the compensator is never run again blindly;
* committed: its recorded result stands and only the effect's mark is (re)written.

A person's answer to an uncertain undo (:data:`UNDO_ACTIONS`): ``retry`` releases it for
exactly one more run of the compensator, ``skip`` leaves the effect in place (not undone,
reported), ``provide_result`` records that the undo happened (manual proof) and marks the
effect compensated.

Inside a graph the person is asked with LangGraph's ``interrupt()``. The node re-runs from
its first line on resume, and ``interrupt()`` hands answers back by their order in the
task, so an undo answered earlier in the same task replays its answers first
(:class:`Replay`, counted on the undo entry per task in ``extra["undo_decisions"]``):
later questions stay aligned with their answers whatever happened in between.

The sync and async drivers (:mod:`taskpilots_graph.nodes.compensate`) carry the requests
out; the agent's compensate node, ``RecoveryMiddleware`` and the coordinator all use them.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal

from taskpilots_graph.engine._call import CallContext, call_context
from taskpilots_graph.engine._protocol import run_call
from taskpilots_graph.engine._requests import ReadEntry, WriteEntry
from taskpilots_graph.engine._takeover import decided_by, decision_recorded, ledger_move
from taskpilots_graph.errors import InvalidDecision, LedgerConflict
from taskpilots_graph.events import EventKind, EventRecord, prepare_event
from taskpilots_graph.ledger import (
    CompensationUncertain,
    LedgerEntry,
    LedgerStatus,
    PrecheckOutcome,
    SideEffectSpec,
    SideEffectUncertain,
)
from taskpilots_graph.takeover import Decision, TakeoverRequest, parse_decision

__all__ = [
    "LEFT_BY_PERSON",
    "UNDO_ACTIONS",
    "UNDO_DECISIONS",
    "UNDO_OF",
    "UNDO_PREFIX",
    "AskPerson",
    "Replay",
    "UndoContext",
    "UndoOutcome",
    "apply_decision",
    "decision_write",
    "is_undo",
    "undo_effect",
    "undo_key",
    "undo_tool",
]

UNDO_PREFIX = "undo:"
"""Prefix of an undo's ledger key and tool name."""

UNDO_OF = "undo_of"
"""Key in an undo entry's ``extra``: the ledger key of the effect it undoes."""

UNDO_DECISIONS = "undo_decisions"
"""Key in an undo entry's ``extra``: ``{task namespace: decisions applied}``."""

LEFT_BY_PERSON = "skipped_by_person"
"""``error["type"]`` of an undo a person chose not to perform: the effect stays in place."""

UNDO_ACTIONS: tuple[str, ...] = ("retry", "skip", "provide_result")
"""The answers to an uncertain undo."""

_SUMMARY = 300


def undo_key(key: str) -> str:
    """The ledger key of the undo of the effect recorded under ``key``."""
    return UNDO_PREFIX + key


def undo_tool(tool: str) -> str:
    """The tool name an undo of ``tool``'s effect is recorded under."""
    return UNDO_PREFIX + tool


def is_undo(entry: LedgerEntry) -> bool:
    """Whether ``entry`` records the undo of another effect (not an effect to undo)."""
    return isinstance(entry.extra.get(UNDO_OF), str)


@dataclass(frozen=True, slots=True)
class AskPerson:
    """An undo of unknown outcome: ``interrupt(payload)`` inside a graph (answered with the
    person's decision, ``event`` recorded when the run pauses on it); elsewhere the driver
    raises ``error``."""

    error: CompensationUncertain
    payload: dict[str, Any]
    event: EventRecord


@dataclass(frozen=True, slots=True)
class Replay:
    """Consume an answer given earlier in this task (``interrupt()`` returns it at once),
    so that the next question gets the next answer."""

    payload: dict[str, Any]


@dataclass(frozen=True, slots=True)
class UndoOutcome:
    """How the undo of one effect ended.

    Attributes:
        effect_key: The ledger key of the effect.
        tool: The effect's tool.
        status: ``undone`` (the effect is ``compensated`` now), ``already`` (it was
            before this call) or ``left`` (a person chose to leave it in place).
        result: What the compensator returned (or the recorded / provided result).
        replayed: The undo was not run by this call: found done by the pre-check,
            recorded before, or confirmed by a person.
    """

    effect_key: str
    tool: str
    status: Literal["undone", "already", "left"]
    result: Any = None
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class UndoContext:
    """One undo to perform.

    Attributes:
        effect: The committed effect's ledger entry.
        spec: The effect's tool declaration (its ``compensate`` is run).
        thread_id: The thread whose run performs the undo (writes the undo entry and its
            events; its lease guards the undo).
        checkpoint_ns: Namespace for the events.
        task: The interrupt scope (the task's checkpoint namespace) when a person can be
            asked inside a graph; ``None`` elsewhere.
        by: Who undoes (``coordinator``...), recorded in the ``compensated`` event.
        goal: The run's goal, for the takeover request.
        committed: Effects still committed (``{"key", "tool"}``), for the takeover request.
    """

    effect: LedgerEntry
    spec: SideEffectSpec
    thread_id: str
    checkpoint_ns: str = ""
    task: str | None = None
    by: str | None = None
    goal: str = ""
    committed: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)

    @property
    def names(self) -> dict[str, Any]:
        """The undo's tool and ledger key, and the effect it undoes (as its events say)."""
        effect = self.effect
        return {"tool": undo_tool(effect.tool), "key": undo_key(effect.key), UNDO_OF: effect.key}

    @property
    def call(self) -> CallContext:
        """The undo as the ledger protocol sees a call."""
        effect = self.effect
        return call_context(
            thread_id=self.thread_id,
            checkpoint_ns=self.checkpoint_ns,
            tool=undo_tool(effect.tool),
            args=effect.args,
            tool_call_id=None,
            spec=_undo_spec(self.spec, effect),
            key=undo_key(effect.key),
            extra={UNDO_OF: effect.key, "effect_tool": effect.tool},  # names what it undoes
        )


def _undo_spec(spec: SideEffectSpec, effect: LedgerEntry) -> SideEffectSpec:
    """The declaration the protocol applies to the undo: the undo pre-check (asked about
    the effect's key and result), never idempotent, never a repeat, the effect's lock."""
    check, key, result = spec.compensate_precheck, effect.key, effect.result

    def precheck(_undo_key: str, args: dict[str, Any]) -> PrecheckOutcome:
        assert check is not None, "asked only with a compensate_precheck"
        return check(key, args, result)

    asked = precheck if check is not None else None
    return SideEffectSpec(
        precheck=asked, repeatable=True, lock=spec.lock, precheck_timeout=spec.precheck_timeout
    )


def _decisions(entry: LedgerEntry, task: str) -> int:
    applied = entry.extra.get(UNDO_DECISIONS)
    return int(applied.get(task, 0)) if isinstance(applied, Mapping) else 0


def _left(entry: LedgerEntry) -> bool:
    return entry.status is LedgerStatus.FAILED and (entry.error or {}).get("type") == LEFT_BY_PERSON


def undo_effect(ctx: UndoContext) -> Generator[Any, Any, UndoOutcome]:
    """The undo of ``ctx.effect`` through the ledger (see the module for the rules).

    Yields the protocol's requests (``ReadEntry``, ``AwaitOwner``, ``WriteEntry``,
    ``WriteEvent``, ``RunPrecheck``, ``RunTool`` for the compensator, ``CheckArgs``, which
    needs no answer: the effect's arguments were checked when it ran) and
    :class:`AskPerson` / :class:`Replay`.

    Raises:
        CompensationUncertain: From the driver, where nobody can be asked.
        InvalidDecision: A person's answer that is not one of :data:`UNDO_ACTIONS`.
        LedgerConflict: Another run moved the undo entry first (nothing ran here).
        Exception: The compensator's own error when it failed without having acted (not
            sent, or its pre-check said ``NotDone``): the undo can run again later.
    """
    effect = ctx.effect
    call = ctx.call
    undo: LedgerEntry | None = None
    if ctx.task is not None or effect.status is not LedgerStatus.COMPENSATED:
        undo = yield ReadEntry(call.key)
    if undo is not None and ctx.task is not None:
        # Even for an effect compensated since: its answers hold their places in the task.
        for _ in range(_decisions(undo, ctx.task)):
            yield Replay(_request(ctx, undo, "answered before"))
    if effect.status is LedgerStatus.COMPENSATED:
        return UndoOutcome(effect.key, effect.tool, "already")
    while True:
        if undo is not None and _left(undo):
            return UndoOutcome(effect.key, effect.tool, "left")
        try:
            outcome = yield from run_call(call)
        except SideEffectUncertain as exc:
            undo = yield ReadEntry(call.key)
            assert undo is not None, "an uncertain undo has its entry"
            moved, event = apply_decision(ctx, undo, (yield from _ask(ctx, undo, exc.reason)))
            yield WriteEntry(moved, (undo.status, undo.attempt), event)
            undo = moved
            continue
        if outcome.error is not None:
            raise outcome.error
        break
    marked = yield from _mark_compensated(ctx)
    status: Literal["undone", "already"] = "undone" if marked else "already"
    return UndoOutcome(effect.key, effect.tool, status, outcome.result, outcome.replayed)


def _request(ctx: UndoContext, undo: LedgerEntry, reason: str) -> dict[str, Any]:
    """The takeover request for an uncertain undo, as JSON (the ``interrupt()`` payload)."""
    effect = ctx.effect
    what = f"{effect.tool} ({effect.key})"
    named = {
        "key": undo.key,
        "tool": undo.tool,
        "args": dict(effect.args),
        UNDO_OF: effect.key,
        "effect_tool": effect.tool,
    }
    request = TakeoverRequest(
        thread_id=ctx.thread_id,
        goal=ctx.goal[:_SUMMARY],
        reason=f"the undo of {what} may or may not have happened: {reason}",
        failure={
            "kind": "side_effect_uncertain",
            "error_type": f"{CompensationUncertain.__module__}.{CompensationUncertain.__name__}",
            "message": f"the compensator of {effect.tool} was interrupted; it was not run again",
            "attempts": undo.attempt,
        },
        committed_effects=[dict(c) for c in ctx.committed],
        uncertain_effects=[named],
        pending=[{"tool_call_id": None, "attempts": undo.attempt, **named}],
        options={
            "retry": f"runs the compensator of {what} once more, under the undo key "
            f"{undo.key} (choose it only if you know the undo did not happen)",
            "skip": f"leaves {what} in place, not undone, and goes on with the other undos",
            "provide_result": f"records that the undo of {what} happened (your result is "
            "kept as its proof) and marks the effect compensated",
        },
    )
    return request.model_dump(mode="json")


def _ask(ctx: UndoContext, undo: LedgerEntry, reason: str) -> Generator[Any, Any, Decision]:
    effect = ctx.effect
    error = CompensationUncertain(
        key=undo.key,
        tool=undo.tool,
        thread_id=ctx.thread_id,
        reason=reason,
        effect_key=effect.key,
        effect_tool=effect.tool,
    )
    event = prepare_event(
        ctx.thread_id,
        EventKind.TAKEOVER_REQUESTED,
        {
            **ctx.names,
            "reason": f"the undo of {effect.tool} may or may not have happened: {reason}",
            "failure_kind": "side_effect_uncertain",
        },
        checkpoint_id=None,
        checkpoint_ns=ctx.checkpoint_ns,
    )
    answer = yield AskPerson(error, _request(ctx, undo, reason), event)
    return parse_decision(answer)


def apply_decision(
    ctx: UndoContext, undo: LedgerEntry, decision: Decision
) -> tuple[LedgerEntry, EventRecord]:
    """The undo entry after a person's decision, and its ``decision_recorded`` event.

    Raises:
        InvalidDecision: For an action that is not one of :data:`UNDO_ACTIONS`.
    """
    if decision.action not in UNDO_ACTIONS:
        raise InvalidDecision(
            f"{decision.action!r} is not an answer to an uncertain undo; choose one of "
            f"{', '.join(UNDO_ACTIONS)}"
        )
    who = decided_by(decision)
    now = datetime.now(UTC)
    extra = dict(undo.extra)
    if ctx.task is not None:
        extra[UNDO_DECISIONS] = {
            **dict(extra.get(UNDO_DECISIONS) or {}),
            ctx.task: _decisions(undo, ctx.task) + 1,
        }
    # As for a step: provide_result commits with a manual proof, retry releases the undo
    # for one more run, skip closes it for good (LEFT_BY_PERSON: the effect stays).
    moved = replace(ledger_move(undo, decision, who, now) or undo, extra=extra)
    event = decision_recorded(ctx.thread_id, ctx.checkpoint_ns, decision, who, [], **ctx.names)
    return moved, event


def _mark_compensated(ctx: UndoContext) -> Generator[Any, Any, bool]:
    """Mark the effect ``compensated`` once its undo is committed (idempotent: a re-run
    after a crash here finds the undo committed and writes only this). False: another run
    marked it first."""
    effect = ctx.effect
    key = undo_key(effect.key)
    after = replace(
        effect,
        status=LedgerStatus.COMPENSATED,
        updated_at=datetime.now(UTC),
        extra={**effect.extra, "undo_key": key},
    )
    payload: dict[str, Any] = {"tool": effect.tool, "key": effect.key, "undo_key": key}
    if ctx.by is not None:
        payload["by"] = ctx.by
    event = prepare_event(
        effect.thread_id,
        EventKind.COMPENSATED,
        payload,
        checkpoint_id=None,
        checkpoint_ns=ctx.checkpoint_ns,
    )
    try:
        yield WriteEntry(after, (LedgerStatus.COMMITTED, effect.attempt), event)
    except LedgerConflict:
        found: LedgerEntry | None = yield ReadEntry(effect.key)
        if found is None or found.status is not LedgerStatus.COMPENSATED:
            raise
        return False
    return True


def decision_write(
    effect: LedgerEntry | None,
    undo: LedgerEntry | None,
    effect_key: str,
    decision: Decision | Mapping[str, Any] | str,
    checkpoint_ns: str,
) -> tuple[LedgerEntry, LedgerEntry, EventRecord]:
    """(the undo entry as read, as it becomes, its event) for a person's answer given outside
    a graph (:func:`~taskpilots_graph.nodes.compensate.decide_compensation`).

    Raises:
        InvalidDecision: The decision does not validate or answers no uncertain undo.
    """
    parsed = parse_decision(decision)
    if effect is None or undo is None or undo.status is not LedgerStatus.UNCERTAIN:
        state = "no undo" if undo is None else f"its undo is {undo.status}"
        raise InvalidDecision(
            f"the undo of {effect_key!r} waits on nobody ({state}); only an uncertain undo "
            "takes a decision"
        )
    ctx = UndoContext(effect, SideEffectSpec(), undo.thread_id, checkpoint_ns)
    return undo, *apply_decision(ctx, undo, parsed)
