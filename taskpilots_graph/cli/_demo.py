"""``taskpilots demo``: the ticket batch of :mod:`taskpilots_graph.demo`, with a progress bar.

It runs the very drill of ``python -m taskpilots_graph.demo`` (same batch, kill points,
report and ``--json`` output); only the progress display is added, on stderr. Progress is
the number of tickets whose thread has started, read from the drill's SQLite file while
the worker processes run (a PostgreSQL run shows an indeterminate bar).
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
import threading
from contextlib import closing
from pathlib import Path
from typing import Annotated, Any

import typer

from taskpilots_graph.cli._common import JsonOption, fail, guarded, stderr

__all__ = ["register"]

POLL_S = 0.3
NAMES = {"agent": "taskpilots agent", "plain": "plain LangGraph"}


def _started(db: Path) -> int | None:
    """Threads with a checkpoint in a drill's SQLite file (``None`` while unreadable)."""
    if not db.is_file():
        return None
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as conn:
            row = conn.execute("SELECT COUNT(DISTINCT thread_id) FROM checkpoints").fetchone()
    except sqlite3.Error:
        return None  # not created yet, or busy: try again at the next poll
    return int(row[0])


def _run_mode(mode: str, progress: Any, workdir: Path, kwargs: dict[str, Any]) -> Any:
    from taskpilots_graph.demo.batch import drill

    total = len(kwargs["tickets"])
    task = progress.add_task(NAMES[mode], total=total)
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["report"] = drill(mode, workdir, **kwargs)  # type: ignore[arg-type]
        except BaseException as exc:  # handed to the main thread below
            outcome["error"] = exc

    worker = threading.Thread(target=work, name=f"demo-{mode}", daemon=True)
    worker.start()
    db = workdir / f"{mode}-runs.db"
    while worker.is_alive():
        worker.join(POLL_S)
        if kwargs.get("conn_string") is None and (n := _started(db)) is not None:
            progress.update(task, completed=n)
    if "error" in outcome:
        raise outcome["error"]
    progress.update(task, completed=total)
    return outcome["report"]


def demo(
    tickets: Annotated[int, typer.Option("--tickets", min=1, help="Tickets in the batch.")] = 12,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the batch and kill times.")] = 7,
    timed_kills: Annotated[
        int, typer.Option("--timed-kills", min=0, help="Extra kills at random moments.")
    ] = 2,
    workdir: Annotated[
        Path | None, typer.Option("--workdir", help="Keep the databases in this folder.")
    ] = None,
    postgres: Annotated[
        str | None, typer.Option("--postgres", metavar="URL", help="Store runs in PostgreSQL.")
    ] = None,
    skip_plain: Annotated[
        bool, typer.Option("--skip-plain", help="Do not run the plain LangGraph contrast.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Process a ticket batch while the worker is SIGKILLed mid side effect; count duplicates.

    Exits 1 if the recovery agent performed any duplicate side effect.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from taskpilots_graph.cli._common import stdout
    from taskpilots_graph.demo.__main__ import KILL_POINTS, _table
    from taskpilots_graph.demo.batch import make_batch

    with guarded():
        customers, batch = make_batch(tickets, seed=seed)
        modes = ["agent"] if skip_plain else ["agent", "plain"]
        if not as_json:
            stdout().print(
                f"Processing {len(batch)} tickets; the worker is SIGKILLed "
                f"{len(KILL_POINTS)} times mid side effect (+{timed_kills} at random)."
            )
        reports = []
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with (
            tempfile.TemporaryDirectory(prefix="taskpilots-demo-") as tmp,
            Progress(*columns, console=stderr(), transient=True) as progress,
        ):
            folder = workdir or Path(tmp)
            folder.mkdir(parents=True, exist_ok=True)
            for mode in modes:
                kwargs: dict[str, Any] = {
                    "tickets": batch,
                    "customers": customers,
                    "kill_points": KILL_POINTS,
                    "timed_kills": timed_kills,
                    "seed": seed,
                    "conn_string": postgres if mode == "agent" else None,
                }
                try:
                    reports.append(_run_mode(mode, progress, folder, kwargs))
                except RuntimeError as exc:
                    fail(f"the {NAMES[mode]} run failed: {exc}")
        summary = {r.mode: r.as_dict() for r in reports}
        if as_json:
            typer.echo(json.dumps(summary, indent=2))  # byte for byte the demo module's output
        else:
            out = stdout()
            out.print(_table(reports), markup=False)
            agent = reports[0]
            plain = f", {reports[1].duplicates} (plain LangGraph)" if len(reports) > 1 else ""
            out.print(
                f"\nduplicate side effects: {agent.duplicates} (taskpilots agent){plain}",
                markup=False,
            )
            for key in agent.uncertain_keys:
                out.print(f"waiting for a person: uncertain effect {key}", markup=False)
        if reports[0].duplicates:
            raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``demo`` to ``app``."""
    app.command("demo")(demo)
