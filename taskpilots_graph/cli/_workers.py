"""``taskpilots supervise`` and ``taskpilots worker``: the supervisor and the queue workers.

The same commands as ``python -m taskpilots_graph supervise|worker``. ``--graph`` names a
compiled graph or a factory ``build(*, checkpointer, leases)`` (see
:mod:`taskpilots_graph.config`); the supervisor needs the graph built with the lease backend
it is given. ``--leases`` defaults to ``$TASKPILOTS_REDIS_URL``, else the database itself.
"""

from __future__ import annotations

from typing import Annotated

import typer

from taskpilots_graph.cli._common import DbOption, guarded, resolve_db, stdout

__all__ = ["register"]

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
) -> None:
    """Resume threads whose worker died or whose tool wait is over; each thread once."""
    from taskpilots_graph.supervisor import ScanReport, serve_supervisor

    console = stdout()

    def show(report: ScanReport) -> None:
        console.print(report.summary())

    with guarded():
        if queue:
            from taskpilots_graph.workers import serve_queue_supervisor

            serve_queue_supervisor(
                graph,
                db=resolve_db(db),
                leases=leases,
                interval=interval,
                once=once,
                stalled_after=stalled_after,
                on_report=show,
            )
        else:
            serve_supervisor(
                graph,
                db=resolve_db(db),
                leases=leases,
                interval=interval,
                once=once,
                on_report=show,
            )


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
) -> None:
    """Run a procrastinate queue worker for the graph (extra `workers`, PostgreSQL)."""
    with guarded():
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
    app.command("supervise")(supervise)
    app.command("worker")(worker)
