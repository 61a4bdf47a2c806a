"""The requests the middleware's flow yields to its drivers, and the flow's settings.

Besides these, the flow passes on the ledger protocol's own ``ReadEntry``, ``WriteEntry``
and ``WriteEvent`` (see :mod:`taskpilots_graph.nodes._protocol`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool
from langgraph.prebuilt.tool_node import ToolCallRequest

from taskpilots_graph.checkpointers.base import EventRecord
from taskpilots_graph.failures import FailureKind
from taskpilots_graph.nodes._protocol import CallContext, RunPrecheck
from taskpilots_graph.policy import ToolPolicy
from taskpilots_graph.tools import Invocation

__all__ = [
    "Ask",
    "CallTool",
    "CheckEffect",
    "Compensate",
    "ErrorAnswer",
    "Flush",
    "ReadLedger",
    "RecordDecision",
    "Settings",
    "Sleep",
]


class ErrorAnswer(Exception):
    """The tool node answered the call with an error message instead of raising.

    LangGraph's ``ToolNode`` does so for arguments that do not validate: the tool did not
    run, so nothing was sent; the model can correct the call. It does so as well for a
    pydantic ``ValidationError`` raised *inside* the tool's body (a reply that failed to
    parse): for a side effect, whose arguments the flow checked before, the answer is
    therefore built with ``maybe_sent=True``.
    """

    maybe_sent = False
    failure_kind = FailureKind.CONTRACT

    def __init__(self, answer: ToolMessage, *, maybe_sent: bool = False) -> None:
        super().__init__(str(answer.content))
        self.answer = answer
        self.maybe_sent = maybe_sent


@dataclass(frozen=True, slots=True)
class CallTool:
    """Run the tool through the rest of the middleware chain (``handler(request)``)."""

    request: ToolCallRequest
    invocation: Invocation | None


@dataclass(frozen=True, slots=True)
class CheckEffect:
    """Run the pre-check of the call's tool (the protocol's ``RunPrecheck``)."""

    ctx: CallContext
    request: RunPrecheck


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Ask:
    """``interrupt(payload)``; ``event`` is written durably if the run pauses on it."""

    payload: dict[str, Any]
    event: EventRecord


@dataclass(frozen=True, slots=True)
class ReadLedger:
    thread_id: str
    key: str | None


@dataclass(frozen=True, slots=True)
class RecordDecision:
    thread_id: str
    checkpoint_ns: str
    digest: str
    message: str


@dataclass(frozen=True, slots=True)
class Compensate:
    """Undo the thread's committed effects, newest first (tools by name for compensators)."""

    thread_id: str
    checkpoint_ns: str
    tools: Mapping[str, BaseTool]


@dataclass(frozen=True, slots=True)
class Flush:
    """Write the buffered events durably now (the run is about to stop)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """The middleware's configuration, as the flow needs it."""

    policies: Mapping[str, ToolPolicy]
    default_policy: ToolPolicy
    rng: random.Random = field(default_factory=random.Random)

    def policy(self, tool: str) -> ToolPolicy:
        return self.policies.get(tool, self.default_policy)
