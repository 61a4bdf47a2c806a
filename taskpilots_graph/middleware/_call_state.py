"""The course of one tool call through the middleware's flow (:mod:`._flow`), and the marks
its answer carries for the calls after it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import ToolCall, ToolMessage
from langchain_core.tools import BaseTool
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from taskpilots_graph.engine import CallContext, call_context
from taskpilots_graph.engine._records import error_message, tool_content
from taskpilots_graph.nodes._context import RunContext
from taskpilots_graph.policy import ToolPolicy
from taskpilots_graph.tools import spec_of

__all__ = ["ABANDONED_MARK", "DECIDED_MARK", "FAILURE_MARK", "Answer", "CallState"]

FAILURE_MARK = "taskpilots_failure"
"""Key in an answer's ``artifact``: the signature (tool, kind, error type) of its failure."""
DECIDED_MARK = "taskpilots_decided"
"""Key in an answer's ``artifact``: a person decided about the call."""
ABANDONED_MARK = "taskpilots_abandoned"
"""Key in an answer's ``artifact``: a person abandoned the run at this call (the agent ends
before the model is called again, as the recovery agent ends after compensating)."""

Answer = ToolMessage | Command[Any]


@dataclass
class CallState:
    """The mutable course of one tool call through retries, fallbacks and decisions."""

    request: ToolCallRequest
    ctx: RunContext
    task_ns: str
    tools: dict[str, BaseTool]
    using: str
    args: dict[str, Any]
    attempts: int = 0
    first_failed_at: float | None = None
    tried: list[str] = field(default_factory=list)
    asked: int = 0  # interrupts met in this execution of the task, for ``DECISIONS``
    answered: bool = False  # the task runs again with a person's answer waiting
    failed: str | None = None  # the signature of the call's latest failure (stuck counting)
    decided: bool = False  # a person decided about the call

    def marked(self, answer: Answer, *, abandoned: bool = False) -> Answer:
        """``answer``, carrying what stuck detection counts in later calls, as the recovery
        agent counts it: the call's failure signature if it failed on its way (since a
        person's decision), and that a person decided (the count starts again); and that
        the run was abandoned here. An answer with an artifact of its own keeps it."""
        marks: dict[str, Any] = {DECIDED_MARK: True} if self.decided else {}
        if abandoned:
            marks[ABANDONED_MARK] = True
        if self.failed is not None:
            marks[FAILURE_MARK] = self.failed
        if not marks or not isinstance(answer, ToolMessage) or answer.artifact:
            return answer
        return answer.model_copy(update={"artifact": marks})

    def result(self, value: Any) -> Answer:
        """The marked answer with ``value`` as the call's result."""
        content = tool_content(value)
        return self.marked(ToolMessage(content=content, tool_call_id=self.call_id, name=self.name))

    def error(self, text: str, *, abandoned: bool = False) -> Answer:
        """The marked error answer ``text``."""
        return self.marked(error_message(self.request.tool_call, text), abandoned=abandoned)

    @property
    def call_id(self) -> str:
        return self.request.tool_call["id"] or ""

    @property
    def name(self) -> str:
        return self.request.tool_call["name"]

    @property
    def messages(self) -> list[Any]:
        """The conversation in the state the tool node got."""
        return list((self.request.state or {}).get("messages") or [])

    def context(self, policy: ToolPolicy) -> CallContext:
        """The call as the ledger protocol sees it, with the same user rules and drift
        settings the recovery agent's executor gives it."""
        tool = self.tools.get(self.using)
        return call_context(
            thread_id=self.ctx.thread_id,
            checkpoint_ns=self.ctx.graph_ns,
            tool=self.using,
            args=self.args,
            tool_call_id=self.call_id,
            spec=spec_of(tool) if tool is not None else None,
            policy=policy,
            attempt=self.attempts + 1,
            step_durable=self.ctx.input_stored,
        )

    def tool_request(self) -> ToolCallRequest:
        if self.using == self.name and self.args == self.request.tool_call["args"]:
            return self.request
        call = ToolCall(
            name=self.using, args=dict(self.args), id=self.request.tool_call["id"], type="tool_call"
        )
        # Known here: the flow only runs tools the node has (unknown ones pass through).
        return self.request.override(tool_call=call, tool=self.tools[self.using])
