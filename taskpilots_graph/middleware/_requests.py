"""The requests the middleware's flow yields to its drivers, and the flow's settings.

Besides these, the flow passes on the ledger protocol's own requests (see
:mod:`taskpilots_graph.engine._protocol`), which the engine's drivers carry out.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from taskpilots_graph.events import Event, EventKind, EventRecord
from taskpilots_graph.failures import FailureKind
from taskpilots_graph.policy import ToolPolicy
from taskpilots_graph.tools import check_args

__all__ = [
    "Ask",
    "Compensate",
    "EndRun",
    "ErrorAnswer",
    "Flush",
    "PassThrough",
    "ReadAsked",
    "ReadLedger",
    "RecordDecision",
    "Settings",
    "Sleep",
    "ToolSeat",
    "UseTool",
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


@dataclass
class ToolSeat:
    """Driver state: the tool request in use (:class:`UseTool`) and the answer it got."""

    request: ToolCallRequest | None = None
    box: list[ToolMessage | Command[Any]] = field(default_factory=list)

    def use(self, request: UseTool) -> list[ToolMessage | Command[Any]]:
        self.request, self.box = request.request, []
        return self.box

    def check(self, args: dict[str, Any]) -> None:
        """The protocol's ``CheckArgs``, against the schema of the tool the node would run."""
        if self.request is not None and self.request.tool is not None:
            check_args(self.request.tool, args)

    def answered(self, answer: ToolMessage | Command[Any], effect: bool) -> Any:
        """The protocol's ``RunTool`` answer from the tool node's; an error answer is raised
        (the arguments passed ``CheckArgs``: for a side effect it comes from the body)."""
        if isinstance(answer, ToolMessage) and answer.status == "error":
            raise ErrorAnswer(answer, maybe_sent=effect)
        self.box[:] = [answer]
        return answer.content if isinstance(answer, ToolMessage) else answer


@dataclass(frozen=True, slots=True)
class UseTool:
    """The tool request the protocol's next ``CheckArgs`` and ``RunTool`` are about (``RunTool``
    runs it through the rest of the middleware chain, ``handler(request)``); answered with
    the list that receives the tool node's answer."""

    request: ToolCallRequest


@dataclass(frozen=True, slots=True)
class PassThrough:
    """A call of a tool the agent does not have: the tool node answers it (an error)."""

    request: ToolCallRequest


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Ask:
    """``interrupt(payload)``; ``event`` is written durably if the run pauses on it (none
    for a question asked before, whose answer waits)."""

    payload: dict[str, Any]
    event: EventRecord | None


@dataclass(frozen=True, slots=True)
class ReadLedger:
    thread_id: str
    key: str | None


@dataclass(frozen=True, slots=True)
class ReadAsked:
    """The questions the task ``task`` asked a person about the call, oldest first: the
    ``takeover_requested`` payloads, each with ``decided`` (its answer is on record)."""

    thread_id: str
    tool_call_id: str
    task: str


def asked_in(events: Iterable[Event], request: ReadAsked) -> list[dict[str, Any]]:
    """The answer to :class:`ReadAsked` from the thread's events."""
    asked: dict[int, dict[str, Any]] = {}
    decided: set[Any] = set()
    mine = [e for e in events if not e.superseded and e.payload.get("task") == request.task]
    for event in mine:
        p, call_id = event.payload, request.tool_call_id
        if event.kind is EventKind.TAKEOVER_REQUESTED and p.get("tool_call_id") == call_id:
            asked.setdefault(int(p["ordinal"]), dict(p))
        elif event.kind is EventKind.DECISION_RECORDED and call_id in p.get("steps", ()):
            decided.add(p.get("ordinal"))
    return [{**p, "decided": n in decided} for n, p in sorted(asked.items())]


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
class EndRun:
    """The run ends failed here (its error leaves ``invoke``): log ``event``
    (``agent_finished``) if the middleware runs a whole agent. A ``tp.ToolNode`` in a
    graph of the user's own logs no start of a run, so it logs no end either."""

    event: EventRecord


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
