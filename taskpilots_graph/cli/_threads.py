"""Read commands: ``threads``, ``show THREAD`` and ``metrics``."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer

from taskpilots_graph.cli._common import (
    DbOption,
    JsonOption,
    emit_json,
    guarded,
    open_store,
    say,
    say_block,
    stdout,
    to_jsonable,
    warn_corrupt,
)

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

__all__ = ["parse_since", "print_metrics", "register"]

STATUSES = ("running", "waiting_tool", "awaiting_human", "closed", "failed")
THREAD_COLUMNS = ["thread_id", "status", "step", "last_event", "events", "effects", "unsettled"]
NO_WRAP = frozenset({"thread_id", "status", "seq", "kind", "metric"})
SHORT = frozenset({"value", "attempt", "events", "effects", "tool", "time", "updated"})
GAP = 2  # spaces between columns
MIN_WIDTH = 6  # the narrowest a free-text column gets: "abcd…"
PAYLOAD_CHARS = 60  # a timeline row stays on one line in a 120-column terminal

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_since(text: str | None) -> datetime | None:
    """``--since``: an ISO time (UTC unless it says otherwise) or an age like ``24h``, ``7d``.

    Raises:
        ConfigurationError: For anything else.
    """
    from taskpilots_graph.errors import ConfigurationError

    if text is None:
        return None
    if match := _RELATIVE.match(text.strip()):
        amount, unit = float(match.group(1)), match.group(2)
        return datetime.now(UTC) - timedelta(**{_UNITS[unit]: amount})
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigurationError(
            f"--since {text!r} is neither an ISO time (2026-01-31T08:00) nor an age (30m, 24h, 7d)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _table(title: str, rows: list[dict[str, Any]], columns: list[str] | None = None) -> Table:
    """A table that fits the terminal: a long value ends in "…", no cell ever wraps.

    Wrapping inside a cell breaks words into fragments at 80 columns (``create_ticket``
    printed as ``cre/ate/_ti/cke/t``). Identifier columns keep their width and free text
    gives way; ``--json`` has every value whole.
    """
    from rich.table import Table

    columns = columns or [
        k
        for k, v in (rows[0] if rows else {}).items()
        if v is None or isinstance(v, str | int | float | bool)
    ]
    cells = [["" if row.get(c) is None else str(row.get(c)) for c in columns] for row in rows]
    natural = [
        max([len(c.replace("_", " ")), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)
    ]
    fixed = [c in NO_WRAP or c in SHORT for c in columns]
    room = stdout().width - GAP * (len(columns) - 1)
    room -= sum(w for w, f in zip(natural, fixed, strict=True) if f)
    flexible = sum(w for w, f in zip(natural, fixed, strict=True) if not f)
    widths = [
        w if f or flexible <= room else max(MIN_WIDTH, room * w // flexible)
        for w, f in zip(natural, fixed, strict=True)
    ]
    table = Table(
        title=title, title_justify="left", box=None, pad_edge=False, padding=(0, GAP, 0, 0)
    )
    for column, width in zip(columns, widths, strict=True):
        table.add_column(column.replace("_", " "), no_wrap=True, max_width=width)
    for row in cells:
        table.add_row(*(_fit(cell, width) for cell, width in zip(row, widths, strict=True)))
    return table


def _line(text: str, **style: Any) -> Text:
    """One line of output cut with "…" at the terminal's edge instead of wrapping."""
    from rich.text import Text

    return Text(_fit(text, stdout().width), no_wrap=True, **style)


