"""Compensation: undo committed side effects through the ledger, newest first.

Undoing is a side effect too, so it gets the ledger's guarantee: each undo is written as an
intent under its own key ``undo:<effect key>`` before the compensator runs and committed
after, and only then is the effect's entry marked ``compensated`` (rules in
:mod:`taskpilots_graph.nodes._undo`). A process killed inside a compensator leaves the
undo ``intended``; whoever compensates next asks ``side_effect(compensate_precheck=...)``
(``Done``: recorded, not run again; ``NotDone``: run again under the same undo key) or,
without an answer, stops for a person with :class:`~taskpilots_graph.ledger.
CompensationUncertain` named in the takeover request. Compensated exactly once holds for a
non-idempotent compensator with an undo pre-check; without one, at most once, then a
person decides.

One piece of code serves every caller:

* :func:`compensate_effect` / :func:`acompensate_effect`: undo one committed effect (the
  entry point of the coordinator, which undoes shared work of a failed sub-agent);
* :func:`compensate_thread` / :func:`acompensate_thread`: every committed effect of a
  thread whose tool declares ``compensate=``, newest first (``RecoveryMiddleware`` on
  abandon or ``on_exhausted="compensate"``, and :class:`CompensateNode`);
* :class:`CompensateNode`: the recovery agent's node after a person abandons the run.

Inside a graph (``ask=True``) an uncertain undo pauses the run on ``interrupt()`` with a
:class:`~taskpilots_graph.TakeoverRequest`, answered with ``tp.decide(graph, thread_id,
tp.Decision(action=...))``: ``retry``, ``skip`` or ``provide_result``. Elsewhere it raises
:class:`~taskpilots_graph.ledger.CompensationUncertain`; :func:`decide_compensation`
records the person's answer, and the next call goes on from it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.errors import GraphBubbleUp
from langgraph.types import interrupt

from taskpilots_graph._twins import Steps, asynced, both, io, synced
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.engine import AsyncDriver, Driver
from taskpilots_graph.engine._requests import RunTool
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import EventKind, EventRecord
from taskpilots_graph.leases import LeaseBackend
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus, SideEffectSpec
from taskpilots_graph.locks import adefault_lease_backend, default_lease_backend
from taskpilots_graph.nodes._context import run_context
from taskpilots_graph.nodes._undo import (
    AskPerson,
    Replay,
    UndoContext,
    UndoOutcome,
    decision_write,
    undo_effect,
    undo_key,
)
from taskpilots_graph.nodes._undo_thread import CompensationReport, plan_thread, report_of
from taskpilots_graph.nodes.executor import RecoveryExecutor
from taskpilots_graph.nodes.takeover import ABANDONED, run_goal
from taskpilots_graph.takeover import Decision

__all__ = [
    "ABANDONED",
    "CompensateNode",
    "CompensationReport",
    "UndoOutcome",
    "acompensate_effect",
    "acompensate_thread",
    "adecide_compensation",
    "compensate_effect",
    "compensate_thread",
    "decide_compensation",
]


def _context(
    effect: LedgerEntry,
    spec: SideEffectSpec,
    thread_id: str | None,
    checkpoint_ns: str,
    ask: bool,
    by: str | None,
    goal: str,
    committed: Sequence[Mapping[str, Any]],
) -> tuple[UndoContext, Callable[[], Any]]:
    """The undo to perform, and its compensator's call: ``compensate(key, args, result)``
    with the *effect's* key, arguments and recorded result (``current_invocation()`` names
    the undo)."""
    compensate = spec.compensate
    if compensate is None:
        raise ConfigurationError(f"tool {effect.tool!r} declares no compensate=; nothing undoes it")
    if effect.status not in (LedgerStatus.COMMITTED, LedgerStatus.COMPENSATED):
        raise ConfigurationError(
            f"only a committed effect can be compensated; {effect.key!r} is {effect.status}"
        )
    task = None  # the running task's namespace, which scopes its interrupt() answers
    if ask:
        try:
            conf = get_config().get("configurable") or {}
        except RuntimeError as exc:  # not inside a LangGraph run: nobody can be asked here
            raise ConfigurationError(
                "compensation with ask=True must run inside a graph node or tool (it asks a "
                "person with interrupt()); elsewhere use ask=False and decide_compensation()"
            ) from exc
        task = str(conf.get("checkpoint_ns") or "")
    ctx = UndoContext(
        effect=effect,
        spec=spec,
        thread_id=thread_id or effect.thread_id,
        checkpoint_ns=checkpoint_ns,
        task=task,
        by=by,
        goal=goal,
        committed=tuple(committed),
    )
    return ctx, lambda: compensate(effect.key, dict(effect.args), effect.result)


def _sync_only(answer: Any, tool: str) -> Any:
    if not inspect.isawaitable(answer):
        return answer
    close = getattr(answer, "close", None)
    if callable(close):
        close()  # never awaited: say so instead of a "never awaited" warning
    error = ConfigurationError(
        f"the compensator of {tool!r} is a coroutine function; run the graph with "
        "ainvoke / astream (or call acompensate_effect)"
    )
    # A mistake of the declaration, raised before anything was sent: never "uncertain".
    error.maybe_sent = False  # type: ignore[attr-defined]
    raise error


def _person(req: AskPerson | Replay, ctx: UndoContext, pending: list[EventRecord]) -> Any:
    """Ask (or replay an answer) with ``interrupt()``; where nobody can be asked, raises the
    typed error (the driver throws it into the generator). An unanswered question pauses
    the run (``GraphBubbleUp``)."""
    if ctx.task is None:
        assert isinstance(req, AskPerson), "answers are replayed only inside a graph"
        raise req.error
    try:
        return interrupt(req.payload)
    except GraphBubbleUp:
        if isinstance(req, AskPerson):
            pending.append(req.event)  # the run pauses: the question is on record
        raise


def _driver(
    cp: RecoveryAPI,
    ctx: UndoContext,
    run: Callable[[], Any],
    leases: LeaseBackend | None,
    ttl: float,
) -> Driver:
    """The sync driver of an undo (a coroutine compensator is refused)."""
    driver = Driver(
        cp,
        ctx.thread_id,
        lambda: leases if leases is not None else default_lease_backend(cp),
        ttl,
        lambda _: _sync_only(run(), ctx.effect.tool),
        other=lambda req: _person(req, ctx, driver.pending),
    )
    return driver


def _adriver(
    cp: RecoveryAPI,
    ctx: UndoContext,
    run: Callable[[], Any],
    leases: LeaseBackend | None,
    ttl: float,
) -> AsyncDriver:
    """The async driver of an undo (the compensator and its pre-check may be coroutines)."""

    async def backend() -> LeaseBackend:
        return leases if leases is not None else await adefault_lease_backend(cp)

    async def run_tool(_: RunTool) -> Any:
        value = run()
        return (await value) if inspect.isawaitable(value) else value

    async def other(req: AskPerson | Replay) -> Any:
        return _person(req, ctx, driver.pending)

    driver = AsyncDriver(cp, ctx.thread_id, backend, ttl, run_tool, other=other)
    return driver


def _compensate_effect(
    cp: RecoveryAPI,
    effect: LedgerEntry,
    spec: SideEffectSpec,
    *,
    thread_id: str | None = None,
    checkpoint_ns: str = "",
    by: str | None = None,
    ask: bool = False,
    leases: LeaseBackend | None = None,
    lease_ttl: float = 30.0,
    goal: str = "",
    committed: Sequence[Mapping[str, Any]] = (),
) -> Steps[UndoOutcome]:
    """Undo one committed effect through the ledger, exactly once (see the module).

    Safe to call again after any crash, in any process: a committed undo is not run again,
    an interrupted one is reconciled with ``spec.compensate_precheck``. The async form,
    ``acompensate_effect``, also takes a compensator and an undo pre-check that are
    coroutine functions.

    Example:
        >>> from taskpilots_graph.tools import spec_of
        >>> entry = cp.ledger_entry(key)  # doctest: +SKIP
        >>> compensate_effect(cp, entry, spec_of(tool), thread_id=parent, by="coordinator")
        ... # doctest: +SKIP

    Args:
        cp: The recovery checkpointer holding the effect's ledger entry.
        effect: The effect's entry (``committed``; one found ``compensated`` is left).
        spec: The effect's tool declaration (``taskpilots_graph.tools.spec_of(tool)``),
            with ``compensate=``.
        thread_id: The thread whose run performs the undo: its ledger holds the undo entry
            and its log the undo's events; an intent of it is waited for while that
            thread's lease is held elsewhere. Default: the effect's thread.
        checkpoint_ns: Namespace recorded with the events.
        by: Who undoes (recorded in the ``compensated`` event), e.g. ``"coordinator"``.
        ask: Inside a graph node or tool: ask a person about an uncertain undo with
            ``interrupt()`` instead of raising.
        leases: Lease backend of the thread leases and business locks (default: the
            checkpointer's own database).
        lease_ttl: TTL of a business lock taken for the undo, and the longest wait for
            another runner's live undo intent.
        goal: The run's goal, shown to the person.
        committed: Effects still committed (``{"key", "tool"}``), shown to the person.

    Returns:
        How the undo ended (``undone``, ``already``, or ``left`` by a person).

    Raises:
        CompensationUncertain: ``ask=False`` and nothing can tell whether the undo
            happened; answer with :func:`decide_compensation`, then call again.
        ConfigurationError: The tool declares no compensator, or the effect is not
            committed.
        LedgerConflict: Another run moved the undo first; nothing ran here.
        EffectInProgress: Another live runner is performing this undo.
        Exception: The compensator's own error when it failed before acting (the undo can
            run again later).
    """
    ctx, run = _context(effect, spec, thread_id, checkpoint_ns, ask, by, goal, committed)
    driver = yield both(_driver, _adriver, cp, ctx, run, leases, lease_ttl)
    try:
        outcome: UndoOutcome = yield both(driver.drive, driver.drive, undo_effect(ctx))
    except BaseException:
        yield io(cp, "append_records", driver.pending, flush=ctx.thread_id)
        raise
    if driver.pending:
        yield io(cp, "append_records", driver.pending)
    return outcome


compensate_effect = synced(_compensate_effect)
acompensate_effect = asynced(_compensate_effect)


def _compensate_thread(
    cp: RecoveryAPI,
    thread_id: str,
    tools: Mapping[str, BaseTool],
    *,
    checkpoint_ns: str = "",
    ask: bool = False,
    by: str | None = None,
    leases: LeaseBackend | None = None,
    lease_ttl: float = 30.0,
    goal: str = "",
) -> Steps[CompensationReport]:
    """Undo the thread's committed effects whose tool declares ``compensate=``, newest
    first, each through :func:`compensate_effect`; the keys of those without a compensator
    are logged in one ``compensated`` event (``without_compensator``), for a person.

    Stops at the first undo of unknown outcome (a person decides before older effects are
    undone). Arguments as for :func:`compensate_effect`; ``tools`` by name.
    """
    todo, missing, committed = plan_thread((yield io(cp, "ledger", thread_id)), tools)
    options: dict[str, Any] = {
        **{"thread_id": thread_id, "checkpoint_ns": checkpoint_ns, "ask": ask, "by": by},
        **{"leases": leases, "lease_ttl": lease_ttl, "goal": goal, "committed": committed},
    }
    outcomes = []
    for entry, spec in todo:
        undo = both(compensate_effect, acompensate_effect, cp, entry, spec, **options)
        outcomes.append((yield undo))
    if missing:
        event = (thread_id, EventKind.COMPENSATED, {"without_compensator": missing})
        yield io(cp, "append_event", *event, checkpoint_ns=checkpoint_ns)
    return report_of(outcomes, missing)


compensate_thread = synced(_compensate_thread)
acompensate_thread = asynced(_compensate_thread)


def _decide_compensation(
    cp: RecoveryAPI,
    effect_key: str,
    decision: Decision | Mapping[str, Any] | str,
    *,
    checkpoint_ns: str = "",
) -> Steps[LedgerEntry]:
    """Record a person's answer to an uncertain undo raised outside a graph.

    ``retry`` releases the undo for one more run of the compensator, ``skip`` leaves the
    effect in place, ``provide_result`` records that the undo happened (manual proof).
    Call :func:`compensate_effect` again afterwards to go on (for ``provide_result`` it
    marks the effect compensated without running anything).

    Args:
        cp: The recovery checkpointer.
        effect_key: The ledger key of the effect whose undo is uncertain
            (``CompensationUncertain.effect_key``).
        decision: A ``tp.Decision``, a dict or an action name.
        checkpoint_ns: Namespace recorded with the ``decision_recorded`` event.

    Returns:
        The undo's ledger entry after the decision.

    Raises:
        InvalidDecision: The decision does not validate, is not retry / skip /
            provide_result, or the undo is not uncertain (nothing waits on a person).
        LedgerConflict: Another run moved the undo first; nothing was written.
    """
    undo = yield io(cp, "ledger_entry", undo_key(effect_key))
    effect = yield io(cp, "ledger_entry", effect_key)
    before, moved, event = decision_write(effect, undo, effect_key, decision, checkpoint_ns)
    yield io(cp, "write_ledger", moved, expect=(before.status, before.attempt), events=[event])
    return moved


decide_compensation = synced(_decide_compensation)
adecide_compensation = asynced(_decide_compensation)


class CompensateNode:
    """Undoes the thread's committed effects newest first, each through the ledger.

    An undo of unknown outcome pauses the run on a takeover naming it (``undo:<key>``);
    the node runs again from its first line once a person answers, and every undo already
    committed is recognised from the ledger, never repeated.
    """

    def __init__(self, executor: RecoveryExecutor, *, checkpointer: RecoveryAPI) -> None:
        self.executor = executor
        self.checkpointer = checkpointer

    @staticmethod
    def _summary(state: Mapping[str, Any], report: CompensationReport) -> dict[str, Any]:
        reason = (state.get("flow") or {}).get("reason") or "failed"
        stage = "closed" if reason == ABANDONED else "failed"
        note = ""
        if report.missing:
            note += f"; not undone (no compensator): {', '.join(report.missing)}"
        if report.left:
            note += f"; left in place by a person: {', '.join(report.left)}"
        return {"flow": {"stage": stage, "reason": reason + note}}

    def _options(self, state: Mapping[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """The arguments of ``compensate_thread`` for this run."""
        ctx, executor = run_context(config), self.executor
        return {
            **{"cp": self.checkpointer, "thread_id": ctx.thread_id, "tools": executor.tools},
            **{"checkpoint_ns": ctx.graph_ns, "ask": True, "leases": executor.leases},
            **{"lease_ttl": executor.lease_ttl, "goal": run_goal(state.get("messages") or [])},
        }

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Compensate synchronously."""
        return self._summary(state, compensate_thread(**self._options(state, config)))

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Compensate asynchronously."""
        return self._summary(state, await acompensate_thread(**self._options(state, config)))
