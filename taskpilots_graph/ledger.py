"""The side-effect ledger: declare effects, derive keys, and decide what a retry may do.

"Record before, reconcile after." Before a side-effecting tool runs, an *intent* is written
durably under an invocation key; after it returns, a *commit* with the result and proof (or a
classified *failure*). When the same key comes round again (a retry, a resume after a crash,
another agent doing the same business operation), the recorded entry decides:

============================  ==============================================================
entry found                   what happens
============================  ==============================================================
(before any entry is read)    the arguments are checked against the tool's schema; rejected
                              arguments fail the call as *not sent* (nothing is written)
none, but the same tool with  repeat guard: return the earlier result with a note ("already
the same canonical arguments  done at step N: ...") and log ``repeat_caught``; the tool is
is committed in the thread    not called (``side_effect(repeatable=True)`` opts out)
none                          intend, then execute
committed / compensated       return the recorded result; the tool is not called
failed, request not sent      execute again with the same key
intended, paused on an        execute again with the same key (the tool is resuming)
interrupt()
intended, or failed after a   ask the pre-check: ``Done`` → commit with its proof, skip;
request may have been sent    ``NotDone`` → execute with the same key; ``Unknown`` or no
                              pre-check → execute only if ``idempotent=True``, otherwise
                              mark ``uncertain`` and stop with :class:`SideEffectUncertain`
uncertain                     stop with :class:`SideEffectUncertain` until a person decides
============================  ==============================================================

"Request not sent" is claimed only when the request cannot have left (README, "What counts
as not sent"): an exception raised from a side-effecting tool's body counts as *possibly
sent* unless its boolean ``maybe_sent`` attribute says otherwise, its type is declared with
``side_effect(not_sent=...)``, or it is a connection error raised before any connection
existed (``ConnectionRefusedError``, ``socket.gaierror``).

A pre-check that raises, or runs longer than ``side_effect(precheck_timeout=...)`` (30 s by
default), answers ``Unknown``; one that returns anything else than ``Done``, ``NotDone`` or
``Unknown`` is broken (:class:`~taskpilots_graph.errors.PrecheckError`) and the effect is
marked ``uncertain`` even for an idempotent tool. A result that cannot be serialised at all
(a cyclic structure, an object whose ``str()`` raises) is committed as a placeholder text that
says so, flagged ``extra["result_unserialisable"]`` (and ``result_reduced``).

Guarantee: *effectively once* for tools with a pre-check or an idempotent service; *at most
once, then a person decides* for the rest.

Undoing a committed effect follows the same rules under its own key, ``undo:<effect key>``
(README, "Undoing an effect"; :mod:`taskpilots_graph.nodes.compensate`). This module is I/O
free; the stores persist entries and :mod:`taskpilots_graph.nodes.executor` drives the protocol.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum, StrEnum
from types import MappingProxyType
from typing import Any

from taskpilots_graph.errors import ConfigurationError, TaskPilotsError

__all__ = [
    "PAUSED",
    "RUNNER",
    "UNDO_PREFIX",
    "CommittedEffect",
    "CompensationUncertain",
    "Done",
    "LedgerEntry",
    "LedgerStatus",
    "NotDone",
    "PrecheckOutcome",
    "SideEffectSpec",
    "SideEffectUncertain",
    "Step",
    "Unknown",
    "args_digest",
    "canonical_json",
    "default_key",
    "next_step",
    "runner_of",
    "step_after_precheck",
    "world_keys",
]


PAUSED = "paused_on_interrupt"
"""Flag in ``LedgerEntry.extra``: the tool raised LangGraph's interrupt while executing."""

RUNNER = "runner"
"""Key in ``LedgerEntry.extra``: the thread whose run last executed the entry, when it is
not the thread that first wrote it (a business key shared by threads or agents)."""


def runner_of(entry: LedgerEntry) -> str:
    """The thread whose run is (or last was) performing ``entry``: while that thread's
    lease is held, an ``intended`` entry is live, not an orphan."""
    runner = entry.extra.get(RUNNER)
    return runner if isinstance(runner, str) and runner else entry.thread_id


