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
    stdout,
    to_jsonable,
    warn_corrupt,
)

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["parse_since", "register"]

STATUSES = ("running", "waiting_tool", "awaiting_human", "closed", "failed")
THREAD_COLUMNS = ["thread_id", "status", "step", "last_event", "events", "effects", "unsettled"]
NO_WRAP = frozenset({"thread_id", "status", "seq", "kind", "metric", "key"})
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
    match = _RELATIVE.match(text.strip())
    if match:
        amount, unit = float(match.group(1)), match.group(2)
        return datetime.now(UTC) - timedelta(**{_UNITS[unit]: amount})
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigurationError(
            f"--since {text!r} is neither an ISO time (2026-01-31T08:00) nor an age (30m, 24h, 7d)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _table(title: str, rows: list[dict[str, Any]], columns: list[str] | None = None) -> Table:
    from rich.table import Table

    columns = columns or [
        k
        for k, v in (rows[0] if rows else {}).items()
        if v is None or isinstance(v, str | int | float | bool)
    ]
    table = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        table.add_column(column.replace("_", " "), overflow="fold", no_wrap=column in NO_WRAP)
    for row in rows:
        table.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    return table


def threads(
    db: DbOption = None,
    status: Annotated[
        list[str] | None,
        typer.Option("--status", help=f"Only threads in this status ({', '.join(STATUSES)})."),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """List the threads in the store with their status."""
    from taskpilots_graph.errors import ConfigurationError

    with guarded():
        unknown = sorted(set(status or ()) - set(STATUSES))
        if unknown:
            raise ConfigurationError(
                f"unknown status {', '.join(unknown)}; use one of {', '.join(STATUSES)}"
            )
        from taskpilots_graph.threads import list_threads

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
    if len(payload) > PAYLOAD_CHARS:
        payload = payload[: PAYLOAD_CHARS - 1] + "…"
    return {
        "seq": event.seq,
        "time": event.ts.strftime("%Y-%m-%d %H:%M:%S"),
        "kind": event.kind.value + (" (superseded)" if event.superseded else ""),
        "payload": payload,
    }


def _ledger_row(entry: Any) -> dict[str, Any]:
    return {
        "key": entry.key,
        "tool": entry.tool,
        "status": str(entry.status.value),
        "attempt": entry.attempt,
        "updated": entry.updated_at.isoformat(timespec="seconds"),
    }


def show(
    thread: Annotated[str, typer.Argument(help="The thread id.")],
    db: DbOption = None,
    replay: Annotated[
        bool, typer.Option("--replay", help="Also replay the run step by step from its events.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Show one thread: status and current step, timeline, ledger, pending takeover."""
    from taskpilots_graph.runner import pending_takeovers

    with guarded():
        from taskpilots_graph.threads import thread_info

        with open_store(db) as cp:
            info = thread_info(cp, thread)  # ThreadNotFound for an unknown id
            events = cp.events(thread)
            ledger = cp.ledger(thread)
            requests = pending_takeovers(cp, thread_ids=[thread])
            rendered = _replay(cp, thread) if replay else None
        if as_json:
            data: dict[str, Any] = {
                "thread": to_jsonable(info),
                "events": to_jsonable(events),
                "ledger": to_jsonable(ledger),
                "takeover": to_jsonable(requests[0]) if requests else None,
            }
            if replay:
                data["replay"] = rendered
            emit_json(data)
            return
        out = stdout()
        summary = to_jsonable(info)
        out.print(f"[bold]thread {thread}[/bold]  status: [bold]{summary.get('status')}[/bold]")
        step = summary.get("current_step")
        if isinstance(step, dict):
            summary["current_step"] = (
                f"{step.get('tool')} ({step.get('status')}, attempt {step.get('attempts')})"
            )
        for key, value in summary.items():
            if key not in ("thread_id", "status") and value not in (None, "", [], {}):
                out.print(f"  {key.replace('_', ' ')}: {value}", markup=False)
        out.print(_table(f"timeline ({len(events)} events)", [_event_row(e) for e in events]))
        if ledger:
            out.print(_table(f"ledger ({len(ledger)} entries)", [_ledger_row(e) for e in ledger]))
        else:
            out.print("ledger: no side effects recorded")
        for request in requests:
            out.print("[bold yellow]takeover requested[/bold yellow]")
            out.print(str(request), markup=False)
        if rendered is not None:
            out.print("[bold]replay[/bold]")
            out.print(rendered, markup=False)


def _replay(cp: Any, thread: str) -> str:
    from taskpilots_graph.replay import replay

    text: str = replay(cp, thread).render()
    return text


def metrics(
    db: DbOption = None,
    since: Annotated[
        str | None,
        typer.Option("--since", help="Only runs since this ISO time or age (30m, 24h, 7d)."),
    ] = None,
    thread: Annotated[
        list[str] | None, typer.Option("--thread", help="Only this thread (repeatable).")
    ] = None,
    prometheus: Annotated[
        bool, typer.Option("--prometheus", help="Print Prometheus text exposition format.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Print the four recovery metrics, plus failures, retries and degradations per tool."""
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
        _print_metrics(data)


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}{unit}"
    return f"{value}{unit}"


def _section(data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name)
    return value if isinstance(value, dict) else {}


def _print_metrics(data: dict[str, Any]) -> None:
    """The four recovery metrics first, then runs, per-tool statistics and totals."""
    out = stdout()
    local = _section(data, "local_recovery")
    dup = _section(data, "duplicate_side_effects")
    close = _section(data, "time_to_close")
    human = _section(data, "human_takeover")
    wait = _fmt(human.get("mean_wait_seconds"), " s")
    rows = [
        {
            "metric": "local recovery success rate",
            "value": _fmt(local.get("rate")),
            "from": f"{local.get('recovered')} of {local.get('failures')} failures recovered, "
            f"{local.get('pending')} pending",
        },
        {
            "metric": "duplicate side-effect rate",
            "value": _fmt(dup.get("rate")),
            "from": f"{dup.get('duplicates')} duplicates in {dup.get('effects')} effects, "
            f"{dup.get('possible_duplicates')} possible",
        },
        {
            "metric": "mean time to close after a tool failure",
            "value": _fmt(close.get("mean_seconds"), " s"),
            "from": f"{close.get('samples')} closed, {close.get('open')} open, "
            f"{close.get('failed')} failed",
        },
        {
            "metric": "human takeovers per 100 runs",
            "value": _fmt(human.get("per_100_runs")),
            "from": f"{human.get('takeovers')} in {human.get('runs')} runs, "
            f"{human.get('pending')} pending, mean wait {wait}",
        },
    ]
    out.print(_table("recovery metrics", rows, ["metric", "value", "from"]))
    if decisions := human.get("decisions"):
        out.print("decisions: " + ", ".join(f"{k}={v}" for k, v in decisions.items()))
    if runs := _section(data, "runs"):
        out.print("runs: " + ", ".join(f"{k}={v}" for k, v in runs.items()))
    tools = _section(data, "tools")
    if tools:
        tool_rows = []
        for name, stats in tools.items():
            failures = stats.get("failures") or {}
            tool_rows.append(
                {
                    "tool": name,
                    **{k: v for k, v in stats.items() if k != "failures"},
                    "failures": ", ".join(f"{k}={v}" for k, v in failures.items()) or "0",
                }
            )
        out.print(_table("per tool", tool_rows, list(tool_rows[0])))
    if totals := _section(data, "totals"):
        out.print("totals: " + ", ".join(f"{k}={v}" for k, v in totals.items()))


def register(app: typer.Typer) -> None:
    """Add ``threads``, ``show`` and ``metrics`` to ``app``."""
    app.command("threads")(threads)
    app.command("show")(show)
    app.command("metrics")(metrics)
