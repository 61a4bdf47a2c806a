"""Escaped, JavaScript-free HTML for the objects people inspect in a notebook.

Every function returns one ``<div class="tp-view ...">`` fragment that starts with a small
inline ``<style>`` (scoped to ``.tp-view``), so the views read the same in JupyterLab, in a
classic notebook and in a static ``nbconvert --to html`` export. Every value that comes
from a run (tool results, arguments, messages) is escaped: a tool that returned
``<script>`` shows the text ``<script>``, it never runs.

The module is I/O free; :mod:`taskpilots_graph.notebook.timeline` reads the store.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from html import escape
from typing import TYPE_CHECKING, Any

from taskpilots_graph.events import EventKind

if TYPE_CHECKING:
    from taskpilots_graph.ledger import LedgerEntry
    from taskpilots_graph.metrics import RecoveryMetrics
    from taskpilots_graph.replay import Replay, ReplayStep
    from taskpilots_graph.takeover import TakeoverRequest
    from taskpilots_graph.threads import ThreadInfo

__all__ = [
    "STEP_STATES",
    "STYLE",
    "VIEWS",
    "ledger_html",
    "metrics_html",
    "replay_html",
    "step_state",
    "takeover_html",
    "thread_html",
    "timeline_html",
    "what_happened",
]

_CELL = 160  # characters of a JSON value or message shown in one table cell

_COLOURS = {
    "ok": "#e6f4ea",
    "failed": "#fde7e9",
    "waiting": "#fff4ce",
    "degraded": "#ffe8d1",
    "uncertain": "#f9d0d5",
    "reconciled": "#e0f0ff",
    "human": "#efe3fb",
    "resumed": "#dcefff",
    "compensating": "#ffe0cc",
    "closed": "#c9ecd4",
    "info": "#ffffff",
}

STEP_STATES: tuple[str, ...] = tuple(_COLOURS)
"""The colour classes of timeline rows (``tp-s-<state>``), in legend order."""

# Jupyter styles every table it renders: JupyterLab (and nbconvert's HTML export) stripes
# rows with ``.jp-RenderedHTMLCommon tbody tr:nth-child(odd|even)`` and ``tr:hover``, right-
# aligns cells and sets the table's text colour from the theme; the classic notebook does the
# same with ``.rendered_html``. Those selectors are more specific than a scoped class, so
# the colours that carry meaning (row state, legend badges) and the text colour on them are
# ``!important`` and painted on the cells too: a row reads the same as its legend badge in
# every front end, light theme or dark.
STYLE = (
    "<style>"
    ".tp-view{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:13px;"
    "margin:4px 0;padding:2px 6px;color:#1f2328;background:#ffffff}"
    ".tp-view h4{margin:6px 0 4px;font-size:14px}"
    ".tp-view table{border-collapse:collapse;margin:2px 0 8px;table-layout:auto}"
    ".tp-view th,.tp-view td{border:1px solid #d0d7de !important;padding:2px 6px;"
    "text-align:left !important;vertical-align:top;color:#1f2328 !important}"
    ".tp-view th{background:#f6f8fa !important}"
    ".tp-view code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;"
    "white-space:pre-wrap;word-break:break-all}"
    ".tp-view .tp-summary{margin:2px 0 6px}"
    ".tp-view .tp-badge{display:inline-block;padding:0 6px;border-radius:8px;"
    "border:1px solid #8c959f;font-size:12px;color:#1f2328 !important}"
    ".tp-view tbody tr,.tp-view tbody tr>td{background:#ffffff !important}"
    + "".join(
        f".tp-view .tp-s-{state},.tp-view tbody tr.tp-s-{state}>td{{background:{c} !important}}"
        for state, c in _COLOURS.items()
    )
    + ".tp-view tbody tr.tp-superseded>td{text-decoration:line-through;"
    "color:#6e7781 !important}"
    "</style>"
)
"""The inline stylesheet every view starts with (no external CSS, no script)."""


# -- small helpers -----------------------------------------------------------------------------


def _text(value: Any, limit: int = _CELL) -> str:
    """``value`` as short, escaped text (JSON for non-strings)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        value = dict(value) if isinstance(value, Mapping) else value
        value = json.dumps(value, ensure_ascii=False, default=str, sort_keys=True)
    text = " ".join(value.split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return escape(text)


def _code(value: Any, limit: int = _CELL) -> str:
    text = _text(value, limit)
    return f"<code>{text}</code>" if text else ""


def _time(value: datetime | None) -> str:
    return "" if value is None else value.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3]


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def _table(head: Sequence[str], rows: Iterable[tuple[str, Sequence[str]]], css: str) -> str:
    """A table; ``rows`` are ``(row class, already escaped cells)``."""
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join(
        (f'<tr class="{escape(cls)}">' if cls else "<tr>")
        + "".join(f"<td>{cell}</td>" for cell in cells)
        + "</tr>"
        for cls, cells in rows
    )
    return f'<table class="{css}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _view(css: str, title: str, *parts: str) -> str:
    return f'<div class="tp-view {css}">{STYLE}<h4>{escape(title)}</h4>{"".join(parts)}</div>'


