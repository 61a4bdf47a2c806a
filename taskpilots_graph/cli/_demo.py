"""``taskpilots demo``: the ticket batch of :mod:`taskpilots_graph.demo`, killed and resumed.

The recovery agent and plain LangGraph process the same batch side by side (two worker
processes at a time), each SIGKILLed at the same business steps: a schedule drawn from
``--seed`` (see :mod:`taskpilots_graph.demo.schedule`), so the default run prints the table
of the README on any machine. Progress goes to stderr (a bar per run in a terminal, a line
per kill everywhere), the table to stdout. The databases are kept in ``--workdir`` and the
command ends with the ``taskpilots show`` line that opens them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from taskpilots_graph.cli._common import JsonOption, fail, guarded, redact, stderr, stdout

if TYPE_CHECKING:
    from rich.progress import Progress

    from taskpilots_graph.demo.batch import DrillEvent, DrillReport, Mode

__all__ = ["DEFAULT_WORKDIR", "register", "render_table"]

DEFAULT_WORKDIR = Path(".taskpilots") / "demo"
"""Where the demo keeps its databases unless ``--workdir`` says otherwise."""

NAMES = {"agent": "taskpilots agent", "plain": "plain LangGraph"}
_FILES = (
    *("runs.db", "runs.db-wal", "runs.db-shm"),
    *("services.db", "services.db-wal", "services.db-shm"),
    "batch.json",
)


def render_table(reports: Sequence[DrillReport]) -> str:
    """The comparison table the demo prints (and the README shows), one column per run.

    Times are left to ``--json``: they measure worker start-ups on this machine more than
    either library, so a row of them would invite a comparison it cannot support.
    """
    rows = [("", *(NAMES[r.mode] for r in reports))]
    rows.append(("tickets closed", *(f"{r.closed}/{r.tickets}" for r in reports)))
    rows.append(("stopped for a person", *(str(len(r.stopped_uncertain)) for r in reports)))
    for service in reports[0].effects:
        rows.append((f"  {service}", *(str(r.effects[service]) for r in reports)))
    rows.append(("duplicate side effects", *(str(r.duplicates) for r in reports)))
    rows.append(("SIGKILLs survived", *(str(r.kills) for r in reports)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _clean(folder: Path, modes: Sequence[str]) -> None:
    """Delete what an earlier demo left in ``folder`` (its own files only, nothing else).

    A drill starts from empty services and an empty store: old effects would be counted
    again, and old threads would be resumed instead of started.
    """
    for mode in modes:
        for name in _FILES:
            (folder / f"{mode}-{name}").unlink(missing_ok=True)


def _fresh_postgres(url: str, thread_ids: Sequence[str]) -> None:
    """Check ``url`` and delete the demo's threads an earlier run left in that database.

    Raises:
        ConfigurationError: Not a PostgreSQL URL.
        StorageError: The server cannot be reached, or the ``postgres`` extra is missing.
    """
    from taskpilots_graph.checkpointers import RecoveryCheckpointer
    from taskpilots_graph.checkpointers._conn_string import parse_conn_string
    from taskpilots_graph.cli._common import checked_db
    from taskpilots_graph.errors import ConfigurationError

    if parse_conn_string(url).backend != "postgres":
        raise ConfigurationError(
            f"--postgres needs a postgresql:// URL, not {redact(url)!r}; "
            "without --postgres the demo uses SQLite files"
        )
    checked_db(url)  # one line, within seconds, for a missing extra or an unreachable server
    with RecoveryCheckpointer.from_conn_string(url) as cp:
        cp.setup()
        for thread_id in thread_ids:
            cp.delete_thread(thread_id)


class _Display:
    """Progress of the runs: a bar per run (tickets settled, kills survived), a line per kill."""

    def __init__(self, progress: Progress, modes: Sequence[Mode], tickets: int, kills: int):
        self.progress = progress
        self.kills = kills
        self.lock = threading.Lock()
        self.seen: dict[str, set[str]] = {mode: set() for mode in modes}
        self.killed: dict[str, int] = dict.fromkeys(modes, 0)
        self.tasks = {
            mode: progress.add_task(
                NAMES[mode], total=tickets, kills=f"0/{kills}", state="starting"
            )
            for mode in modes
        }

    def handler(self, mode: Mode) -> Callable[[DrillEvent], None]:
        """The ``on_event`` callback of the run of ``mode``."""

        def on_event(event: DrillEvent) -> None:
            # Called from the runs' threads; rich's Progress is thread-safe, the counts not.
            with self.lock:
                task = self.tasks[mode]
                if event.kind == "worker":
                    self.progress.update(task, state=f"worker {event.detail}")
                elif event.kind == "settled":
                    self.seen[mode].add(event.detail)
                    self.progress.update(task, completed=len(self.seen[mode]))
                elif event.kind == "killed":
                    self.killed[mode] += 1
                    done = f"{self.killed[mode]}/{self.kills}"
                    self.progress.update(task, kills=done)
                    self.progress.console.print(
                        f"{NAMES[mode]:<16}  SIGKILL {done}: {event.detail}", markup=False
                    )

        return on_event


def _run(
    modes: Sequence[Mode], folder: Path, postgres: str | None, kwargs: dict[str, Any]
) -> list[DrillReport]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from taskpilots_graph.demo.batch import drill

    columns = (
        TextColumn("{task.description:<16}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("tickets, {task.fields[kills]} kills"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[state]}"),
    )
    with Progress(*columns, console=stderr(), transient=True) as progress:
        display = _Display(progress, modes, len(kwargs["tickets"]), len(kwargs["kill_points"]))
        # Side by side: each run spends most of its time starting worker interpreters,
        # and the two runs share nothing but the (read-only) batch.
        with ThreadPoolExecutor(max_workers=len(modes), thread_name_prefix="demo") as pool:
            futures = [
                pool.submit(
                    drill,
                    mode,
                    folder,
                    conn_string=postgres if mode == "agent" else None,
                    on_event=display.handler(mode),
                    fork_server=True,
                    **kwargs,
                )
                for mode in modes
            ]
            reports = []
            for mode, future in zip(modes, futures, strict=True):
                try:
                    reports.append(future.result())
                except RuntimeError as exc:
                    fail(f"the {NAMES[mode]} run failed: {exc}")
    return reports


def demo(
    tickets: Annotated[
        int, typer.Option("--tickets", min=1, metavar="N", help="Tickets in the batch.")
    ] = 12,
    seed: Annotated[
        int,
        typer.Option("--seed", metavar="N", help="Seed of the batch and of where the kills land."),
    ] = 7,
    timed_kills: Annotated[
        int,
        typer.Option(
            "--timed-kills",
            min=0,
            metavar="N",
            help="Extra kills at random moments (their figures vary from run to run).",
        ),
    ] = 0,
    workdir: Annotated[
        Path,
        typer.Option(
            "--workdir", metavar="DIR", help="Folder for the databases (the demo's are replaced)."
        ),
    ] = DEFAULT_WORKDIR,
    postgres: Annotated[
        str | None,
        typer.Option("--postgres", metavar="URL", help="Store the agent's runs in PostgreSQL."),
    ] = None,
    skip_plain: Annotated[
        bool, typer.Option("--skip-plain", help="Do not run the plain LangGraph contrast.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Run a ticket batch, SIGKILL its worker mid side effect, count duplicates.

    Exits 1 if the recovery agent performed any duplicate side effect.
    """
    from taskpilots_graph.demo.batch import make_batch, thread_id
    from taskpilots_graph.demo.schedule import kill_schedule

    with guarded():
        customers, batch = make_batch(tickets, seed=seed)
        schedule = kill_schedule(batch, seed=seed)
        modes: list[Mode] = ["agent"] if skip_plain else ["agent", "plain"]
        if postgres is not None:
            _fresh_postgres(postgres, [thread_id(t) for t in batch])
        workdir.mkdir(parents=True, exist_ok=True)
        _clean(workdir, modes)
        if not as_json:
            extra = f" (+{timed_kills} at random)" if timed_kills else ""
            stdout().print(
                f"Processing {len(batch)} tickets; each worker is SIGKILLed {len(schedule)} "
                f"times mid side effect{extra}, at the same steps in both runs (seed {seed}).",
                markup=False,
                soft_wrap=False,  # prose: wrapped between words at the terminal's width
            )
        kwargs: dict[str, Any] = {
            "tickets": batch,
            "customers": customers,
            "kill_points": schedule,
            "timed_kills": timed_kills,
            "seed": seed,
        }
        reports = _run(modes, workdir, postgres, kwargs)
        if as_json:
            typer.echo(json.dumps({r.mode: r.as_dict() for r in reports}, indent=2))
        else:
            _print_report(reports, batch, schedule, workdir, postgres)
        if reports[0].duplicates:
            raise typer.Exit(1)


