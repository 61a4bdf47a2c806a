"""What a person sees when a run needs them, and what they can answer.

A :class:`TakeoverRequest` travels through LangGraph's ``interrupt()`` as plain JSON (so any
client can read it) and comes back typed from :func:`~taskpilots_graph.pending_takeovers`.
A :class:`Decision` is validated before anything happens: an invalid one raises
:class:`~taskpilots_graph.errors.InvalidDecision` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from taskpilots_graph.errors import InvalidDecision
from taskpilots_graph.reprs import html_view

__all__ = ["DECISION_ACTIONS", "DRIFT_ACTIONS", "Decision", "TakeoverRequest", "parse_decision"]

DecisionAction = Literal["retry", "skip", "provide_result", "edit_args", "abandon", "accept"]
DECISION_ACTIONS: tuple[str, ...] = ("retry", "skip", "provide_result", "edit_args", "abandon")
"""The answers to a takeover about a failed step."""
DRIFT_ACTIONS: tuple[str, ...] = ("accept", "retry", "skip", "provide_result", "abandon")
"""The answers to a takeover about a drifted result (see :mod:`taskpilots_graph.drift`)."""


class Decision(BaseModel):
    """A person's answer to a takeover.

    Attributes:
        action: ``retry`` (run the step again, same ledger key), ``skip`` (continue without
            it), ``provide_result`` (the person supplies the tool's result), ``edit_args``
            (run it with new arguments, hence a new key), ``abandon`` (compensate committed
            effects and close the run), ``accept`` (only for a drifted result: keep the new
            result the tool returned).
        result: The tool's result, for ``provide_result``.
        args: The new arguments, for ``edit_args``.
        tool_call_id: The step the decision is about; needed only when several steps wait.
        interrupt_id: The takeover the decision answers (``TakeoverRequest.interrupt_id``).
            With it, ``decide`` refuses the decision with
            :class:`~taskpilots_graph.errors.StaleDecision` once that takeover is no longer
            pending, instead of applying it to whatever the thread waits on next. Without
            it the decision answers the one takeover pending (an error when several are).
        decided_by: Who decided (recorded in the event log).
        note: Free text, recorded with the decision.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    action: DecisionAction
    result: Any = None
    args: dict[str, Any] | None = None
    tool_call_id: str | None = None
    interrupt_id: str | None = Field(default=None, min_length=1, max_length=200)
    decided_by: str | None = None
    note: str | None = Field(default=None, max_length=2000)

    @model_validator(mode="after")
    def _fields_fit_action(self) -> Decision:
        if self.action == "provide_result" and self.result is None:
            raise ValueError("provide_result needs result=... (the tool's result)")
        if self.action == "edit_args" and not self.args:
            raise ValueError("edit_args needs args={...} (the new arguments)")
        if self.action not in ("provide_result",) and self.result is not None:
            raise ValueError(f"{self.action} takes no result")
        if self.action != "edit_args" and self.args is not None:
            raise ValueError(f"{self.action} takes no args")
        return self


def parse_decision(value: Any) -> Decision:
    """Validate a decision given as a :class:`Decision`, a dict or an action name.

    Raises:
        InvalidDecision: With the validation problems in the message.
    """
    if isinstance(value, Decision):
        return value
    data: Any = {"action": value} if isinstance(value, str) else value
    if not isinstance(data, Mapping):
        raise InvalidDecision(f"a decision is a tp.Decision or a dict, got {type(data).__name__}")
    try:
        return Decision.model_validate(dict(data))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'decision'}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidDecision(f"invalid decision: {problems}") from exc


class TakeoverRequest(BaseModel):
    """Everything a person needs to decide, as recorded when the run stopped.

    Attributes:
        thread_id: The thread waiting.
        interrupt_id: LangGraph's id of the pending interrupt (set by ``pending_takeovers``).
        goal: The task's goal (the user's last request).
        reason: Why a person is needed.
        failure: The failure: kind, error type, message, attempts.
        done_steps: Steps already completed, with key inputs and outputs.
        committed_effects: Side effects committed in this thread (key, tool).
        uncertain_effects: Effects that may or may not have happened (key, tool, args).
        pending: The steps waiting on the decision (tool call id, tool, args, attempts).
        options: Each action and what it would trigger.
        drift: For a drifted result: the tool, the call, the ``previous`` and ``current``
            values and their ``difference`` (one line per changed field).
    """

    model_config = ConfigDict(frozen=True)

    thread_id: str
    interrupt_id: str | None = None
    goal: str = ""
    reason: str | None = None
    failure: dict[str, Any] | None = None
    done_steps: list[dict[str, Any]] = Field(default_factory=list)
    committed_effects: list[dict[str, Any]] = Field(default_factory=list)
    uncertain_effects: list[dict[str, Any]] = Field(default_factory=list)
    pending: list[dict[str, Any]] = Field(default_factory=list)
    options: dict[str, str] = Field(default_factory=dict)
    drift: dict[str, Any] | None = None

    def __str__(self) -> str:
        lines = [f"Thread {self.thread_id} needs a person: {self.reason or 'unknown reason'}"]
        if self.interrupt_id:
            # The id a decision names (``--takeover`` of ``taskpilots decide``).
            lines.append(f"Takeover: {self.interrupt_id}")
        if self.goal:
            lines.append(f"Goal: {self.goal}")
        lines += [
            f"Uncertain: {item.get('tool')} with key {item.get('key')}"
            for item in self.uncertain_effects
        ]
        if self.drift:
            lines.append(f"Drifted: {self.drift.get('tool')} answered differently than before")
            lines += [f"  {line}" for line in self.drift.get("difference") or []]
        lines += [f"  {action}: {trigger}" for action, trigger in self.options.items()]
        return "\n".join(lines)

    def _repr_html_(self) -> str | None:
        # Drawn by the notebook package once imported (see taskpilots_graph.reprs).
        return html_view(self)