def threads(
    db: DbOption = None,
    status: Annotated[
        list[str] | None,
        typer.Option(
            "--status",
            metavar="STATUS",
            help=f"Only threads in this status ({', '.join(STATUSES)}).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """List the threads in the store with their status."""
    from taskpilots_graph.errors import ConfigurationError

    with guarded():
        if unknown := sorted(set(status or ()) - set(STATUSES)):
            raise ConfigurationError(
                f"unknown status {', '.join(unknown)}; use one of {', '.join(STATUSES)}"
            )
        from taskpilots_graph.thread_listing import list_threads

        with open_store(db) as cp:
            infos = list_threads(cp)
        warn_corrupt([key for info in infos for key in info.corrupt_events])
        rows = [to_jsonable(info) for info in infos]
        if status:
            rows = [r for r in rows if r.get("status") in status]
        if as_json:
            emit_json(rows)
            return
        if not rows:
            stdout().print("no threads")
            return
        for row in rows:
            step = row.get("current_step")
            row["step"] = f"{step.get('tool')} ({step.get('status')})" if step else None
            row["unsettled"] = _unsettled(row)
        stdout().print(_table(f"{len(rows)} thread(s)", rows, THREAD_COLUMNS))


def _unsettled(row: dict[str, Any]) -> str | None:
    """Effects not settled yet (nothing hidden behind a status): "1 intended, 2 uncertain"."""
    parts = [
        f"{row[name]} {label}"
        for name, label in (("intended_effects", "intended"), ("uncertain_effects", "uncertain"))
        if row.get(name)
    ]
    return ", ".join(parts) or None


def _event_row(event: Any) -> dict[str, Any]:
    import json

    payload = json.dumps(dict(event.payload), ensure_ascii=False, default=str, sort_keys=True)
    return {
        "seq": event.seq,
        "time": event.ts.strftime("%Y-%m-%d %H:%M:%S"),
        "kind": event.kind.value + (" (superseded)" if event.superseded else ""),
        "payload": _fit(payload, PAYLOAD_CHARS),
    }


def _ledger_row(entry: Any) -> dict[str, Any]:
    return {
        "tool": entry.tool,
        "status": str(entry.status.value),
        "attempt": entry.attempt,
        "updated": entry.updated_at.strftime("%Y-%m-%d %H:%M:%S"),
        "key": entry.key,
    }


def show(
    thread: Annotated[str, typer.Argument(metavar="THREAD", help="The thread id.")],
    db: DbOption = None,
    events: Annotated[
        bool, typer.Option("--events", help="Also list the raw events, one row each.")
    ] = False,
    replay: Annotated[
        bool, typer.Option("--replay", hidden=True, help="Kept for old scripts: the default.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Tell a thread's story: what ran, where it stopped, what was recovered.

    The story is the run replayed from its event log, with the moments the process
    stopped marked; then the ledger and any takeover waiting on a person. ``--json`` has
    everything, uncut (the thread, its events, ledger, takeover and replay steps).
    """
    from taskpilots_graph.decisions import pending_takeovers

    with guarded():
        from taskpilots_graph.replay import replay as replay_thread
        from taskpilots_graph.threads import thread_info

        with open_store(db) as cp:
            info = thread_info(cp, thread)  # ThreadNotFound for an unknown id
            log = cp.events(thread)
            ledger = cp.ledger(thread)
            requests = pending_takeovers(cp, thread_ids=[thread])
            story = replay_thread(cp, thread)
        if as_json:
            emit_json(
                {
                    "thread": to_jsonable(info),
                    "events": to_jsonable(log),
                    "ledger": to_jsonable(ledger),
                    "takeover": to_jsonable(requests[0]) if requests else None,
                    "replay": story.as_dict(),
                }
            )
            return
        _print_thread(to_jsonable(info), story, log if events else None, ledger, requests)


def _print_thread(
    summary: dict[str, Any], story: Any, log: Any, ledger: Any, requests: Any
) -> None:
    out = stdout()
    counts = (
        f"{summary.get('events')} events, {summary.get('tool_calls')} tool calls, "
        f"{summary.get('tool_failures')} failures, {summary.get('effects')} effects"
    )
    out.print(_line(f"thread {summary['thread_id']}: {summary.get('status')} ({counts})"))
    step = summary.get("current_step")
    if isinstance(step, dict):
        text = f"{step.get('tool')} ({step.get('status')}, attempt {step.get('attempts')})"
        out.print(_line(f"current step: {text}"))
    for name in ("reason", "intended_effects", "uncertain_effects"):
        if summary.get(name):
            out.print(_line(f"{name.replace('_', ' ')}: {summary[name]}"))
    out.print()
    for line in _story_lines(story):
        out.print(_line(line))
    if log is not None:
        out.print(_table(f"\nevents ({len(log)})", [_event_row(e) for e in log]))
    if ledger:
        out.print(_table(f"\nledger ({len(ledger)} entries)", [_ledger_row(e) for e in ledger]))
    else:
        out.print("\nledger: no side effects recorded")
    for request in requests:
        out.print("\n[bold yellow]takeover requested[/bold yellow]")
        say_block(str(request))


RESULTS = frozenset({"tool_succeeded", "tool_failed", "tool_paused", "tool_skipped"})
AFTERMATH = frozenset({"run_resumed", "effect_reconciled", "effect_uncertain", "intent_awaited"})


def _story_lines(story: Any) -> list[str]:
    """The replay, one line per step, with a line where the process stopped mid call.

    A call whose result never reached the log, followed by a resume or a reconciliation,
    is where the process died: the replay alone shows the next step seconds later with
    nothing in between, which reads as if the engine hesitated.
    """
    lines = [
        f"{story.thread_id}: {len(story.steps)} steps, {len(story.tool_calls)} tool calls, "
        f"{len(story.failures)} failures"
    ]
    open_calls: dict[str, Any] = {}
    for step in story.steps:
        kind = step.kind.value
        if kind == "tool_invoked":
            open_calls[step.tool_call_id or step.key or str(step.seq)] = step
        elif kind in RESULTS:
            open_calls.pop(step.tool_call_id or step.key or str(step.seq), None)
        elif kind in AFTERMATH and open_calls:
            started = max(s.at for s in open_calls.values())
            tools = ", ".join(sorted({s.tool or "?" for s in open_calls.values()}))
            gap = (step.at - started).total_seconds()
            lines.append(
                f"{'':>6}>> process stopped during {tools} (no result); resumed {gap:.1f} s later"
            )
            open_calls.clear()
        lines.extend(step.render().splitlines())
    return lines


def metrics(
    db: DbOption = None,
    since: Annotated[
        str | None,
        typer.Option(
            "--since", metavar="WHEN", help="Only runs since this ISO time or age (30m, 24h, 7d)."
        ),
    ] = None,
    thread: Annotated[
        list[str] | None,
        typer.Option("--thread", metavar="THREAD", help="Only this thread (repeatable)."),
    ] = None,
    prometheus: Annotated[
        bool, typer.Option("--prometheus", help="Print Prometheus text exposition format.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Print the four recovery metrics, then failures and retries per tool."""
    with guarded():
        from taskpilots_graph.metrics import recovery_metrics

        start = parse_since(since)
        with open_store(db) as cp:
            result = recovery_metrics(cp, since=start, thread_ids=thread or None)
        warn_corrupt(result.corrupt_events)
        if prometheus:
            typer.echo(result.to_prometheus(), nl=False)
            return
        data = to_jsonable(result.as_dict())
        if as_json:
            emit_json(data)
            return
        print_metrics(data)


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}{unit}"
    return f"{value}{unit}"


def _section(data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name)
    return value if isinstance(value, dict) else {}


def print_metrics(data: dict[str, Any]) -> None:
    """The four recovery metrics first, then runs, per-tool statistics and totals.

    Each metric is a line with its value, then an indented line saying what it is made
    of: the explanations are sentences, which wrap between words at any width.
    """
    out = stdout()
    local = _section(data, "local_recovery")
    dup = _section(data, "duplicate_side_effects")
    close = _section(data, "time_to_close")
    human = _section(data, "human_takeover")
    totals = _section(data, "totals")
    wait = _fmt(human.get("mean_wait_seconds"), " s")
    local_from = (
        f"{local.get('recovered')} of {local.get('failures')} failed tool steps recovered, "
        f"{local.get('pending')} pending"
    )
    if not local.get("failures"):
        local_from = "no tool step failed"
    if resumes := totals.get("resumes"):
        # A crash is not a tool failure, so the rate leaves it out; say what happened.
        local_from += (
            f"; {resumes} run(s) resumed after a stop, each from its last checkpoint "
            "(interrupted effects reconciled, not repeated)"
        )
    metrics = [
        ("local recovery success rate", _fmt(local.get("rate")), local_from),
        (
            "duplicate side-effect rate",
            _fmt(dup.get("rate")),
            f"{dup.get('duplicates')} duplicates in {dup.get('effects')} effects, "
            f"{dup.get('possible_duplicates')} possible",
        ),
        (
            "mean time to close after a tool failure",
            _fmt(close.get("mean_seconds"), " s"),
            f"{close.get('samples')} closed, {close.get('open')} open, "
            f"{close.get('failed')} failed",
        ),
        (
            "human takeovers per 100 runs",
            _fmt(human.get("per_100_runs")),
            f"{human.get('takeovers')} in {human.get('runs')} runs, "
            f"{human.get('pending')} pending, mean wait {wait}",
        ),
    ]
    out.print("[bold]recovery metrics[/bold]")
    for name, value, source in metrics:
        out.print(f"  {name}: [bold]{value}[/bold]")
        say(source, indent=6)
    if decisions := human.get("decisions"):
        say("decisions: " + ", ".join(f"{k}={v}" for k, v in decisions.items()))
    if runs := _section(data, "runs"):
        say("runs: " + ", ".join(f"{k}={v}" for k, v in runs.items()))
    tool_rows = [
        {
            "tool": name,
            **{k: v for k, v in stats.items() if k != "failures"},
            "failures": ", ".join(f"{k}={v}" for k, v in (stats.get("failures") or {}).items())
            or "0",
        }
        for name, stats in _section(data, "tools").items()
    ]
    if tool_rows:
        out.print(_table("per tool", tool_rows, list(tool_rows[0])))
    if totals:
        say("totals: " + ", ".join(f"{k}={v}" for k, v in totals.items()))


def register(app: typer.Typer) -> None:
    """Add ``threads``, ``show`` and ``metrics`` to ``app``."""
    app.command("threads", short_help="List the threads and their status.")(threads)
    app.command("show", short_help="Tell a thread's story: steps, stops, recovery.")(show)
    app.command("metrics", short_help="The four recovery metrics; failures per tool.")(metrics)
