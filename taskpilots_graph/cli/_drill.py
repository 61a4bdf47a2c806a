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
            metavar="JSON",
            help='The input of each drill run as JSON [default: {"messages": '
            '[{"role": "user", "content": "Run the drill task."}]}].',
            show_default=False,
        ),
    ] = None,
    effect: Annotated[
        list[str] | None,
        typer.Option(
            "--effect",
            metavar="TOOL",
            help="Count this tool as a side effect (repeatable) [default: the @side_effect "
            "tools, or every tool if none is declared].",
            show_default=False,
        ),
    ] = None,
    workdir: Annotated[
        Path | None,
        typer.Option("--workdir", metavar="DIR", help="Keep the drill databases in this folder."),
    ] = None,
    no_crash: Annotated[
        bool, typer.Option("--no-crash", help="Skip the crash drill (child processes).")
    ] = False,
    real_effects: Annotated[
        bool,
        typer.Option(
            "--real-effects",
            help="Drill a factory not marked @drill_graph: its real tools run, many times.",
        ),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Run the fault drills and a crash drill on a graph built with test doubles.

    The drills run every tool of the graph, many times: --graph names a factory taking
    the checkpointer that builds the graph on fakes, marked @drill_graph (from
    taskpilots_graph.drills). An unmarked factory is refused unless --real-effects says
    that its real side effects are meant. Exits 1 if any drill failed (for example, a
    repeated side effect).
    """
    from taskpilots_graph.config import load_graph
    from taskpilots_graph.drills import is_drill_graph, run_drills

    with guarded():
        run_input = parse_json_option("--input", input_json)
        importable_cwd()
        console = stderr()
        marked = is_drill_graph(load_graph(graph).target)
        if marked:
            console.print(
                f"drilling {graph}: marked @drill_graph, its tools are test doubles", markup=False
            )
        elif real_effects:
            console.print(
                f"warning: drilling {graph} with --real-effects: its tools call real "
                "services, and every drill performs their side effects again",
                style="bold yellow",
                markup=False,
            )
        with console.status("baseline run") as status:
            report = run_drills(
                graph,
                input=run_input,
                workdir=workdir,
                effect_tools=effect or None,
                crash=not no_crash,
                on_drill=lambda name: status.update(f"drill: {name.replace('_', ' ')}"),
                real_effects=real_effects,
            )
        if as_json:
            emit_json(report.as_dict())
        else:
            _print(report)
        if not report.passed:
            raise typer.Exit(1)


def _print(report: Any) -> None:
    from rich.table import Table

    from taskpilots_graph.cli._threads import print_metrics

    out = stdout()
    kind = "real services" if report.real_effects else "test doubles"
    out.print(
        f"drills against {report.graph} ({kind}); baseline called: {', '.join(report.baseline)}",
        markup=False,
    )
    table = Table(title="drills", title_justify="left", box=None, pad_edge=False)
    for column in ("drill", "outcome", "tool", "ended", "duplicates"):
        table.add_column(column, no_wrap=True, overflow="ellipsis")
    for r in report.results:
        colour = COLOURS[r.outcome]
        table.add_row(
            r.name.replace("_", " "),
            f"[{colour}]{r.outcome}[/{colour}]",
            r.tool or "",
            r.settled or "",
            str(r.duplicates),
        )
    out.print(table)
    # The details are sentences: on lines of their own they wrap between words.
    for r in report.results:
        if r.detail:
            out.print(f"  {r.name.replace('_', ' ')}: {r.detail}", markup=False, soft_wrap=False)
    print_metrics(report.metrics)
    verdict = "[green]all drills passed[/green]" if report.passed else "[red]drills failed[/red]"
    out.print(f"{verdict}; duplicate side effects: {report.duplicates}")


def register(app: typer.Typer) -> None:
    """Add ``drill`` to ``app``."""
    app.command("drill", short_help="Fault and crash drills on a test-double graph.")(drill)
