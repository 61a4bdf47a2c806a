"""Unfinished work first: what a new run of a thread settles before it takes new input.

:func:`before_run` / :func:`abefore_run` are called by every guarded entry point of a
recovery graph (``invoke`` / ``stream`` / ``ainvoke`` / ``astream`` on the compiled agent, and
the runners in :mod:`taskpilots_graph.runner`) while the thread's lease is held, before the
graph starts. They return the input to run with.

Why: LangGraph starts new input from the graph's entry and *discards* the tasks a stopped run
left behind. A thread killed mid side effect, waiting for a tool, or stopped before its
model saw a tool's answer would then send the provider a conversation with an unanswered
tool call (HTTP 400), or let the model decide the same effect again under new tool-call ids,
hence new ledger keys: the effect runs twice and the first intent stays ``intended`` forever.
So, before new input runs:

1. **A pending takeover** (an interrupt waiting on a person) refuses the input with
   :class:`~taskpilots_graph.errors.PendingTakeover`: new input would silently drop the
   question, and only the person can settle what it is about (``tp.decide``).
2. **Orphan intents** (entries a stopped run left ``intended``) are reconciled from the
   ledger alone (:func:`reconcile_orphans`): pre-check ``Done`` commits, ``NotDone`` records
   that the effect never happened, an idempotent tool's unknown outcome stays retryable
   under its key, anything else is ``uncertain`` for a person. The ledger is the only trace
   where durability ``"async"`` / ``"exit"`` lost the checkpoint showing the call; settling
   it first means whatever the model decides next meets a settled entry.
3. **Work the stopped run left** (LangGraph's ``next`` or ``tasks``) is continued, as
   ``tp.resume`` would: the executor answers the interrupted call through the ledger
   (recorded result, pre-check, idempotent re-run, or a takeover), and the old turn ends.
4. **Calls still open** (a tool waiting for ``retry_at``) are answered with a truthful
   ``ToolMessage`` placed before the new message, and their steps are closed: the model
   reads that the call did not complete and may call it again.

An ``uncertain`` effect nobody is asked about (no takeover pending, the thread not closed)
refuses the input with :class:`~taskpilots_graph.ledger.SideEffectUncertain`: a model given
new input could decide the same effect again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

from langchain_core.messages import ToolCall, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.types import Command, StateSnapshot

from taskpilots_graph import _clock
from taskpilots_graph._twins import Steps, arun_steps, both, io, run_steps
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.engine import AsyncDriver, CallContext, Driver, call_context
from taskpilots_graph.engine._reconcile import settle_orphan
from taskpilots_graph.errors import PendingTakeover, ToolWaiting
from taskpilots_graph.events import Event, EventKind, EventRecord, prepare_event
from taskpilots_graph.ledger import (
    PAUSED,
    LedgerEntry,
    LedgerStatus,
    SideEffectSpec,
    SideEffectUncertain,
    runner_of,
)
from taskpilots_graph.locks import adefault_lease_backend, default_lease_backend
from taskpilots_graph.nodes.executor import pending_calls
from taskpilots_graph.nodes.think import resumed_config
from taskpilots_graph.tools import spec_of

__all__ = [
    "OrphanOutcome",
    "abefore_run",
    "areconcile_orphans",
    "before_run",
    "has_work",
    "orphan_intents",
    "reconcile_orphans",
    "refuse_takeover",
]

MAX_ROUNDS = 4
"""Continuations of left-over work before new input runs (each may stop on a new wait)."""

T = TypeVar("T")


# -- orphan intents, from the ledger alone ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class OrphanOutcome:
    """What reconciling one orphan intent found.

    Attributes:
        key: The ledger key.
        tool: The tool.
        status: The entry's status afterwards (``committed``, ``failed``, ``uncertain``, or
            still ``intended`` when no tool of the graph can reconcile it).
        outcome: ``done``, ``not_done``, ``unknown_idempotent``, ``uncertain`` or
            ``unknown_tool``.
    """

    key: str
    tool: str
    status: LedgerStatus
    outcome: str


def orphan_intents(entries: Sequence[LedgerEntry]) -> list[LedgerEntry]:
    """Entries left ``intended`` by a run that stopped (not paused on an interrupt).

    Called while the thread's lease is held (or by ``resume`` of a thread nobody runs), so
    no live run of the thread can own them. An entry another thread executes again under a
    shared business key is that runner's, not an orphan of this thread: the next call of
    its key settles it, waiting for that runner while it lives.
    """
    return [
        e
        for e in entries
        if e.status is LedgerStatus.INTENDED
        and not e.extra.get(PAUSED)
        and runner_of(e) == e.thread_id
    ]


def _orphan_context(entry: LedgerEntry, spec: SideEffectSpec) -> CallContext:
    """The call an orphan intent was made for, as the protocol knows calls."""
    return call_context(
        thread_id=entry.thread_id,
        checkpoint_ns=entry.checkpoint_ns,
        tool=entry.tool,
        args=entry.args,
        tool_call_id=entry.tool_call_id,
        spec=spec,
        key=entry.key,
    )


# The entry's status after :func:`settle_orphan` returned each label (it writes it once).
_SETTLED = {
    "done": LedgerStatus.COMMITTED,
    "uncertain": LedgerStatus.UNCERTAIN,
    "not_done": LedgerStatus.FAILED,
    "unknown_idempotent": LedgerStatus.FAILED,
}


def reconcile_orphans(
    graph: Any, cp: RecoveryAPI, thread_id: str, *, tools: Mapping[str, BaseTool] | None = None
) -> list[OrphanOutcome]:
    """Settle the thread's orphan intents from the ledger alone (no checkpoint needed).

    Used where the graph cannot reach the call: the checkpoint showing it was never written
    (durability ``"exit"`` or ``"async"`` and a crash), or new input is about to replace
    the stopped turn. The rules are the protocol's (:func:`~taskpilots_graph.nodes.
    _protocol.settle_orphan`): pre-check ``Done`` commits, ``NotDone`` closes the entry as
    not performed, an idempotent tool's unknown outcome stays retryable under its key,
    anything else is ``uncertain``. An entry of a tool this graph does not have is left.
    ``tools`` (by name) stands in for the graph's where the caller has them at hand.
    """
    return run_steps(reconcile_steps(graph, cp, thread_id, tools))


async def areconcile_orphans(
    graph: Any, cp: RecoveryAPI, thread_id: str, *, tools: Mapping[str, BaseTool] | None = None
) -> list[OrphanOutcome]:
    """Async form of :func:`reconcile_orphans`."""
    return await arun_steps(reconcile_steps(graph, cp, thread_id, tools))


def reconcile_steps(
    graph: Any, cp: RecoveryAPI, thread_id: str, tools: Mapping[str, BaseTool] | None = None
) -> Steps[list[OrphanOutcome]]:
    """The body of :func:`reconcile_orphans` (see :func:`run_steps`)."""
    orphans = orphan_intents((yield io(cp, "ledger", thread_id)))
    if orphans and tools is None:
        from taskpilots_graph.tool_tables import graph_tools

        tools = graph_tools(graph)
    outcomes = []
    for entry in orphans:
        tool = (tools or {}).get(entry.tool)
        if tool is None or (spec := spec_of(tool)) is None:  # nothing here can ask about it
            outcomes.append(OrphanOutcome(entry.key, entry.tool, entry.status, "unknown_tool"))
            continue
        # Nothing runs and no intent is written: no tool, lease or lock is involved.
        driver = Driver(cp, thread_id, lambda: default_lease_backend(cp), 30.0, None)
        adriver = AsyncDriver(cp, thread_id, lambda: adefault_lease_backend(cp), 30.0, None)
        protocol = settle_orphan(_orphan_context(entry, spec), entry)
        label = yield both(driver.drive, adriver.drive, protocol)
        outcomes.append(OrphanOutcome(entry.key, entry.tool, _SETTLED[label], label))
    return outcomes


# -- the checks before new input --------------------------------------------------------------


def _skip(graph: Any, config: RunnableConfig, input: Any) -> bool:
    """Input that is not new (resume, a decision) or a graph run inside another graph."""
    if input is None or isinstance(input, Command):
        return True
    if not isinstance(getattr(graph, "checkpointer", None), RecoveryAPI):
        return True
    conf = config.get("configurable") or {}
    # A subgraph call: the parent's run owns the thread and its unfinished work.
    return bool(conf.get("checkpoint_ns")) or not conf.get("thread_id")


def refuse_takeover(thread_id: str, snapshot: StateSnapshot) -> None:
    """Raise :class:`PendingTakeover` if the thread waits on a person's decision."""
    if snapshot.interrupts:
        raise PendingTakeover(thread_id, [i.id for i in snapshot.interrupts])


def _refuse_uncertain(
    thread_id: str, entries: Sequence[LedgerEntry], events: Sequence[Event]
) -> None:
    from taskpilots_graph.threads import undecided_uncertain

    # One a person already decided on (e.g. abandoned) is on record and asks nobody.
    for entry in undecided_uncertain(entries, events):
        raise SideEffectUncertain(
            key=entry.key,
            tool=entry.tool,
            thread_id=thread_id,
            reason="an earlier run of this thread left it uncertain and no takeover "
            "asks a person about it; new input was not run",
        )


def _retry_at(snapshot: StateSnapshot, events: Sequence[Event]) -> float | None:
    """When the thread's waiting tool is due, if it waits for one.

    From the recovery agent's flow layer; a graph without one (``create_agent`` with
    ``RecoveryMiddleware``) waits when its log ends in a retry no call has followed.
    """
    values = snapshot.values or {}
    if "flow" in values:
        flow = values.get("flow") or {}
        due = flow.get("retry_at")
        waiting = flow.get("stage") == "waiting_tool"
        return float(due) if waiting and isinstance(due, int | float) else None
    due = None
    for event in events:
        if event.superseded:
            continue
        if event.kind is EventKind.RETRY_SCHEDULED:
            due = event.payload.get("retry_at")
        elif event.kind in (EventKind.TOOL_INVOKED, EventKind.AGENT_STARTED):
            due = None
    return float(due) if isinstance(due, int | float) else None


def has_work(snapshot: StateSnapshot) -> bool:
    """Whether a stopped run left work in ``snapshot`` (``invoke(None)`` continues it).

    ``next`` alone is not enough: after a crash between a task's writes and the next
    checkpoint, ``next`` can be empty while ``tasks`` still holds the finished task.
    """
    return bool(snapshot.next or snapshot.tasks)


def _when(retry_at: Any) -> str:
    if not isinstance(retry_at, int | float):
        return "a later time"
    return datetime.fromtimestamp(float(retry_at), UTC).isoformat(timespec="seconds")


def _answer_text(call: ToolCall, record: Mapping[str, Any], due: float | None) -> str:
    failure = record.get("failure") or {}
    error = failure.get("message") or failure.get("error_type")
    why = f" after it failed ({str(error)[:200]})" if error else ""
    retry_at = record.get("retry_at") or due
    if retry_at:
        return (
            f"Not done: {call['name']} was waiting to be retried at {_when(retry_at)}"
            f"{why}; that retry was dropped when a new message arrived. "
            "IO it again if it is still needed."
        )
    return f"Not done: {call['name']} had no result when a new message arrived{why}."


def _open_calls(
    snapshot: StateSnapshot, due: float | None
) -> tuple[list[ToolMessage], dict[str, Any]]:
    """Truthful answers to every call still open, and the step updates closing them."""
    values = snapshot.values or {}
    messages = values.get("messages") or []
    _, calls = pending_calls(messages)
    steps: Mapping[str, Any] = values.get("steps") or {}
    answers = []
    closed: dict[str, Any] = {}
    for call in calls:
        call_id = call["id"] or ""
        record = steps.get(call_id) or {}
        text = _answer_text(call, record, due)
        answers.append(ToolMessage(text, tool_call_id=call_id, name=call["name"], status="error"))
        if record:
            closed[call_id] = {"status": "closed", "retry_at": None, "result": text[:120]}
    return answers, closed


def _with_answers(
    graph: Any, input: Any, answers: list[ToolMessage], closed: dict[str, Any]
) -> Any:
    if not answers or not isinstance(input, Mapping) or "messages" not in input:
        return input
    given = input["messages"]
    new = dict(input)
    new["messages"] = [*answers, *(given if isinstance(given, list) else [given])]
    channels = getattr(graph, "channels", None) or {}
    if "steps" in channels and closed:
        new["steps"] = {**closed, **(new.get("steps") or {})}
    if "flow" in channels:
        flow = {"stage": "running", "retry_at": None, "reason": None}
        new["flow"] = {**flow, **(new.get("flow") or {})}
    return new


def _closed_event(thread_id: str, answers: list[ToolMessage]) -> EventRecord:
    calls = [
        {"tool_call_id": m.tool_call_id, "tool": m.name, "answer": str(m.content)[:200]}
        for m in answers
    ]
    kind = EventKind.CALLS_CLOSED
    return prepare_event(thread_id, kind, {"calls": calls}, checkpoint_id=None, checkpoint_ns="")


def before_run(graph: Any, config: RunnableConfig, input: Any) -> Any:
    """Settle the thread's unfinished work before ``input`` runs; returns the input to run.

    See the module docstring for the order. ``None`` and ``Command`` inputs (resume, a
    decision) pass unchanged, as does a graph run as another graph's subgraph. A thread
    with nothing unfinished costs two reads: its ledger entries and its state.

    Raises:
        PendingTakeover: A person must answer the thread's takeover first (``tp.decide``).
        SideEffectUncertain: An effect of the thread is uncertain and nobody is asked.
    """
    return input if _skip(graph, config, input) else run_steps(_settle(graph, config, input))


async def abefore_run(graph: Any, config: RunnableConfig, input: Any) -> Any:
    """Async form of :func:`before_run`."""
    if _skip(graph, config, input):
        return input
    return await arun_steps(_settle(graph, config, input))


def _settle(graph: Any, config: RunnableConfig, input: Any) -> Steps[Any]:
    cp = cast(RecoveryAPI, graph.checkpointer)
    thread_id = str(config["configurable"]["thread_id"])
    entries = yield io(cp, "ledger", thread_id)
    # Orphans first: once settled, whatever the continued run decides about the same
    # effect meets a settled entry (and the repeat guard), not an open one.
    changed = bool(orphan_intents(entries)) and bool(
        (yield from reconcile_steps(graph, cp, thread_id))
    )
    due: float | None = None
    snapshot = yield io(graph, "get_state", config)
    for _ in range(MAX_ROUNDS):
        refuse_takeover(thread_id, snapshot)
        if not has_work(snapshot):
            break
        # Without the recovery agent's flow layer a wait can only be read from the log.
        log = (yield io(cp, "events", thread_id)) if "flow" not in (snapshot.values or {}) else ()
        due = _retry_at(snapshot, log)
        if due is not None and due > _clock.now():
            break
        next_ = {"next": list(snapshot.next)}
        event = yield io(cp, "append_event", thread_id, EventKind.RUN_RESUMED, next_)
        # A guarded graph's own invoke: its guard is re-entrant, and ``None`` input passes
        # through this module unchanged, so this does not recurse.
        with contextlib.suppress(ToolWaiting):  # its open call is answered below
            yield io(graph, "invoke", None, resumed_config(config, event.seq, snapshot))
        changed = True
        snapshot = yield io(graph, "get_state", config)
    if changed:
        entries = yield io(cp, "ledger", thread_id)
        if orphan_intents(entries):
            yield from reconcile_steps(graph, cp, thread_id)
            entries = yield io(cp, "ledger", thread_id)
    refuse_takeover(thread_id, snapshot)
    if any(e.status is LedgerStatus.UNCERTAIN for e in entries):
        _refuse_uncertain(thread_id, entries, (yield io(cp, "events", thread_id)))
    answers, closed = _open_calls(snapshot, due)
    if answers:
        yield io(cp, "append_records", [_closed_event(thread_id, answers)])
    return _with_answers(graph, input, answers, closed)
