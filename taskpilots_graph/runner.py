"""Running threads, in any process: ``run`` a thread, ``resume`` it by id (``recover``: only if
it still needs it, for supervisors and queues), ``rewind`` it to a milestone. Listing the
threads waiting on a person (``pending_takeovers``) and answering them (``decide``) are in
:mod:`taskpilots_graph.decisions`.

Every runner (``run``, ``resume``, ``recover``, ``decide``, ``rewind`` and their async forms)
holds the thread's lease (``thread:<thread_id>``) for the whole call: a second runner on the
same thread gets :class:`~taskpilots_graph.errors.ThreadBusy` at once (or waits with
``wait=True``) instead of silently losing writes, and the executor checks the lease before
every side effect. The lease lives in the backend named with
``create_recovery_agent(leases=...)``, or else in the checkpointer's own database. The
recovery graph's own ``invoke`` holds the same lease (re-entrantly), so calling it directly
is guarded too.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.pregel import Pregel

from taskpilots_graph import _clock
from taskpilots_graph._twins import Steps, arun_steps, both, io, run_steps
from taskpilots_graph.agent import RecoveryGraph, lease_source
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.errors import ConfigurationError, ThreadNotFound, ToolWaiting
from taskpilots_graph.events import Event, EventKind, check_thread_id
from taskpilots_graph.guard import aguard_thread, guard_thread
from taskpilots_graph.health import Attribution, needs_recovery, resumed_payload
from taskpilots_graph.ledger import LedgerStatus, SideEffectUncertain
from taskpilots_graph.nodes.think import resumed_config
from taskpilots_graph.unfinished import (
    abefore_run,
    before_run,
    has_work,
    orphan_intents,
    reconcile_steps,
    refuse_takeover,
)

__all__ = [
    "aleased_thread",
    "arecover",
    "aresume",
    "arewind",
    "arun",
    "graph_saver",
    "leased_thread",
    "recover",
    "resume",
    "rewind",
    "run",
    "thread_config",
]


def thread_config(thread_id: str, config: RunnableConfig | None) -> RunnableConfig:
    """``config`` (or a new one) naming ``thread_id``, checked as every backend needs it.

    Raises:
        ConfigurationError: For a thread id no backend can store.
    """
    check_thread_id(thread_id)  # one rule on every backend, before anything is written
    base: dict[str, Any] = dict(config or {})
    base["configurable"] = {**base.get("configurable", {}), "thread_id": thread_id}
    return base  # type: ignore[return-value]


def graph_saver(graph: Pregel[Any, Any]) -> BaseCheckpointSaver[Any]:
    """The checkpointer ``graph`` was compiled with.

    Raises:
        ConfigurationError: For a graph compiled without one.
    """
    cp = graph.checkpointer
    if not isinstance(cp, BaseCheckpointSaver):
        raise ConfigurationError(
            "resume needs a graph compiled with a checkpointer, e.g. "
            "builder.compile(checkpointer=RecoveryCheckpointer(...))"
        )
    return cp


@contextmanager
def leased_thread(graph: Pregel[Any, Any], thread_id: str, wait: bool) -> Iterator[None]:
    """Hold the thread's lease for the block (re-entrant; see :mod:`taskpilots_graph.guard`).

    The lease comes from the graph's lease backend, named or its checkpointer's own
    database (:func:`~taskpilots_graph.agent.lease_source`); only a graph compiled with a
    plain LangGraph saver runs without one. Nothing else happens here: a recovery graph
    settles unfinished work in its own guarded ``invoke``, once per run.
    """
    source = lease_source(graph)
    if source is None:
        yield
        return
    with guard_thread(source.backend, source.ttl, thread_id, wait=wait):
        yield


@asynccontextmanager
async def aleased_thread(
    graph: Pregel[Any, Any], thread_id: str, wait: bool
) -> AsyncIterator[None]:
    """Async form of :func:`leased_thread`."""
    source = lease_source(graph)
    if source is None:
        yield
        return
    async with aguard_thread(source.abackend, source.ttl, thread_id, wait=wait):
        yield


def run(
    graph: Pregel[Any, Any],
    thread_id: str,
    input: Any,
    *,
    config: RunnableConfig | None = None,
    wait: bool = False,
    **kwargs: Any,
) -> Any:
    """Invoke the graph on a thread while holding the thread's lease.

    Unfinished work of the thread is settled first (:mod:`taskpilots_graph.unfinished`):
    work a stopped run left is continued, orphan intents are reconciled, and tool calls
    still open are answered truthfully before the new input, so the model never sees an
    unanswered call and no effect runs twice.

    Example:
        >>> tp.run(graph, "t-1", {"messages": [("user", goal)]})  # doctest: +SKIP

    Args:
        graph: The compiled graph; the call holds ``thread:<thread_id>`` in its lease
            backend (named, or the checkpointer's own database).
        thread_id: The thread to run.
        input: The graph's input (e.g. ``{"messages": [...]}``).
        config: Extra run config (callbacks, recursion limit, ...).
        wait: Wait for another runner of the thread to finish instead of failing at once.
        **kwargs: Passed to ``graph.invoke`` (e.g. ``durability=``).

    Returns:
        What ``graph.invoke`` returns.

    Raises:
        ThreadBusy: Another process runs the thread (and ``wait`` is false); nothing ran.
        PendingTakeover: The thread waits on a person's decision (``decide`` first).
        SideEffectUncertain: An effect of the thread is uncertain and nobody is asked.
        LeaseLost: The lease was lost mid-run; the run stopped before its next side effect.
        LockBackendUnavailable: The lease backend is unreachable; nothing ran.
    """
    cfg = thread_config(thread_id, config)
    with leased_thread(graph, thread_id, wait):
        return run_steps(_run(graph, cfg, input, kwargs))


async def arun(
    graph: Pregel[Any, Any],
    thread_id: str,
    input: Any,
    *,
    config: RunnableConfig | None = None,
    wait: bool = False,
    **kwargs: Any,
) -> Any:
    """Async form of :func:`run`."""
    cfg = thread_config(thread_id, config)
    async with aleased_thread(graph, thread_id, wait):
        return await arun_steps(_run(graph, cfg, input, kwargs))


def _run(
    graph: Pregel[Any, Any], cfg: RunnableConfig, input: Any, kwargs: dict[str, Any]
) -> Steps[Any]:
    # The recovery agent's own guarded ``invoke`` settles unfinished work; for other graphs
    # (``create_agent``) the runner does it first.
    if not isinstance(graph, RecoveryGraph):
        input = yield both(before_run, abefore_run, graph, cfg, input)
    return (yield io(graph, "invoke", input, cfg, **kwargs))


def resume(
    graph: Pregel[Any, Any],
    thread_id: str,
    *,
    config: RunnableConfig | None = None,
    wait: bool = False,
    **kwargs: Any,
) -> Any:
    """Continue a thread from its latest checkpoint, in this or any other process.

    Completed steps are not run again; side effects recorded in the ledger are reconciled,
    not repeated. A thread with nothing left to do returns its current values.

    A thread with ledger entries but no checkpoint (durability ``"exit"``, or a crash before
    the first checkpoint) is found by its ledger: each intent its run left is reconciled
    from the ledger alone (pre-check ``Done``: committed; ``NotDone``: recorded as not
    performed; otherwise uncertain, for a person), nothing is executed, and its (empty)
    values are returned. Running the same input again then continues from what happened.

    Args:
        graph: The compiled graph (with its checkpointer) that ran the thread.
        thread_id: The thread to continue.
        config: Extra run config (callbacks, recursion limit, ...).
        wait: Wait for another runner of the thread instead of raising ``ThreadBusy``.
        **kwargs: Passed to ``graph.invoke`` (e.g. ``durability=``).

    Returns:
        What ``graph.invoke`` returns.

    Raises:
        ThreadNotFound: If the thread has neither a checkpoint nor a ledger entry.
        PendingTakeover: If the thread waits on a person (answer it with ``decide``).
        SideEffectUncertain: A thread without a checkpoint left an effect nobody can
            confirm (named; a person decides).
        ThreadBusy: Another runner holds the thread (and ``wait`` is false).
    """
    cfg = thread_config(thread_id, config)
    with leased_thread(graph, thread_id, wait):
        return run_steps(_resume(graph, thread_id, cfg, kwargs))


async def aresume(
    graph: Pregel[Any, Any],
    thread_id: str,
    *,
    config: RunnableConfig | None = None,
    wait: bool = False,
    **kwargs: Any,
) -> Any:
    """Async form of :func:`resume`."""
    cfg = thread_config(thread_id, config)
    async with aleased_thread(graph, thread_id, wait):
        return await arun_steps(_resume(graph, thread_id, cfg, kwargs))


def _resume(
    graph: Pregel[Any, Any], thread_id: str, cfg: RunnableConfig, kwargs: dict[str, Any]
) -> Steps[Any]:
    cp = graph_saver(graph)
    if (yield io(cp, "get_tuple", cfg)) is None:
        # No checkpoint (durability "exit", a crash before the first one): the ledger
        # may still hold the thread's intents, and only they can say what happened.
        if not isinstance(cp, RecoveryAPI) or not (yield io(cp, "ledger", thread_id)):
            raise ThreadNotFound(thread_id)
        for outcome in (yield from reconcile_steps(graph, cp, thread_id)):
            if outcome.status is LedgerStatus.UNCERTAIN:  # nobody can confirm it: a person decides
                raise SideEffectUncertain(
                    key=outcome.key,
                    tool=outcome.tool,
                    thread_id=thread_id,
                    reason="the run stopped before its first checkpoint and nothing can tell "
                    "whether the effect happened",
                )
        return (yield io(graph, "get_state", cfg)).values
    if isinstance(cp, RecoveryAPI) and orphan_intents((yield io(cp, "ledger", thread_id))):
        # Intents the checkpoint may not show (durability "async" and a crash): the
        # ledger is their only trace. Settled first, the run continues past them.
        yield from reconcile_steps(graph, cp, thread_id)
    snapshot = yield io(graph, "get_state", cfg)
    refuse_takeover(thread_id, snapshot)
    if not has_work(snapshot):
        return snapshot.values
    if isinstance(cp, RecoveryAPI):
        next_ = {"next": list(snapshot.next)}
        event = yield io(cp, "append_event", thread_id, EventKind.RUN_RESUMED, next_)
        cfg = resumed_config(cfg, event.seq, snapshot)
    return (yield io(graph, "invoke", None, cfg, **kwargs))


# -- recover -----------------------------------------------------------------------------------


def recover(
    graph: Pregel[Any, Any],
    thread_id: str,
    attribution: Attribution | None = None,
    *,
    config: RunnableConfig | None = None,
    **kwargs: Any,
) -> bool:
    """Resume ``thread_id`` if, once its lease is ours, it still needs it.

    The check happens under the lease, so of several supervisors (or queue jobs) racing for
    one thread exactly one resumes it: the others get ``ThreadBusy``, or find nothing left
    to do and return ``False``. The ``run_resumed`` event carries the attribution.

    Returns:
        Whether a run happened (a run that parks again in ``waiting_tool`` counts).

    Raises:
        ThreadBusy: Another runner holds the thread.
        LockBackendUnavailable: The lease backend is unreachable; nothing ran.
    """
    cfg = thread_config(thread_id, config)
    with leased_thread(graph, thread_id, False):
        return run_steps(_recover(graph, attribution, cfg, kwargs))


async def arecover(
    graph: Pregel[Any, Any],
    thread_id: str,
    attribution: Attribution | None = None,
    *,
    config: RunnableConfig | None = None,
    **kwargs: Any,
) -> bool:
    """Async form of :func:`recover`."""
    cfg = thread_config(thread_id, config)
    async with aleased_thread(graph, thread_id, False):
        return await arun_steps(_recover(graph, attribution, cfg, kwargs))


def _recover(
    graph: Pregel[Any, Any], why: Attribution | None, cfg: RunnableConfig, kwargs: dict[str, Any]
) -> Steps[bool]:
    snapshot = yield io(graph, "get_state", cfg)
    if not needs_recovery(snapshot, _clock.now()):
        return False
    cp = graph.checkpointer
    if isinstance(cp, RecoveryAPI):
        payload = resumed_payload(snapshot, why)
        thread_id = cfg["configurable"]["thread_id"]
        event = yield io(cp, "append_event", thread_id, EventKind.RUN_RESUMED, payload)
        cfg = resumed_config(cfg, event.seq, snapshot)
    # Parking again in waiting_tool until the next retry_at is a normal end of a run.
    with contextlib.suppress(ToolWaiting):
        yield io(graph, "invoke", None, cfg, **kwargs)
    return True


# -- rewind ------------------------------------------------------------------------------------


def _rewind_target(events: list[Event], to: str) -> str:
    """The checkpoint id of milestone ``to`` (its latest time), or ``to`` itself."""
    for event in reversed(events):
        if event.kind is EventKind.MILESTONE_REACHED and event.payload.get("name") == to:
            checkpoint_id = event.payload.get("checkpoint_id")
            if not checkpoint_id:
                raise ConfigurationError(
                    f"milestone {to!r} was reached where no checkpoint was stored "
                    "(durability='exit'?); rewind to a checkpoint id instead"
                )
            return str(checkpoint_id)
    return to


def rewind(
    graph: Pregel[Any, Any],
    thread_id: str,
    *,
    to: str,
    config: RunnableConfig | None = None,
    wait: bool = False,
    **kwargs: Any,
) -> Any:
    """Go back to a business milestone (by name) or a checkpoint id, and continue from there.

    The thread forks from that checkpoint. Events recorded after it are flagged
    ``superseded`` (kept for audit, left out of summaries), and model decisions recorded
    after it are forgotten, so the model decides anew. Side effects committed before the
    target are part of its state and are not repeated; later ones are reconciled by the
    ledger like any other call.

    Raises:
        ThreadNotFound: The thread has no checkpoint.
        ConfigurationError: The target is neither a milestone nor a checkpoint of the thread.
    """
    cfg = thread_config(thread_id, config)
    with leased_thread(graph, thread_id, wait):
        return run_steps(_rewind(graph, thread_id, to, cfg, kwargs))


async def arewind(
    graph: Pregel[Any, Any],
    thread_id: str,
    *,
    to: str,
    config: RunnableConfig | None = None,
    wait: bool = False,
    **kwargs: Any,
) -> Any:
    """Async form of :func:`rewind`."""
    cfg = thread_config(thread_id, config)
    async with aleased_thread(graph, thread_id, wait):
        return await arun_steps(_rewind(graph, thread_id, to, cfg, kwargs))


def _rewind(
    graph: Pregel[Any, Any], thread_id: str, to: str, cfg: RunnableConfig, kwargs: dict[str, Any]
) -> Steps[Any]:
    cp = graph_saver(graph)
    if not isinstance(cp, RecoveryAPI):
        raise ConfigurationError("rewind needs a graph compiled with a recovery checkpointer")
    if (yield io(cp, "get_tuple", cfg)) is None:
        raise ThreadNotFound(thread_id)
    events = yield io(cp, "events", thread_id)
    checkpoint_id = _rewind_target(events, to)
    fork: dict[str, Any] = dict(cfg)
    fork["configurable"] = {**cfg["configurable"], "checkpoint_id": checkpoint_id}
    target = yield io(cp, "get_tuple", fork)
    if target is None:
        raise ConfigurationError(f"thread {thread_id!r} has no milestone or checkpoint {to!r}")
    since = datetime.fromisoformat(target.checkpoint["ts"]).timestamp()
    yield io(cp, "forget_decisions", thread_id, since=since)
    last = events[-1].seq if events else 0
    first = next((e.seq for e in events if e.ts.timestamp() > since), last + 1)
    superseded = {"to": to, "checkpoint_id": checkpoint_id, "from_seq": first, "to_seq": last}
    yield io(cp, "append_event", thread_id, EventKind.REWOUND, superseded)
    return (yield io(graph, "invoke", None, fork, **kwargs))