def _pairs(items: Iterable[tuple[str, str]], css: str) -> str:
    rows = [("", [f"<b>{escape(k)}</b>", v]) for k, v in items]
    return _table(["field", "value"], rows, css)


# -- timeline ----------------------------------------------------------------------------------

_STATES: dict[EventKind, str] = {
    EventKind.TOOL_SUCCEEDED: "ok",
    EventKind.TOOL_SKIPPED: "ok",
    EventKind.TOOL_FAILED: "failed",
    EventKind.MODEL_FAILED: "failed",
    EventKind.STUCK_DETECTED: "failed",
    EventKind.RETRY_SCHEDULED: "waiting",
    EventKind.TOOL_PAUSED: "waiting",
    EventKind.DEGRADED: "degraded",
    EventKind.EFFECT_UNCERTAIN: "uncertain",
    EventKind.EFFECT_RECONCILED: "reconciled",
    EventKind.TAKEOVER_REQUESTED: "human",
    EventKind.DECISION_RECORDED: "human",
    EventKind.RUN_RESUMED: "resumed",
    EventKind.RESUME_CONTEXT: "resumed",
    EventKind.REWOUND: "resumed",
    EventKind.COMPENSATED: "compensating",
}


def step_state(kind: EventKind, payload: Mapping[str, Any]) -> str:
    """The colour class of one event (one of :data:`STEP_STATES`)."""
    if kind is EventKind.AGENT_FINISHED:
        return "failed" if payload.get("status") == "failed" else "closed"
    return _STATES.get(kind, "info")


_SAME_CLOCK = 86_400.0  # a due time further than this from its log time is on another clock


def what_happened(step: ReplayStep) -> str:
    """The step's one-line summary, with a retry's due time on the timeline's own terms.

    A retry is due at a time of the engine's clock, the log's times are the wall clock's.
    Shown as the time column shows times (UTC time of day) and as how long after the row
    it falls, both read against the rows around it. An engine running on a clock of its own
    (``testing.fake_clock()`` in a drill, a different day altogether) is named as such
    rather than printed as a date beside today's times.
    """
    if step.kind is not EventKind.RETRY_SCHEDULED:
        return step.summary
    due = step.payload.get("retry_at")
    reason = f" ({step.payload['reason']})" if step.payload.get("reason") else ""
    tool = step.tool or "the tool"
    if not isinstance(due, int | float) or isinstance(due, bool):
        return f"retry of {tool} scheduled now{reason}"
    when = datetime.fromtimestamp(due, UTC)
    ahead = (when - step.at).total_seconds()
    if abs(ahead) > _SAME_CLOCK:
        return f"retry of {tool} scheduled on the engine's own (virtual) clock{reason}"
    return f"retry of {tool} due {_time(when)}, {ahead:+.3f} s after this row{reason}"


def _legend() -> str:
    badges = "".join(f'<span class="tp-badge tp-s-{s}">{s}</span> ' for s in STEP_STATES)
    return f'<div class="tp-legend">{badges}</div>'


def timeline_html(thread_id: str, steps: Sequence[ReplayStep], *, status: str | None = None) -> str:
    """A thread's events as a colour-coded table: when, who, what, which tool and attempt.

    Columns: ``#``, ``time`` (UTC), ``+s`` (seconds since the first event), ``actor``,
    ``event``, ``tool``, ``attempt``, ``what happened``. Superseded rows are struck through.
    """
    count = Counter(s.kind for s in steps if not s.superseded)
    facts = [
        f"{len(steps)} events",
        f"{count[EventKind.TOOL_INVOKED]} tool calls",
        f"{count[EventKind.TOOL_FAILED] + count[EventKind.MODEL_FAILED]} failures",
        f"{count[EventKind.RETRY_SCHEDULED]} retries",
        f"{count[EventKind.DEGRADED]} degradations",
        f"{count[EventKind.TAKEOVER_REQUESTED]} takeovers",
        f"{count[EventKind.RUN_RESUMED]} resumes",
    ]
    head = f"status <b>{escape(status)}</b> · " if status else ""
    summary = f'<div class="tp-summary">{head}{escape(", ".join(facts))}</div>'
    start = steps[0].at if steps else None
    rows = []
    for s in steps:
        cls = f"tp-s-{step_state(s.kind, s.payload)}" + (" tp-superseded" if s.superseded else "")
        offset = f"{(s.at - start).total_seconds():.3f}" if start is not None else ""
        rows.append(
            (
                cls,
                [
                    str(s.index),
                    _time(s.at),
                    offset,
                    escape(s.actor),
                    escape(s.kind.value),
                    _text(s.tool),
                    "" if s.attempt is None else str(s.attempt),
                    _text(what_happened(s), 240),
                ],
            )
        )
    table = _table(
        ["#", "time", "+s", "actor", "event", "tool", "attempt", "what happened"],
        rows,
        "tp-timeline-table",
    )
    return _view("tp-timeline", f"Timeline of thread {thread_id!r}", summary, _legend(), table)


