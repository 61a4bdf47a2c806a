"""``taskpilots supervise`` and ``taskpilots worker``: the supervisor and the queue workers.

``python -m taskpilots_graph supervise|worker`` runs the same commands. ``--graph`` names a
compiled graph or a factory ``build(*, checkpointer, leases)`` (see
:mod:`taskpilots_graph.config`); the supervisor needs the graph built with the lease backend
it is given. ``--leases`` defaults to ``$TASKPILOTS_REDIS_URL``, else the database itself.

Both are long-running services, so a configuration mistake (a bad ``--graph``, a malformed
URL) exits with :data:`EXIT_CONFIG`, apart from every other failure: a process manager
told not to restart on it (systemd's ``RestartPreventExitStatus=2``) stops instead of
restarting a worker that can never start.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from taskpilots_graph.cli._common import DbOption, guarded, resolve_db, stdout

__all__ = ["EXIT_CONFIG", "register"]

EXIT_CONFIG = 2
"""Exit status of ``supervise`` and ``worker`` stopped by a configuration mistake."""

VerboseOption = Annotated[
    bool, typer.Option("--verbose", "-v", help="Log every scan and job (INFO level).")
]


@contextmanager
def _service(verbose: bool) -> Iterator[None]:
    """Logging for a long-running command; its configuration mistakes exit 2."""
    from taskpilots_graph.errors import ConfigurationError

    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        with guarded():
            yield
    except typer.Exit as done:
        # guarded() has printed the error line; the mistake it came from picks the status.
        if isinstance(done.__context__, ConfigurationError):
            raise typer.Exit(EXIT_CONFIG) from None
        raise
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


GraphOption = Annotated[
    str,
    typer.Option(
        "--graph", help="The graph: package.module:attr (a graph or a factory).", show_default=False
    ),
]
LeasesOption = Annotated[
    str | None,
    typer.Option(
        "--leases",
        help="Lease backend: redis://URL, or the database (default: $TASKPILOTS_REDIS_URL, "
        "else --db).",
        show_default=False,
    ),
]


def supervise(
    graph: GraphOption,
    db: DbOption = None,
    leases: LeasesOption = None,
    interval: Annotated[float, typer.Option(help="Seconds between scans.")] = 5.0,
    once: Annotated[bool, typer.Option("--once", help="Scan once and exit.")] = False,
    queue: Annotated[
        bool, typer.Option("--queue", help="Queue resumes for the workers instead.")
    ] = False,
    stalled_after: Annotated[
        float, typer.Option(help="With --queue: seconds of worker silence before its jobs rerun.")
    ] = 30.0,
    verbose: VerboseOption = False,
) -> None:
    """Resume threads whose worker died or whose tool wait is over; each thread once.

    Exits 2 on a configuration mistake (a bad --graph or URL), 1 on any other error.
    """
    from taskpilots_graph.health import ScanReport
    from taskpilots_graph.supervisor import serve_supervisor

    console = stdout()

    def show(report: ScanReport) -> None:
        console.print(report.summary(), markup=False)

    with _service(verbose):
        common: dict[str, Any] = {"db": resolve_db(db), "leases": leases, "once": once}
        if queue:
            from taskpilots_graph.workers import serve_queue_supervisor

            serve_queue_supervisor(
                graph, **common, interval=interval, stalled_after=stalled_after, on_report=show
            )
        else:
            stop = threading.Event()
            if threading.current_thread() is threading.main_thread():  # signal's own rule
                # SIGTERM (a process manager stopping the service) ends the scan loop cleanly.
                signal.signal(signal.SIGTERM, lambda *_: stop.set())
            serve_supervisor(graph, **common, interval=interval, stop=stop, on_report=show)


def worker(
    graph: GraphOption,
    db: DbOption = None,
    leases: LeasesOption = None,
    concurrency: Annotated[int, typer.Option(help="Jobs run at once.")] = 1,
    name: Annotated[str | None, typer.Option(help="The worker's name.")] = None,
    supervise_every: Annotated[
        float, typer.Option(help="Seconds between supervisor scans (a periodic job).")
    ] = 1.0,
    no_supervise: Annotated[
        bool, typer.Option("--no-supervise", help="Leave scans to `taskpilots supervise`.")
    ] = False,
    stalled_after: Annotated[
        float, typer.Option(help="Seconds of worker silence before its jobs are rerun.")
    ] = 30.0,
    heartbeat: Annotated[float, typer.Option(help="Seconds between heartbeats.")] = 5.0,
    burst: Annotated[bool, typer.Option("--burst", help="Exit once the queue is empty.")] = False,
    verbose: VerboseOption = False,
) -> None:
    """Run a procrastinate queue worker for the graph (extra `workers`, PostgreSQL).

    Prints "taskpilots worker ready" once the graph is open. Exits 2 on a configuration
    mistake (a bad --graph or URL), 1 on any other error.
    """
    with _service(verbose):
        from taskpilots_graph.workers import serve_worker

        serve_worker(
            graph,
            db=resolve_db(db),
            leases=leases,
            concurrency=concurrency,
            name=name,
            supervise_every=None if no_supervise else supervise_every,
            stalled_after=stalled_after,
            heartbeat=heartbeat,
            wait=not burst,
            on_ready=lambda: stdout().print("taskpilots worker ready"),
        )


def register(app: typer.Typer) -> None:
    """Add the ``supervise`` and ``worker`` commands to ``app``."""
    app.command("supervise", short_help="Resume threads whose worker died or wait ended.")(
        supervise
    )
    app.command("worker", short_help="A procrastinate queue worker (extra workers).")(worker)
