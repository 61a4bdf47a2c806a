"""The matplotlib figures: the expected artists for the known runs, drawn without a display.

Elements are counted by their ``gid`` (one per call bar, failure marker, wait, takeover span,
resume line, ...), so a figure that forgot a failure or drew a wait twice fails.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import matplotlib

matplotlib.use("Agg")  # before anything imports pyplot: no display in tests

import pytest
from _notebook_runs import Runs, build_runs
from matplotlib.figure import Figure

import taskpilots_graph as tp
from taskpilots_graph import notebook
from taskpilots_graph.metrics import (
    DuplicateEffects,
    LocalRecovery,
    RunCounts,
    TakeoverCost,
    TimeToClose,
)
from taskpilots_graph.replay import replay


@pytest.fixture
def runs(sqlite_path: str) -> Iterator[Runs]:
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as cp:
        cp.setup()
        yield build_runs(cp)


def gids(fig: Figure) -> Counter[str]:
    """How many artists of each ``tp-*`` gid the figure's axes hold."""
    found: Counter[str] = Counter()
    for ax in fig.axes:
        for artist in [*ax.patches, *ax.lines]:
            gid = artist.get_gid()
            if gid and gid.startswith("tp-"):
                found[gid] += 1
    return found


def renders(fig: Figure) -> bool:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue().startswith(b"\x89PNG")


def colours(fig: Figure, gid: str) -> list[str]:
    return [
        matplotlib.colors.to_hex(p.get_facecolor())
        for p in fig.axes[0].patches
        if p.get_gid() == gid
    ]


def test_timeline_of_retried_run(runs: Runs) -> None:
    """Three kb_search attempts (two red, one green), two waits, one ticket call, finished."""
    fig = notebook.plot_timeline(notebook.timeline(runs.cp, "t-retry"))
    assert isinstance(fig, Figure)
    assert gids(fig) == Counter({"tp-call": 4, "tp-failure": 2, "tp-wait": 2, "tp-finished": 1})
    assert colours(fig, "tp-call") == ["#cf222e", "#cf222e", "#2da44e", "#2da44e"]
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["kb_search", "create_ticket"]
    assert "t-retry" in ax.get_title()
    assert renders(fig)


def test_timeline_of_degraded_run(runs: Runs) -> None:
    """A failed kb_search, the degradation marker, then the fallback's call on its own lane."""
    fig = notebook.plot_timeline(replay(runs.cp, "t-degrade"))  # a Replay works too
    assert gids(fig) == Counter({"tp-call": 2, "tp-failure": 1, "tp-degraded": 1, "tp-finished": 1})
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["kb_search", "kb_backup"]


def test_timeline_of_takeover_then_decision(runs: Runs) -> None:
    """The uncertain charge, the span while a person is asked, the resume, the close."""
    waiting = notebook.plot_timeline(notebook.timeline(runs.cp, "t-takeover"))
    assert gids(waiting) == Counter(
        {"tp-call": 2, "tp-failure": 1, "tp-uncertain": 1, "tp-takeover": 1}
    )
    tp.decide(runs.takeover_graph, "t-takeover", tp.Decision(action="skip"))
    fig = notebook.plot_timeline(notebook.timeline(runs.cp, "t-takeover"))
    assert gids(fig) == Counter(
        {
            "tp-call": 2,
            "tp-failure": 1,
            "tp-uncertain": 1,
            "tp-takeover": 1,
            "tp-resume": 1,
            "tp-finished": 1,
        }
    )
    assert renders(fig)


def _event(seq: int, kind: tp.EventKind, **payload: object) -> tp.Event:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    return tp.Event("t-crash", seq, kind, start + timedelta(seconds=seq), payload)


def test_call_cut_off_by_a_crash_is_grey() -> None:
    """A call with no outcome before the run resumed ends grey where its process stopped."""
    from taskpilots_graph.replay import build_replay

    call = {"tool": "create_ticket", "tool_call_id": "c1", "key": "k1"}
    events = [
        _event(1, tp.EventKind.AGENT_STARTED, goal="go"),
        _event(2, tp.EventKind.TOOL_INVOKED, **call, args={}),
        _event(3, tp.EventKind.RUN_RESUMED, next=["act"]),
        _event(4, tp.EventKind.EFFECT_RECONCILED, **call, outcome="done"),
        _event(5, tp.EventKind.AGENT_FINISHED, status="closed"),
    ]
    fig = notebook.plot_timeline(build_replay("t-crash", events))
    assert gids(fig) == Counter({"tp-call": 1, "tp-resume": 1, "tp-precheck": 1, "tp-finished": 1})
    assert colours(fig, "tp-call") == ["#8c959f"]
    (bar,) = [p for p in fig.axes[0].patches if p.get_gid() == "tp-call"]
    assert bar.get_x() == 1.0  # invoked one second after the start, cut off right away
    assert bar.get_width() < 0.1