def replay_html(replay: Replay) -> str:
    """A :class:`~taskpilots_graph.Replay` as a timeline table."""
    return timeline_html(replay.thread_id, replay.steps)


# -- ledger ------------------------------------------------------------------------------------

_LEDGER_COLUMNS: tuple[tuple[str, Callable[[LedgerEntry], str]], ...] = (
    ("key", lambda e: _code(e.key, 80)),
    ("thread", lambda e: _text(e.thread_id)),
    ("tool", lambda e: _text(e.tool)),
    ("status", lambda e: f'<span class="tp-badge">{escape(e.status.value)}</span>'),
    ("attempt", lambda e: str(e.attempt)),
    ("arguments", lambda e: _code(e.args)),
    ("result", lambda e: _code(e.result)),
    ("proof", lambda e: _code(e.proof)),
    ("error", lambda e: _code(e.error)),
    ("updated", lambda e: _time(e.updated_at)),
)
_LEDGER_STATES = {
    "committed": "ok",
    "compensated": "compensating",
    "failed": "failed",
    "uncertain": "uncertain",
    "intended": "waiting",
}


def ledger_html(entries: Sequence[LedgerEntry], *, thread_id: str | None = None) -> str:
    """Side-effect ledger entries as a table: key, tool, status, attempts, result, proof.

    Columns: ``key``, ``thread``, ``tool``, ``status``, ``attempt``, ``arguments``,
    ``result``, ``proof``, ``error``, ``updated``.
    """
    statuses = Counter(entry.status.value for entry in entries)
    by_status = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) or "no effects"
    summary = f'<div class="tp-summary">{len(entries)} entries: {escape(by_status)}</div>'
    rows = [
        (f"tp-s-{_LEDGER_STATES.get(e.status.value, 'info')}", [f(e) for _, f in _LEDGER_COLUMNS])
        for e in entries
    ]
    table = _table([head for head, _ in _LEDGER_COLUMNS], rows, "tp-ledger-table")
    title = "Side-effect ledger" + (f" of thread {thread_id!r}" if thread_id else "")
    return _view("tp-ledger", title, summary, table)


# -- takeover ----------------------------------------------------------------------------------


def _records(title: str, items: Sequence[Mapping[str, Any]], css: str) -> str:
    """A heading, then a list of dicts as a table with the union of their keys as columns."""
    if not items:
        return f"<h4>{title}</h4><p>none</p>"
    keys = list(dict.fromkeys(k for item in items for k in item))
    rows = [(css, [_code(item.get(k)) for k in keys]) for item in items]
    return f"<h4>{title}</h4>" + _table(keys, rows, "tp-records")


def takeover_html(request: TakeoverRequest) -> str:
    """What a person needs to decide: the failure, what is done, what is uncertain, options."""
    failure = request.failure or {}
    head = _pairs(
        [
            ("thread", _text(request.thread_id)),
            ("goal", _text(request.goal, 400)),
            ("reason", _text(request.reason, 400)),
            ("failure", _text(" ".join(str(failure.get(k, "")) for k in ("kind", "error_type")))),
            ("message", _text(failure.get("message"), 400)),
            ("interrupt", _text(request.interrupt_id)),
        ],
        "tp-takeover-head",
    )
    options = _table(
        ["option", "what it triggers"],
        [
            ("tp-s-human", [f"<b>{escape(action)}</b>", _text(trigger, 400)])
            for action, trigger in request.options.items()
        ],
        "tp-options",
    )
    # A drifted result (a tool answered differently after recovery) is shown when present.
    drift = getattr(request, "drift", None)
    drifted = (
        "<h4>Drifted result</h4>"
        + _pairs(
            [
                ("tool", _text(drift.get("tool"))),
                ("previous", _code(drift.get("previous"), 400)),
                ("current", _code(drift.get("current"), 400)),
                ("difference", _text("; ".join(map(str, drift.get("difference") or [])), 400)),
            ],
            "tp-drift",
        )
        if isinstance(drift, Mapping)
        else ""
    )
    return _view(
        "tp-takeover",
        f"Takeover requested on thread {request.thread_id!r}",
        head,
        drifted,
        _records("Uncertain effects", request.uncertain_effects, "tp-s-uncertain"),
        _records("Waiting steps", request.pending, "tp-s-waiting"),
        _records("Committed effects", request.committed_effects, "tp-s-ok"),
        _records("Done steps", request.done_steps, ""),
        "<h4>Options</h4>",
        options,
    )


