"""The events that open, re-anchor and close a run, written alike by both agent forms.

``create_recovery_agent`` writes them from its think and fail nodes, ``RecoveryMiddleware``
from its agent and model hooks; the event log (``tp.list_threads``, ``taskpilots show``, the
metrics) reads them the same way whichever form wrote them:

* ``agent_started`` when a turn starts on a user's message (:func:`run_started`);
* ``resume_context`` when the first model call after a resume gets the resume prompt
  (:func:`resume_context`);
* ``llm_decided`` for the model's final answer, one without tool calls (:func:`answered`),
  and for a message of tool calls (:func:`decided`), before they run;
* ``agent_finished`` when the run ends, ``closed`` or ``failed`` (:func:`run_finished`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage

from taskpilots_graph.engine._records import SUMMARY_CHARS, step_event
from taskpilots_graph.events import EventKind, EventRecord

__all__ = ["answer_text", "answered", "decided", "resume_context", "run_finished", "run_started"]


def run_started(
    thread_id: str, checkpoint_ns: str, messages: Sequence[BaseMessage]
) -> EventRecord | None:
    """``agent_started`` when the conversation ends on a user's message (a new turn);
    ``None`` otherwise (a run continuing a turn: a resume, a person's answer)."""
    if not messages or not isinstance(messages[-1], HumanMessage):
        return None
    goal = str(messages[-1].content)[:SUMMARY_CHARS]
    return step_event(thread_id, checkpoint_ns, EventKind.AGENT_STARTED, goal=goal)


def answer_text(message: BaseMessage) -> str:
    """The model's answer as the events summarise it."""
    return str(message.content)[:SUMMARY_CHARS]


def answered(thread_id: str, checkpoint_ns: str, ai: AIMessage) -> EventRecord:
    """``llm_decided`` for a model answer without tool calls (the run's final answer)."""
    return step_event(thread_id, checkpoint_ns, EventKind.LLM_DECIDED, content=answer_text(ai))


def decided(thread_id: str, checkpoint_ns: str, ai: AIMessage, **extra: Any) -> EventRecord:
    """``llm_decided`` for a model message with tool calls: the calls, and its text."""
    calls = [{"name": c["name"], "id": c["id"], "args": c["args"]} for c in ai.tool_calls]
    extra = {"tool_calls": calls, "content": answer_text(ai), **extra}
    return step_event(thread_id, checkpoint_ns, EventKind.LLM_DECIDED, **extra)


def run_finished(
    thread_id: str,
    checkpoint_ns: str,
    status: str,
    *,
    answer: str | None = None,
    reason: str | None = None,
) -> EventRecord:
    """``agent_finished``: ``status`` ``"closed"`` with the model's ``answer``, or
    ``"failed"`` / ``"closed"`` with the ``reason`` the run stopped for."""
    extra = {k: v for k, v in (("answer", answer), ("reason", reason)) if v is not None}
    return step_event(thread_id, checkpoint_ns, EventKind.AGENT_FINISHED, status=status, **extra)


def resume_context(
    thread_id: str, checkpoint_ns: str, prompt: str, refreshed: Sequence[str] = ()
) -> EventRecord:
    """``resume_context``: the resume prompt given to the model (summarised), and which
    refreshers ran for it."""
    return step_event(
        thread_id,
        checkpoint_ns,
        EventKind.RESUME_CONTEXT,
        context=prompt[:SUMMARY_CHARS],
        refreshed=sorted(refreshed),
    )
