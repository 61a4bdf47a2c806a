"""``taskpilots drill``: the fault drills and the crash drill against a user graph."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from taskpilots_graph.cli._actions import GraphOption, importable_cwd
from taskpilots_graph.cli._common import (
    JsonOption,
    emit_json,
    guarded,
    parse_json_option,
    stderr,
    stdout,
)

__all__ = ["register"]

COLOURS = {"passed": "green", "failed": "red", "skipped": "yellow"}


def drill(
    graph: GraphOption,
    input_json: Annotated[
        str | None,
        typer.Option(
            "--input",
            help='The input of each drill run as JSON [default: {"messages": '
            '[{"role": "user", "content": "Run the drill task."}]}].',
            show_default=False,
        ),
    ] = None,
    effect: Annotated[
        list[str] | None,
        typer.Option(
            "--effect",
            help="Count this tool as a side effect (repeatable) [default: the @side_effect "
            "tools, or every tool if none is declared].",
            show_default=False,
        ),
    ] = None,
    workdir: Annotated[
        Path | None, typer.Option("--workdir", help="Keep the drill databases in this folder.")
    ] = None,
    no_crash: Annotated[
        bool, typer.Option("--no-crash", help="Skip the crash drill (child processes).")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Run the three fault drills and a crash drill against a graph; print the metrics.

    The graph must be a factory taking the checkpointer: the drills run it on a database
    of their own. Exits 1 if any drill failed (for example, a repeated side effect).
    """
    from taskpilots_graph.drills import run_drills

    with guarded():
        run_input = parse_json_option("--input", input_json)
        importable_cwd()
        console = stderr()
        with console.status("baseline run") as status:
            report = run_drills(
                graph,
                input=run_input,
                workdir=workdir,
                effect_tools=effect or None,
                crash=not no_crash,
                on_drill=lambda name: status.update(f"drill: {name.replace('_', ' ')}"),
            )
        if as_json:
            emit_json(report.as_dict())
        else:
            _print(report)
        if not report.passed:
            raise typer.Exit(1)


def _print(report: Any) -> None:
    from rich.table import Table

    from taskpilots_graph.cli._threads import _print_metrics

    out = stdout()
    out.print(f"drills against {report.graph}; baseline called: {', '.join(report.baseline)}")
    table = Table(title="drills", title_justify="left")
    for column in ("drill", "outcome", "tool", "ended", "duplicates", "detail"):
        table.add_column(column, overflow="fold")
    for r in report.results:
        colour = COLOURS[r.outcome]
        table.add_row(
            r.name.replace("_", " "),
            f"[{colour}]{r.outcome}[/{colour}]",
            r.tool or "",
            r.settled or "",
            str(r.duplicates),
            r.detail,
        )
    out.print(table)
    _print_metrics(report.metrics)
    verdict = "[green]all drills passed[/green]" if report.passed else "[red]drills failed[/red]"
    out.print(f"{verdict}; duplicate side effects: {report.duplicates}")


def register(app: typer.Typer) -> None:
    """Add ``drill`` to ``app``."""
    app.command("drill")(drill)