@pytest.mark.parametrize(("outcome", "colour"), [("done", "#2da44e"), ("not_done", "#d4a72c")])
def test_pre_check_after_a_crash_is_marked_and_labelled(outcome: str, colour: str) -> None:
    """The pre-check that settled the effect a crash left unrecorded is a labelled star on
    the tool's lane, at the moment it ran, coloured by what it found; the call the crash
    cut off ends where the dead process stopped."""
    from taskpilots_graph.replay import build_replay

    call = {"tool": "create_ticket", "tool_call_id": "c1", "key": "k1"}
    events = [
        _event(1, tp.EventKind.AGENT_STARTED, goal="go"),
        _event(2, tp.EventKind.TOOL_INVOKED, tool="lookup", tool_call_id="c0", args={}),
        _event(3, tp.EventKind.TOOL_SUCCEEDED, tool="lookup", tool_call_id="c0", result="x"),
        _event(4, tp.EventKind.TOOL_INVOKED, **call, args={}),
        # tp.resume settles the ledger first, then logs that the run resumed.
        _event(9, tp.EventKind.EFFECT_RECONCILED, **call, outcome=outcome),
        _event(10, tp.EventKind.RUN_RESUMED, next=["act"]),
        _event(11, tp.EventKind.AGENT_FINISHED, status="closed"),
    ]
    fig = notebook.plot_timeline(build_replay("t-crash", events))
    ax = fig.axes[0]
    (star,) = [line for line in ax.lines if line.get_gid() == "tp-precheck"]
    assert list(star.get_xdata()) == [8.0]  # nine seconds after the start, before resuming
    assert list(star.get_ydata()) == [1]  # the create_ticket lane, not lookup's
    # The cut-off call ends where its process stopped, not at the resumer's pre-check.
    cut = [p for p in ax.patches if p.get_gid() == "tp-call"][-1]
    assert cut.get_x() == 3.0
    assert cut.get_width() < 0.1
    assert star.get_marker() == "*"
    assert matplotlib.colors.to_hex(star.get_color()) == colour
    labels = [text.get_text() for text in ax.texts]
    assert labels == [f"pre-check: {outcome.replace('_', ' ')}"]
    legend = ax.get_legend()
    assert legend is not None
    assert "pre-check" in [text.get_text() for text in legend.get_texts()]
    assert renders(fig)


def test_batch_metrics(runs: Runs) -> None:
    """One bar segment per (tool, failure kind); one histogram sample per closed run."""
    tp.decide(runs.takeover_graph, "t-takeover", tp.Decision(action="skip"))
    fig = notebook.plot_batch(runs.cp)
    metrics = tp.recovery_metrics(runs.cp)
    pairs = sum(len(t.failures) for t in metrics.tools)
    assert pairs == 4  # kb_search transient + outage, charge transient + uncertain
    found = gids(fig)
    assert found["tp-failures"] == pairs
    left, right = fig.axes
    widths = sorted(p.get_width() for p in left.patches if p.get_gid() == "tp-failures")
    assert widths == [1, 1, 1, 2]
    assert [t.get_text() for t in left.get_yticklabels()] == [t.tool for t in metrics.tools]
    samples = notebook.batch_close_times(runs.cp)
    assert len(samples) == 3 == metrics.time_to_close.samples
    assert sum(samples) / 3 == pytest.approx(metrics.time_to_close.mean_seconds)
    heights = [p.get_height() for p in right.patches if p.get_gid() == "tp-close"]
    assert sum(heights) == 3
    assert "3 runs" in right.get_title()
    assert renders(fig)


def test_batch_metrics_without_failures() -> None:
    """An empty batch still gives a figure, saying no failure closed."""
    empty = tp.RecoveryMetrics(
        local_recovery=LocalRecovery(),
        duplicates=DuplicateEffects(),
        time_to_close=TimeToClose(),
        takeover=TakeoverCost(),
        runs=RunCounts(),
    )
    fig = notebook.plot_batch_metrics(empty, [])
    assert gids(fig) == Counter()
    assert "no failure closed" in [t.get_text() for t in fig.axes[1].texts]
    assert renders(fig)