# -- metrics and threads -----------------------------------------------------------------------


def _headline(metric: str, value: str, source: str) -> tuple[str, list[str]]:
    return "", [metric, escape(value), escape(source)]


def metrics_html(metrics: RecoveryMetrics) -> str:
    """The four recovery metrics, the runs by status and the per-tool figures."""
    lr, dup, ttc = metrics.local_recovery, metrics.duplicates, metrics.time_to_close
    tk, runs = metrics.takeover, metrics.runs
    per_100 = "n/a" if tk.per_100_runs is None else f"{tk.per_100_runs:.1f}"
    headline = _table(
        ["metric", "value", "from"],
        [
            _headline(
                "local recovery success rate",
                _percent(lr.rate),
                f"{lr.recovered} of {lr.recovered + lr.unrecovered} settled failed steps "
                f"recovered ({lr.recovered_automatically} automatically), {lr.pending} pending",
            ),
            _headline(
                "duplicate side-effect rate",
                _percent(dup.rate),
                f"{dup.duplicates} of {dup.effects} effects; upper bound "
                f"{_percent(dup.upper_rate)}",
            ),
            _headline(
                "mean time to close after a tool failure",
                _seconds(ttc.mean_seconds),
                f"{ttc.samples} closed, max {_seconds(ttc.max_seconds)}, "
                f"{ttc.failed} failed, {ttc.open} open",
            ),
            _headline(
                "human takeovers per 100 runs",
                per_100,
                f"{tk.takeovers} takeovers over {tk.runs} runs, {tk.answered} answered "
                f"(waited {tk.wait_seconds:.1f} s), {tk.pending} pending",
            ),
        ],
        "tp-metrics-table",
    )
    counts = ("total", "running", "waiting_tool", "awaiting_human", "closed", "failed")
    run_table = _table(counts, [("", [str(getattr(runs, c)) for c in counts])], "tp-runs")
    tools = _table(
        ["tool", "calls", "failures by kind", "retries", "degradations", "compensations"],
        [
            (
                "tp-s-failed" if t.failures else "",
                [
                    _text(t.tool),
                    str(t.calls),
                    _text(", ".join(f"{k}: {n}" for k, n in t.failures.items())),
                    str(t.retries),
                    str(t.degradations),
                    str(t.compensations),
                ],
            )
            for t in metrics.tools
        ],
        "tp-tools",
    )
    return _view(
        "tp-metrics",
        "Recovery metrics",
        headline,
        "<h4>Runs</h4>",
        run_table,
        "<h4>Tools</h4>",
        tools,
    )


def thread_html(info: ThreadInfo) -> str:
    """Where one thread stands, as a field/value table."""
    step = info.current_step
    pairs = [
        ("status", f'<span class="tp-badge">{escape(info.status)}</span>'),
        ("stage", _text(info.stage)),
        ("reason", _text(info.reason, 400)),
        ("takeover pending", "yes" if info.takeover_pending else "no"),
        (
            "current step",
            _text(f"{step.using} ({step.status}, {step.attempts} attempts)") if step else "",
        ),
        ("last event", _text(f"{info.last_event or ''} at {_time(info.last_event_at)}")),
        (
            "counts",
            escape(
                f"{info.events} events, {info.tool_calls} tool calls, {info.tool_failures} "
                f"failures, {info.retries} retries, {info.takeovers} takeovers, "
                f"{info.effects} effects"
            ),
        ),
    ]
    return _view("tp-thread", f"Thread {info.thread_id!r}", _pairs(pairs, "tp-thread-table"))


VIEWS: Mapping[str, Callable[[Any], str]] = {
    "taskpilots_graph.metrics.RecoveryMetrics": metrics_html,
    "taskpilots_graph.replay.Replay": replay_html,
    "taskpilots_graph.takeover.TakeoverRequest": takeover_html,
    "taskpilots_graph.threads.ThreadInfo": thread_html,
}
"""The HTML view of each run object, by qualified type name (registered on import)."""