class LedgerStatus(StrEnum):
    """Where an effect stands."""

    INTENDED = "intended"
    COMMITTED = "committed"
    FAILED = "failed"
    UNCERTAIN = "uncertain"
    COMPENSATED = "compensated"


@dataclass(frozen=True, slots=True)
class Done:
    """The pre-check found the effect already performed."""

    result: Any = None
    proof: Any = None


@dataclass(frozen=True, slots=True)
class NotDone:
    """The pre-check found no trace of the effect: executing again is safe."""


@dataclass(frozen=True, slots=True)
class Unknown:
    """The pre-check cannot tell whether the effect happened."""

    reason: str = ""


PrecheckOutcome = Done | NotDone | Unknown
Precheck = Callable[[str, dict[str, Any]], PrecheckOutcome]
Compensate = Callable[[str, dict[str, Any], Any], Any]
CompensatePrecheck = Callable[[str, dict[str, Any], Any], PrecheckOutcome]
KeyFn = Callable[[dict[str, Any]], str]
LockFn = Callable[[dict[str, Any]], str]


@dataclass(frozen=True, slots=True)
class SideEffectSpec:
    """How one tool's side effect is made safe to retry (see :func:`side_effect`).

    Attributes:
        precheck: Asks the external system whether the effect with this key happened.
        compensate: Undoes a committed effect (used when a run is abandoned). The undo is
            a side effect of its own and goes through the ledger like one (see
            :mod:`taskpilots_graph.nodes.compensate`).
        compensate_precheck: Asks the external system whether the undo of a committed
            effect happened (``Done``), did not (``NotDone``) or cannot tell (``Unknown``);
            called as ``compensate_precheck(key, args, result)`` with the *effect's* key,
            arguments and recorded result. Without it, an undo interrupted mid-way (a
            crash inside the compensator) stops for a person instead of running again.
        idempotent: The service deduplicates by the invocation key, so re-executing an
            effect of unknown outcome is safe.
        key: Business key function (e.g. ``lambda a: f"refund:{a['order_id']}"``); dedups
            across threads and agents. Default: derived from the tool call.
        lock: Names the business object to lock while the effect runs.
        confirm_drift: High risk for drift: when the same call, run again, returns a
            different result than before, a person confirms it (see
            :mod:`taskpilots_graph.drift`).
        drift_comparator: ``comparator(previous, current) -> bool`` (true: same meaning)
            used instead of comparing digests.
        not_sent: Exception types the tool raises only before its request leaves (its own
            input checks, say): such a failure is retried as "not sent". Anything else
            raised from the tool's body counts as possibly sent, since a reply that fails
            to parse comes back *after* the service acted.
        repeatable: A second call with the same arguments in one thread is a new effect
            (topping up a balance, say), so the repeat guard lets it run. Default: such a
            call returns the earlier call's recorded result instead of executing again.
        precheck_timeout: Seconds the pre-check may take (default 30); past that its
            answer is ``Unknown("pre-check timed out after N s")``, so a non-idempotent
            effect goes to a person. ``None`` waits without limit.
    """

    precheck: Precheck | None = None
    compensate: Compensate | None = None
    idempotent: bool = False
    key: KeyFn | None = None
    lock: LockFn | None = None
    confirm_drift: bool = False
    drift_comparator: Callable[[Any, Any], bool] | None = None
    not_sent: tuple[type[BaseException], ...] = ()
    repeatable: bool = False
    precheck_timeout: float | None = 30.0
    compensate_precheck: CompensatePrecheck | None = None

    def __post_init__(self) -> None:
        for name in (
            "precheck",
            "compensate",
            "key",
            "lock",
            "drift_comparator",
            "compensate_precheck",
        ):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigurationError(
                    f"side_effect({name}=...) must be a callable, got {type(value).__name__}"
                )
        if self.compensate_precheck is not None and self.compensate is None:
            # A question about an undo that nothing performs is a mistake in the declaration.
            raise ConfigurationError(
                "side_effect(compensate_precheck=...) checks the undo of compensate=...; "
                "declare compensate= too, or drop compensate_precheck="
            )
        for name in ("idempotent", "confirm_drift", "repeatable"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"side_effect({name}=...) must be True or False")
        not_sent: object = self.not_sent  # as given, before it is checked
        if isinstance(not_sent, type):
            not_sent = (not_sent,)  # one type on its own, as ``except`` accepts it
        if not isinstance(not_sent, tuple | list) or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in not_sent
        ):
            raise ConfigurationError(
                "side_effect(not_sent=...) must be a tuple of exception types, e.g. "
                f"not_sent=(InvalidAddress,); got {not_sent!r}"
            )
        object.__setattr__(self, "not_sent", tuple(not_sent))
        limit: object = self.precheck_timeout
        if limit is not None:
            if (
                isinstance(limit, bool)
                or not isinstance(limit, int | float)
                or not math.isfinite(limit)
                or limit <= 0
            ):
                raise ConfigurationError(
                    "side_effect(precheck_timeout=...) must be a positive number of seconds "
                    f"or None (no limit); got {limit!r}"
                )
            object.__setattr__(self, "precheck_timeout", float(limit))


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One recorded side effect.

    Attributes:
        key: The invocation key (also passed to the service as its idempotency key).
        thread_id: The thread that first intended the effect.
        tool: Tool name.
        status: Where the effect stands.
        args: The arguments of the call (read-only).
        args_digest: SHA-256 of the canonical arguments.
        attempt: How many times the tool was (or is being) executed under this key.
        tool_call_id: The model's tool-call id, when the call came from a model.
        checkpoint_ns: Namespace of the graph that made the call.
        result: The recorded result (JSON), once committed.
        proof: Evidence from the service or the pre-check (JSON).
        error: The last failure: ``{"type", "message", "maybe_sent"}``.
        lock: The business object locked for the call, if any.
        created_at: When the intent was first recorded.
        updated_at: When the entry last changed.
    """

    key: str
    thread_id: str
    tool: str
    status: LedgerStatus
    args: Mapping[str, Any]
    args_digest: str
    attempt: int
    created_at: datetime
    updated_at: datetime
    tool_call_id: str | None = None
    checkpoint_ns: str = ""
    result: Any = None
    proof: Any = None
    error: Mapping[str, Any] | None = None
    lock: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.args, MappingProxyType):
            object.__setattr__(self, "args", MappingProxyType(dict(self.args)))


@dataclass(frozen=True, slots=True)
class CommittedEffect:
    """An effect already committed in a thread, found by the repeat guard.

    Attributes:
        entry: Its ledger entry.
        step: Its position among the thread's recorded side effects (1 for the first),
            the "step N" of the note the model reads.
    """

    entry: LedgerEntry
    step: int


class SideEffectUncertain(TaskPilotsError):
    """A non-idempotent effect may or may not have happened, and nothing can tell which.

    The run stops instead of re-executing it; a person decides (retry, skip, provide the
    result). The ledger entry is marked ``uncertain``.
    """

    def __init__(self, *, key: str, tool: str, thread_id: str, reason: str) -> None:
        super().__init__(
            f"side effect {tool!r} with key {key!r} may already have happened ({reason}); "
            "it was not executed again. A person must decide: retry, skip or provide the result."
        )
        self.key = key
        self.tool = tool
        self.thread_id = thread_id
        self.reason = reason


class CompensationUncertain(SideEffectUncertain):
    """The undo of a committed effect may or may not have happened, and nothing can tell.

    Raised (or, inside a graph, asked of a person through a takeover) when a compensator
    was interrupted mid-way (a crash, a timeout after its request left) and the tool
    declares no ``compensate_precheck``, or it answered ``Unknown``. The compensator is not
    run again blindly: the undo's own ledger entry (``undo:<effect key>``) is ``uncertain``
    until a person decides ``retry`` (run the compensator once more), ``skip`` (leave the
    effect in place) or ``provide_result`` (the undo happened).

    Attributes:
        key: The undo's ledger key (``undo:<effect_key>``).
        tool: The undo's tool name (``undo:<effect_tool>``).
        thread_id: The thread whose run performs the undo.
        reason: Why nothing can tell.
        effect_key: The ledger key of the committed effect being undone.
        effect_tool: The tool whose effect it is.
    """

    def __init__(
        self,
        *,
        key: str,
        tool: str,
        thread_id: str,
        reason: str,
        effect_key: str,
        effect_tool: str,
    ) -> None:
        super().__init__(key=key, tool=tool, thread_id=thread_id, reason=reason)
        self.args = (
            f"the undo of {effect_tool!r} (effect key {effect_key!r}, undo key {key!r}) may "
            f"already have happened ({reason}); the compensator was not run again. A person "
            "must decide: retry (run it once more), skip (leave the effect in place) or "
            "provide_result (the undo happened).",
        )
        self.effect_key = effect_key
        self.effect_tool = effect_tool


class Step(Enum):
    """What the executor does next for one side-effecting call."""

    EXECUTE = "execute"  # (first time or provably safe) run the tool
    RETURN_RECORDED = "return_recorded"  # committed before: hand back the recorded result
    PRECHECK = "precheck"  # outcome unknown: ask the pre-check
    ESCALATE = "escalate"  # stop with SideEffectUncertain


def next_step(entry: LedgerEntry | None) -> Step:
    """Decide from the recorded entry (or its absence) what happens to a call."""
    if entry is None:
        return Step.EXECUTE
    status = entry.status
    if status in (LedgerStatus.COMMITTED, LedgerStatus.COMPENSATED):
        return Step.RETURN_RECORDED
    if status is LedgerStatus.UNCERTAIN:
        return Step.ESCALATE
    if status is LedgerStatus.FAILED and not (entry.error or {}).get("maybe_sent", True):
        return Step.EXECUTE
    if status is LedgerStatus.INTENDED and entry.extra.get(PAUSED):
        return Step.EXECUTE  # the tool paused on interrupt() and is being resumed
    return Step.PRECHECK  # intended (crashed mid-call) or failed after a possible send


def step_after_precheck(outcome: PrecheckOutcome | None, spec: SideEffectSpec) -> Step:
    """Decide after the pre-check (``None``: the tool has none)."""
    if isinstance(outcome, Done):
        return Step.RETURN_RECORDED
    if isinstance(outcome, NotDone):
        return Step.EXECUTE
    return Step.EXECUTE if spec.idempotent else Step.ESCALATE


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no spaces; non-JSON values fall back to ``str``."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def args_digest(args: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical arguments."""
    return hashlib.sha256(canonical_json(dict(args)).encode()).hexdigest()


