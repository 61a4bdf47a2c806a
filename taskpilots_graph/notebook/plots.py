"""Matplotlib figures of a run's recovery and of a batch's metrics (the ``notebooks`` extra).

Every function returns a :class:`matplotlib.figure.Figure` built without ``pyplot``: no
global figure state, nothing is shown; a notebook displays the returned figure, a script
calls ``fig.savefig(...)``. Each drawn element carries a ``gid`` (``tp-call``,
``tp-failure``, ``tp-wait``, ``tp-takeover``, ``tp-resume``, ``tp-degraded``,
``tp-uncertain``, ``tp-precheck``, ``tp-finished``, ``tp-failures``, ``tp-close``) so it can
be found again.

Example:
    >>> from taskpilots_graph.notebook import plots, timeline
    >>> fig = plots.plot_timeline(timeline(cp, "t-1"))  # doctest: +SKIP
    >>> fig = plots.plot_batch(cp)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from langgraph.checkpoint.base import BaseCheckpointSaver
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from taskpilots_graph._thread_index import thread_ids as store_thread_ids
from taskpilots_graph.events import Event, EventKind
from taskpilots_graph.metric_figures import turn_closes
from taskpilots_graph.metrics import RecoveryMetrics, recovery_metrics
from taskpilots_graph.replay import ReplayStep
from taskpilots_graph.threads import recovery_api

__all__ = ["batch_close_times", "close_times", "plot_batch", "plot_batch_metrics", "plot_timeline"]

_GREEN, _RED, _GREY = "#2da44e", "#cf222e", "#8c959f"
_ORANGE, _PURPLE, _BLUE = "#d4a72c", "#8250df", "#0969da"
_KIND_COLOURS = (
    "#cf222e",
    "#d4a72c",
    "#8250df",
    "#0969da",
    "#bc4c00",
    "#1a7f37",
    "#57606a",
    "#bf3989",
    "#116329",
    "#953800",
)


class _HasSteps(Protocol):
    @property
    def thread_id(self) -> str: ...

    @property
    def steps(self) -> tuple[ReplayStep, ...]: ...


@dataclass
class _Call:
    lane: str
    start: float
    end: float | None = None
    colour: str = _GREY


def _lanes(steps: Sequence[ReplayStep]) -> dict[str, int]:
    names = dict.fromkeys(s.tool for s in steps if s.tool and s.kind is EventKind.TOOL_INVOKED)
    # Tools met only after a resume (a pre-check, a decision) get a lane too.
    names |= dict.fromkeys(s.tool for s in steps if s.tool)
    return {name: i for i, name in enumerate(names)}


def _calls(steps: Sequence[ReplayStep], t: Mapping[int, float]) -> list[_Call]:
    """One bar per tool attempt: invoked → outcome; a call cut off by a crash ends grey."""
    calls: list[_Call] = []
    running: dict[str, _Call] = {}
    last = 0.0
    for s in steps:
        at = t[s.index]
        call_id = s.tool_call_id or s.tool or ""
        if s.kind is EventKind.TOOL_INVOKED and s.tool:
            running[call_id] = _Call(lane=s.tool, start=at)
            calls.append(running[call_id])
        elif s.kind in (EventKind.TOOL_SUCCEEDED, EventKind.TOOL_FAILED) and call_id in running:
            call = running.pop(call_id)
            call.end = at
            call.colour = _GREEN if s.kind is EventKind.TOOL_SUCCEEDED else _RED
        elif s.kind is EventKind.EFFECT_UNCERTAIN and call_id in running:
            running.pop(call_id).end = at
        elif s.kind is EventKind.EFFECT_RECONCILED and call_id in running:
            # Still open when a pre-check settles it: its process died mid-call, and the
            # pre-check is the resuming process's (tp.resume settles the ledger before it
            # logs run_resumed). The bar ends where the dead process stopped logging.
            running.pop(call_id).end = last
        elif s.kind is EventKind.RUN_RESUMED:
            # A call still open when the run resumes was cut off (a crash): it ends with the
            # last event its process logged.
            for call in running.values():
                call.end = last
            running.clear()
        last = at
    for call in running.values():
        call.end = last
    return calls


def _spans(
    steps: Sequence[ReplayStep], t: Mapping[int, float], opens: EventKind, closes: set[EventKind]
) -> list[tuple[float, float]]:
    spans: list[tuple[float, float]] = []
    start: float | None = None
    for s in steps:
        if s.kind is opens and start is None:
            start = t[s.index]
        elif s.kind in closes and start is not None:
            spans.append((start, t[s.index]))
            start = None
    if start is not None and steps:
        spans.append((start, t[steps[-1].index]))
    return spans


def _waits(steps: Sequence[ReplayStep], t: Mapping[int, float]) -> list[tuple[str, float, float]]:
    """Retry waits per lane: from ``retry_scheduled`` to the tool's next call (or the end)."""
    waits: list[tuple[str, float, float]] = []
    open_: dict[str, float] = {}
    for s in steps:
        if s.kind is EventKind.RETRY_SCHEDULED and s.tool:
            open_.setdefault(s.tool, t[s.index])
        elif s.kind in (EventKind.TOOL_INVOKED, EventKind.DEGRADED) and s.tool in open_:
            waits.append((s.tool, open_.pop(s.tool), t[s.index]))
    end = t[steps[-1].index] if steps else 0.0
    waits += [(lane, start, end) for lane, start in open_.items()]
    return waits


