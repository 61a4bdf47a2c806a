"""Answering takeovers: ``pending_takeovers`` lists the threads waiting on a person, and
``decide`` records a person's :class:`~taskpilots_graph.takeover.Decision` and continues
the run from there.

``decide`` holds the thread's lease like every runner (:mod:`taskpilots_graph.runner`); a
decision names its takeover and is refused with
:class:`~taskpilots_graph.errors.StaleDecision` once that takeover is no longer pending.
"""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.pregel import Pregel
from langgraph.types import Command, Interrupt, StateSnapshot
from pydantic import BaseModel, ValidationError

from taskpilots_graph import _thread_index
from taskpilots_graph._twins import Steps, arun_steps, both, io, run_steps
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.errors import (
    InvalidDecision,
    NoPendingTakeover,
    StaleDecision,
    ThreadNotFound,
)
from taskpilots_graph.events import EventKind
from taskpilots_graph.nodes.executor import RecoveryExecutor
from taskpilots_graph.nodes.takeover import targets
from taskpilots_graph.nodes.think import resumed_config
from taskpilots_graph.runner import aleased_thread, graph_saver, leased_thread, thread_config
from taskpilots_graph.takeover import Decision, TakeoverRequest, parse_decision
from taskpilots_graph.tool_tables import find_executor

__all__ = ["adecide", "apending_takeovers", "decide", "pending_takeovers"]

_INTERRUPT_CHANNEL = "__interrupt__"
_NULL_TASK_ID = "00000000-0000-0000-0000-000000000000"  # writes that are a step's input
_CONTROL_CHANNELS = frozenset(
    {"__error__", "__error_source_node__", _INTERRUPT_CHANNEL, "__resume__"}
)
"""Writes that say what happened to a task rather than what it produced (LangGraph's rule:
a task with any other write finished, and its recorded interrupts were answered)."""


def _requests_from_tuple(thread_id: str, pending_writes: Any) -> list[TakeoverRequest]:
    # A takeover answered while a sibling task of the same step still waits keeps its
    # interrupt write until the step ends: the task's own output says it was answered.
    finished = {
        task
        for task, channel, _value in pending_writes or ()
        if channel not in _CONTROL_CHANNELS and task != _NULL_TASK_ID
    }
    found = []
    for task, channel, value in pending_writes or ():
        if channel != _INTERRUPT_CHANNEL or task in finished:
            continue
        for item in value if isinstance(value, list | tuple) else [value]:
            data = getattr(item, "value", None)
            if isinstance(data, dict) and "options" in data and data.get("thread_id") == thread_id:
                found.append(TakeoverRequest.model_validate({**data, "interrupt_id": item.id}))
    return found


def pending_takeovers(
    checkpointer: BaseCheckpointSaver[Any], *, thread_ids: list[str] | None = None
) -> list[TakeoverRequest]:
    """Every thread waiting on a person, with its :class:`TakeoverRequest`.

    Args:
        checkpointer: The checkpointer the graphs run with.
        thread_ids: Look only at these threads (default: every thread in the store).
    """
    return run_steps(_pending(checkpointer, thread_ids))


async def apending_takeovers(
    checkpointer: BaseCheckpointSaver[Any], *, thread_ids: list[str] | None = None
) -> list[TakeoverRequest]:
    """Async form of :func:`pending_takeovers`."""
    return await arun_steps(_pending(checkpointer, thread_ids))


def _pending(
    checkpointer: BaseCheckpointSaver[Any], thread_ids: list[str] | None
) -> Steps[list[TakeoverRequest]]:
    if thread_ids is None:
        thread_ids = yield both(_thread_index.thread_ids, _thread_index.athread_ids, checkpointer)
    requests: list[TakeoverRequest] = []
    for thread_id in thread_ids:
        found = yield io(checkpointer, "get_tuple", {"configurable": {"thread_id": thread_id}})
        if found is not None:
            requests += _requests_from_tuple(thread_id, found.pending_writes)
    return requests


def _asked(interrupt: Interrupt) -> list[str]:
    """The tool call ids of the steps a takeover asks about."""
    pending = interrupt.value.get("pending") or []
    return [str(p.get("tool_call_id")) for p in pending if isinstance(p, dict)]


def _addressed(snapshot: StateSnapshot, thread_id: str, decision: Decision) -> Interrupt:
    """The pending takeover a decision answers.

    A decision naming its takeover (``interrupt_id``) answers that one or nothing: once it
    is answered the thread may wait on a newer takeover about another step, and the old
    answer must not land there. One without it answers the step it names, else the only
    takeover pending.

    Raises:
        StaleDecision: The named takeover is no longer pending.
        NoPendingTakeover: Nobody is asked anything on the thread.
        InvalidDecision: Several takeovers are pending and the decision names none, or it
            names a step its takeover does not ask about.
    """
    pending = [i for i in snapshot.interrupts if isinstance(i.value, dict) and "options" in i.value]
    if decision.interrupt_id is not None:
        chosen = [i for i in pending if i.id == decision.interrupt_id]
        if not chosen:
            raise StaleDecision(thread_id, decision.interrupt_id, [i.id for i in pending])
    elif not pending:
        raise NoPendingTakeover(thread_id)
    elif decision.tool_call_id is not None:
        # The takeover asking about that step; failing that the only one, whose node then
        # says which steps wait (InvalidDecision).
        chosen = [i for i in pending if decision.tool_call_id in _asked(i)] or pending
    else:
        chosen = pending
    if len(chosen) > 1:
        raise InvalidDecision(
            f"{len(chosen)} takeovers are pending on thread {thread_id!r}; say which one "
            f"with interrupt_id= (one of {', '.join(i.id for i in chosen)})"
        )
    (interrupt,) = chosen
    asked = _asked(interrupt)
    if decision.tool_call_id is not None and asked and decision.tool_call_id not in asked:
        raise InvalidDecision(
            f"no step {decision.tool_call_id!r} waits on this takeover; waiting: {asked}"
        )
    return interrupt


