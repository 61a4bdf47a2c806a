"""A takeover widget: a pending request with one button per option (ipywidgets).

Clicking a button validates the decision and calls :func:`taskpilots_graph.decide`; the run
continues in the notebook's process. ``provide_result`` takes the text box as the tool's
result, ``edit_args`` takes it as a JSON object of new arguments. A refused decision (invalid,
already answered) is shown under the buttons and kept in :attr:`TakeoverWidget.error`;
nothing changes then.

Example:
    >>> (request,) = tp.pending_takeovers(cp)  # doctest: +SKIP
    >>> notebook.takeover_widget(graph, request)  # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Callable
from html import escape
from typing import Any

import ipywidgets  # type: ignore[import-untyped]
from langgraph.pregel import Pregel

from taskpilots_graph.decisions import decide
from taskpilots_graph.errors import InvalidDecision, TaskPilotsError
from taskpilots_graph.notebook.html import takeover_html
from taskpilots_graph.takeover import Decision, TakeoverRequest

__all__ = ["TakeoverWidget", "takeover_widget"]


class TakeoverWidget:
    """A :class:`TakeoverRequest` shown with its options as buttons.

    Attributes:
        request: The request shown.
        buttons: One ``ipywidgets.Button`` per option, by action.
        value: The text box for ``provide_result`` (a result) and ``edit_args`` (JSON).
        status: What happened after the last click.
        widget: The whole ``ipywidgets.VBox`` (what the notebook displays).
        decision: The decision taken, once one was accepted.
        result: What ``decide`` returned (the run's values or its next interrupt).
        error: The last refused decision's error.
    """

    def __init__(
        self,
        graph: Pregel[Any, Any],
        request: TakeoverRequest,
        *,
        decided_by: str | None = None,
        on_decided: Callable[[Decision, Any], None] | None = None,
    ) -> None:
        self.request = request
        self.decision: Decision | None = None
        self.result: Any = None
        self.error: TaskPilotsError | None = None
        self._graph = graph
        self._decided_by = decided_by
        self._on_decided = on_decided
        self.buttons: dict[str, Any] = {}
        for action, trigger in request.options.items():
            button = ipywidgets.Button(description=action, tooltip=trigger)
            button.on_click(lambda _b, a=action: self.click(a))
            self.buttons[action] = button
        self.value = ipywidgets.Textarea(
            placeholder="provide_result: the tool's result · edit_args: a JSON object",
            layout=ipywidgets.Layout(width="100%"),
        )
        self.status = ipywidgets.HTML("")
        self.widget = ipywidgets.VBox(
            [
                ipywidgets.HTML(takeover_html(request)),
                self.value,
                ipywidgets.HBox(list(self.buttons.values())),
                self.status,
            ]
        )

    def _decision(self, action: str) -> Decision:
        text = str(self.value.value).strip()
        data: dict[str, Any] = {"action": action, "decided_by": self._decided_by}
        if action == "provide_result":
            data["result"] = text or None
        elif action == "edit_args":
            try:
                data["args"] = json.loads(text) if text else None
            except ValueError as exc:
                raise InvalidDecision(f"edit_args needs a JSON object of arguments: {exc}") from exc
        return Decision.model_validate(data)

    def click(self, action: str) -> Decision | None:
        """Decide ``action`` as if its button was clicked; ``None`` if it was refused."""
        try:
            decision = self._decision(action)
            result = decide(self._graph, self.request.thread_id, decision)
        except (TaskPilotsError, ValueError) as exc:
            # A refused decision changed nothing: show why and let the person choose again.
            self.error = exc if isinstance(exc, TaskPilotsError) else InvalidDecision(str(exc))
            self.status.value = f"<b>Refused:</b> {escape(str(exc))}"
            return None
        self.decision, self.result, self.error = decision, result, None
        for button in self.buttons.values():
            button.disabled = True  # a takeover is answered once
        self.status.value = f"<b>Decided:</b> {escape(action)}; the run continued."
        if self._on_decided is not None:
            self._on_decided(decision, result)
        return decision

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def __repr__(self) -> str:
        state = f"decided {self.decision.action}" if self.decision else "waiting"
        return (
            f"TakeoverWidget(thread={self.request.thread_id!r}, "
            f"options={list(self.buttons)}, {state})"
        )


def takeover_widget(
    graph: Pregel[Any, Any],
    request: TakeoverRequest,
    *,
    decided_by: str | None = None,
    on_decided: Callable[[Decision, Any], None] | None = None,
) -> TakeoverWidget:
    """A widget showing ``request`` with one button per option; a click calls ``decide``.

    Args:
        graph: The compiled graph that runs the thread.
        request: A pending request (from ``tp.pending_takeovers``).
        decided_by: Recorded in the event log as who decided.
        on_decided: Called with the decision and what ``decide`` returned.
    """
    return TakeoverWidget(graph, request, decided_by=decided_by, on_decided=on_decided)