def _marker(ax: Axes, x: float, y: float, gid: str, marker: str, colour: str) -> None:
    (line,) = ax.plot([x], [y], linestyle="none", marker=marker, color=colour, markersize=9)
    line.set_gid(gid)


def plot_timeline(run: _HasSteps, *, title: str | None = None) -> Figure:
    """A run's recovery on a time axis: one lane per tool, every attempt as a bar.

    Drawn: each tool attempt (green ok, red failed, grey cut off by a crash), a red ``x``
    per failure, hatched orange retry waits, a ``v`` per degradation to a fallback, a
    diamond per uncertain effect, a labelled star per pre-check that settled an effect of
    unknown outcome (green ``done``: found, not executed again; orange ``not done``: run
    again with the same key), purple spans while a person is asked, dashed blue lines
    where the run resumed and a green line where it finished. Superseded events are left
    out.

    Args:
        run: A :class:`~taskpilots_graph.notebook.Timeline` or a
            :class:`~taskpilots_graph.Replay`.
        title: The figure title (default: names the thread).
    """
    steps = [s for s in run.steps if not s.superseded]
    origin = steps[0].at if steps else None
    t = {s.index: (s.at - origin).total_seconds() if origin else 0.0 for s in steps}
    lanes = _lanes(steps)
    span = max(t.values(), default=0.0) or 1.0
    thin = span / 400  # a call too quick to see still gets a visible bar

    fig = Figure(figsize=(10, 1.6 + 0.5 * max(len(lanes), 1)), layout="constrained")
    ax = fig.add_subplot()
    for call in _calls(steps, t):
        end = call.end if call.end is not None else call.start
        width = max(end - call.start, thin)
        bar = Rectangle((call.start, lanes[call.lane] - 0.3), width, 0.6, color=call.colour)
        bar.set_gid("tp-call")
        ax.add_patch(bar)
    for lane, start, end in _waits(steps, t):
        wait = Rectangle(
            (start, lanes[lane] - 0.15),
            max(end - start, thin),
            0.3,
            facecolor="none",
            edgecolor=_ORANGE,
            hatch="///",
        )
        wait.set_gid("tp-wait")
        ax.add_patch(wait)
    marks = {
        EventKind.TOOL_FAILED: ("tp-failure", "x", _RED),
        EventKind.DEGRADED: ("tp-degraded", "v", _ORANGE),
        EventKind.EFFECT_UNCERTAIN: ("tp-uncertain", "D", _PURPLE),
    }
    for s in steps:
        if s.kind in marks and s.tool in lanes:
            gid, marker, colour = marks[s.kind]
            _marker(ax, t[s.index], lanes[str(s.tool)], gid, marker, colour)
        # The moment a crash recovery turns on: the pre-check asked the service about the
        # effect the dead process left unrecorded. Labelled, so it reads without the legend.
        elif s.kind is EventKind.EFFECT_RECONCILED and s.tool in lanes:
            outcome = str(s.payload.get("outcome") or "")
            colour = _GREEN if outcome == "done" else _ORANGE
            x, y = t[s.index], lanes[str(s.tool)]
            _marker(ax, x, y, "tp-precheck", "*", colour)
            label = f"pre-check: {outcome.replace('_', ' ')}" if outcome else "pre-check"
            ax.annotate(
                label,
                (x, y),
                xytext=(6, 8),
                textcoords="offset points",
                color=colour,
                fontsize="small",
                fontweight="bold",
            )
    for start, end in _spans(steps, t, EventKind.TAKEOVER_REQUESTED, {EventKind.DECISION_RECORDED}):
        ax.axvspan(start, max(end, start + thin), color=_PURPLE, alpha=0.18).set_gid("tp-takeover")
    for s in steps:
        if s.kind is EventKind.RUN_RESUMED:
            ax.axvline(t[s.index], color=_BLUE, linestyle="--").set_gid("tp-resume")
        elif s.kind is EventKind.AGENT_FINISHED:
            colour = _RED if s.payload.get("status") == "failed" else _GREEN
            ax.axvline(t[s.index], color=colour, linewidth=2).set_gid("tp-finished")

    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.set_ylim(-0.7, max(len(lanes), 1) - 0.3)
    ax.set_xlim(-thin, span * 1.03 + thin)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started")
    ax.set_title(title or f"Recovery timeline of thread {run.thread_id!r}")
    ax.legend(
        handles=[
            Patch(color=_GREEN, label="call ok"),
            Patch(color=_RED, label="call failed"),
            Patch(color=_GREY, label="call cut off"),
            Patch(facecolor="none", edgecolor=_ORANGE, hatch="///", label="retry wait"),
            Line2D([], [], color=_GREEN, marker="*", linestyle="none", label="pre-check"),
            Patch(color=_PURPLE, alpha=0.18, label="person asked"),
            Line2D([], [], color=_BLUE, linestyle="--", label="resumed"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize="small",
    )
    return fig


# -- batches -----------------------------------------------------------------------------------


def close_times(events_by_thread: Mapping[str, Sequence[Event]]) -> list[float]:
    """Seconds from each turn's first tool failure to the run closing (I/O free).

    The samples behind ``RecoveryMetrics.time_to_close``: turns that ended ``failed`` or
    have not ended are left out; so are superseded events.
    """
    return [
        seconds
        for events in events_by_thread.values()
        for seconds in turn_closes(e for e in events if not e.superseded)[0]
    ]


def batch_close_times(
    checkpointer: BaseCheckpointSaver[Any], *, thread_ids: Iterable[str] | None = None
) -> list[float]:
    """:func:`close_times` of the store's threads (or of the threads named)."""
    cp = recovery_api(checkpointer)
    ids = list(thread_ids) if thread_ids is not None else store_thread_ids(cp)
    return close_times({t: cp.events(t) for t in dict.fromkeys(ids)})


def plot_batch_metrics(
    metrics: RecoveryMetrics, samples: Sequence[float], *, bins: int = 10
) -> Figure:
    """Failures by tool and kind (stacked bars) and the time-to-close distribution.

    Args:
        metrics: The batch's metrics (``tp.recovery_metrics``).
        samples: Seconds from a failure to the run closing (:func:`close_times`).
        bins: Histogram bins.
    """
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    tools = [t for t in metrics.tools if t.calls or t.failures]
    kinds = sorted({k for t in tools for k in t.failures})
    colour = {k: _KIND_COLOURS[i % len(_KIND_COLOURS)] for i, k in enumerate(kinds)}
    for y, stats in enumerate(tools):
        x = 0
        for kind in kinds:
            if n := stats.failures.get(kind, 0):
                (bar,) = left.barh(y, n, left=x, color=colour[kind], height=0.6)
                bar.set_gid("tp-failures")
                x += n
        left.text(x, y, f" {stats.calls} calls", va="center", fontsize="small")
    left.set_yticks(range(len(tools)), [t.tool for t in tools])
    left.set_ylim(-0.6, max(len(tools), 1) - 0.4)
    left.invert_yaxis()
    left.set_xlabel("failed attempts")
    left.set_title("Failures by tool and kind")
    if kinds:
        left.legend(handles=[Patch(color=colour[k], label=k) for k in kinds], fontsize="small")
    left.set_xlim(0, max((sum(t.failures.values()) for t in tools), default=0) * 1.4 + 1)

    if samples:
        right.hist(list(samples), bins=bins, color=_BLUE)
        for patch in right.patches:  # only the histogram's bins are patches here
            patch.set_gid("tp-close")
        if (mean := metrics.time_to_close.mean_seconds) is not None:
            right.axvline(mean, color=_RED, linestyle="--", label=f"mean {mean:.2f} s")
            right.legend(fontsize="small")
    else:
        right.text(0.5, 0.5, "no failure closed", ha="center", va="center")
    right.set_xlabel("seconds from the first tool failure to the run closing")
    right.set_ylabel("runs")
    right.set_title(f"Time to close ({len(samples)} runs)")
    return fig


def plot_batch(
    checkpointer: BaseCheckpointSaver[Any], *, thread_ids: Sequence[str] | None = None
) -> Figure:
    """:func:`plot_batch_metrics` of the store's runs (or of the runs named)."""
    metrics = recovery_metrics(checkpointer, thread_ids=thread_ids)
    return plot_batch_metrics(metrics, batch_close_times(checkpointer, thread_ids=thread_ids))