def default_key(
    *,
    thread_id: str,
    checkpoint_ns: str,
    tool_call_id: str | None,
    tool: str,
    args: Mapping[str, Any],
) -> str:
    """The invocation key of a call when the tool declares no business key.

    Stable across retries and resume (the tool-call id is checkpointed with the model's
    message), and different after a fork or a new model decision.
    """
    material = canonical_json([thread_id, checkpoint_ns, tool_call_id, tool, dict(args)])
    return f"{tool}:{hashlib.sha256(material.encode()).hexdigest()[:32]}"


UNDO_PREFIX = "undo:"
"""Key prefix of the ledger entry that undoes an effect: ``undo:<effect key>``."""


def world_keys(entries: Iterable[LedgerEntry]) -> set[str]:
    """The keys among ``entries`` that record the world rather than a conversation.

    An entry under a business key (``side_effect(key=...)``) deduplicates across threads
    and agents, so deleting the thread that wrote it must not let another thread perform
    the same effect again; the undo of such an effect (``undo:<business key>``) says the
    world was put back and stays with it. Entries under a default key are the thread's
    own: no other call can ever compute their key.
    """
    entries = list(entries)
    own = {
        entry.key
        for entry in entries
        if entry.key
        == default_key(
            thread_id=entry.thread_id,
            checkpoint_ns=entry.checkpoint_ns,
            tool_call_id=entry.tool_call_id,
            tool=entry.tool,
            args=entry.args,
        )
    }
    kept: set[str] = set()
    for entry in entries:
        effect = entry.key.removeprefix(UNDO_PREFIX)
        if entry.key not in own and (effect == entry.key or effect not in own):
            kept.add(entry.key)
    return kept
