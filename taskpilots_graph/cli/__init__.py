"""The ``taskpilots`` command: run the demo, inspect threads, answer takeovers, run drills.

Every command takes ``--help``; read commands take ``--json``. The storage options are
described in :mod:`~taskpilots_graph.cli._common`, ``--graph`` in
:mod:`~taskpilots_graph.cli._actions`.

Example:
    $ taskpilots threads --db runs.db
    $ taskpilots decide ticket-T003 retry --graph myapp.agent:make_graph --db runs.db
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import typer

from taskpilots_graph.cli._actions import register as _register_actions
from taskpilots_graph.cli._demo import register as _register_demo
from taskpilots_graph.cli._drill import register as _register_drill
from taskpilots_graph.cli._threads import register as _register_threads
from taskpilots_graph.cli._web import register as _register_web
from taskpilots_graph.cli._workers import register as _register_workers

__all__ = ["app", "main", "run_cli", "run_command"]

app = typer.Typer(
    name="taskpilots",
    help="Operate taskpilots-graph agents: threads, takeovers, recovery metrics and drills.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # Click's plain help: it fits 80 columns, labels no flag "<bool>", and needs no rich.
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from taskpilots_graph import __version__

        typer.echo(f"taskpilots-graph {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print the installed version and exit.",
            callback=_print_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    # Only the options of the app itself; each command imports what it needs when it runs,
    # so ``--help`` and ``--version`` load no LangGraph module.
    pass


_register_threads(app)
_register_actions(app)
_register_demo(app)
_register_drill(app)
_register_workers(app)
_register_web(app)


def _status(call: typer.Typer, argv: Sequence[str], prog_name: str) -> int:
    try:
        call(args=list(argv), prog_name=prog_name)
    except SystemExit as done:  # click's standalone mode always ends this way
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def run_cli(argv: Sequence[str], *, prog_name: str = "taskpilots") -> int:
    """Run the ``taskpilots`` command with ``argv`` and return its exit status.

    Every entry point goes through this one app (``taskpilots``, ``python -m
    taskpilots_graph``, ``python -m taskpilots_graph.cli``), so they share commands,
    options, help and exit statuses.

    Example:
        >>> run_cli(["--version"])  # doctest: +SKIP
        taskpilots-graph 0.1.0.dev0
        0
    """
    return _status(app, argv, prog_name)


def run_command(name: str, argv: Sequence[str], *, prog_name: str) -> int:
    """Run the command ``name`` of the app as a program of its own (``python -m ...demo``).

    Raises:
        KeyError: If the app has no command ``name``.
    """
    info = next((c for c in app.registered_commands if c.name == name), None)
    if info is None or info.callback is None:
        raise KeyError(name)
    single = typer.Typer(
        pretty_exceptions_enable=False, add_completion=False, rich_markup_mode=None
    )
    single.command(name)(info.callback)  # one command and no callback: it is the program
    return _status(single, argv, prog_name)


def main() -> None:
    """Entry point of the ``taskpilots`` script."""
    app()