def _print_report(
    reports: Sequence[DrillReport],
    batch: Sequence[dict[str, Any]],
    schedule: Sequence[tuple[str, str, str]],
    workdir: Path,
    postgres: str | None,
) -> None:
    from taskpilots_graph.demo.batch import thread_id

    out = stdout()
    out.print(render_table(reports), markup=False)
    agent = reports[0]
    plain = f", {reports[1].duplicates} (plain LangGraph)" if len(reports) > 1 else ""
    out.print(
        f"\nduplicate side effects: {agent.duplicates} (taskpilots agent){plain}", markup=False
    )
    for key in agent.uncertain_keys:
        out.print(f"waiting for a person: uncertain effect {key}", markup=False)
    # Point at a ticket killed right after an effect: its story shows the reconciliation.
    after = [p for p in schedule if p[1] == "after" and p[0] != "crm_tag"] or list(schedule)
    if not after:
        return
    service, phase, about = after[0]
    ticket = next(t for t in batch if about in (t["order_id"], t["customer_id"]))
    site = f"{'right after' if phase == 'after' else 'just before'} {service}"
    db = "'<your --postgres URL>'" if postgres else str(workdir / "agent-runs.db")
    out.print(
        f"\nThe runs are kept in {workdir}. Ticket {ticket['ticket_id']} was killed {site}; "
        "read how the agent recovered it:",
        markup=False,
        soft_wrap=False,
    )
    out.print(f"  taskpilots show {thread_id(ticket)} --db {db}", markup=False)


def register(app: typer.Typer) -> None:
    """Add ``demo`` to ``app``."""
    app.command("demo", short_help="Ticket batch under SIGKILL vs plain LangGraph.")(demo)