def _answer(
    graph: Pregel[Any, Any], snapshot: StateSnapshot, thread_id: str, decision: Decision
) -> Command[Any]:
    interrupt = _addressed(snapshot, thread_id, decision)
    offered = interrupt.value.get("options") or {}
    if offered and decision.action not in offered:
        raise InvalidDecision(
            f"{decision.action!r} is not an option of this takeover; choose one of "
            f"{', '.join(offered)}"
        )
    # Resumed by id: only this interrupt takes the answer, never a newer one.
    answer: Command[Any] = Command(resume={interrupt.id: decision.model_dump(mode="json")})
    executor = find_executor(graph)
    if executor is None:
        # No step layer to check against (e.g. RecoveryMiddleware in langchain's
        # create_agent): the node that asked checks the decision when it resumes.
        return answer
    chosen = targets(snapshot.values, decision)  # InvalidDecision for a step that does not wait
    if decision.action == "edit_args" and chosen:
        _check_args(executor, chosen[0].get("using") or chosen[0].get("tool") or "", decision)
    return answer


def _check_args(executor: RecoveryExecutor, tool_name: str, decision: Decision) -> None:
    """Validate edited arguments against the tool's schema before anything changes."""
    tool = executor.tools.get(tool_name)
    schema = getattr(tool, "args_schema", None)
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        try:
            schema.model_validate(decision.args or {})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise InvalidDecision(f"edit_args does not fit {tool_name}: {problems}") from exc


def decide(
    graph: Pregel[Any, Any],
    thread_id: str,
    decision: Decision | dict[str, Any] | str,
    *,
    config: RunnableConfig | None = None,
    wait: bool = False,
    **kwargs: Any,
) -> Any:
    """Answer a thread's takeover and continue it.

    The decision is validated first; an invalid one, a thread that waits on nobody or the
    same decision given twice raises and changes nothing. The answer addresses the pending
    interrupt by id (never ``invoke(None)``, which can replay a stale answer). A decision
    that names its takeover (``interrupt_id``, as the inbox and ``taskpilots decide
    --takeover`` send it) is refused once that takeover is no longer pending, so an answer
    sent twice never lands on the thread's next takeover.

    Example:
        >>> (request,) = tp.pending_takeovers(cp, thread_ids=["t-1"])  # doctest: +SKIP
        >>> tp.decide(graph, "t-1", tp.Decision(action="provide_result", result="T-42",
        ...                                     interrupt_id=request.interrupt_id))
        ... # doctest: +SKIP

    Raises:
        InvalidDecision: The decision does not validate, names no waiting step, or names
            no takeover while several are pending.
        ThreadNotFound: The thread has no checkpoint.
        StaleDecision: The takeover the decision names is no longer pending (answered
            already); nothing changed. A subclass of ``NoPendingTakeover``.
        NoPendingTakeover: Nobody is asked anything on that thread (any more).
    """
    parsed = parse_decision(decision)
    cfg = thread_config(thread_id, config)
    with leased_thread(graph, thread_id, wait):
        return run_steps(_decide(graph, parsed, cfg, kwargs))


async def adecide(
    graph: Pregel[Any, Any],
    thread_id: str,
    decision: Decision | dict[str, Any] | str,
    *,
    config: RunnableConfig | None = None,
    wait: bool = False,
    **kwargs: Any,
) -> Any:
    """Async form of :func:`decide`."""
    parsed = parse_decision(decision)
    cfg = thread_config(thread_id, config)
    async with aleased_thread(graph, thread_id, wait):
        return await arun_steps(_decide(graph, parsed, cfg, kwargs))


def _decide(
    graph: Pregel[Any, Any], decision: Decision, cfg: RunnableConfig, kwargs: dict[str, Any]
) -> Steps[Any]:
    thread_id = cfg["configurable"]["thread_id"]
    cp = graph_saver(graph)
    if (yield io(cp, "get_tuple", cfg)) is None:
        raise ThreadNotFound(thread_id)
    snapshot = yield io(graph, "get_state", cfg)
    command = _answer(graph, snapshot, thread_id, decision)
    if isinstance(cp, RecoveryAPI):
        payload = {"decision": decision.action}
        event = yield io(cp, "append_event", thread_id, EventKind.RUN_RESUMED, payload)
        cfg = resumed_config(cfg, event.seq, snapshot)
    return (yield io(graph, "invoke", command, cfg, **kwargs))
