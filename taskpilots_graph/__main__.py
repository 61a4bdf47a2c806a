"""``python -m taskpilots_graph supervise|worker --graph module:attr [--db URL]``.

* ``supervise``: scan the graph's threads every ``--interval`` seconds and resume those
  whose worker died or whose wait is over (in this process, or with ``--queue`` by queueing
  resumes for the workers).
* ``worker``: a procrastinate queue worker for the graph (extra ``workers``).

URLs default to ``TASKPILOTS_POSTGRES_URL`` / ``TASKPILOTS_REDIS_URL``, else the embedded
SQLite file. The same commands exist as ``taskpilots supervise`` / ``taskpilots worker``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from taskpilots_graph import __version__
from taskpilots_graph.errors import TaskPilotsError

__all__ = ["main"]

READY = "taskpilots worker ready"
"""Printed by a worker once its graph is open (process supervisors and tests wait for it)."""


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--graph", required=True, help="the graph, as package.module:attr")
    parser.add_argument("--db", default=None, help="runs database URL (postgresql://, sqlite:///)")
    parser.add_argument("--leases", default=None, help="lease backend URL (redis://, or the db)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every scan and job")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m taskpilots_graph",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"taskpilots-graph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sup = sub.add_parser("supervise", help="resume threads whose worker died or whose wait is over")
    _common(sup)
    sup.add_argument("--interval", type=float, default=5.0, help="seconds between scans")
    sup.add_argument("--once", action="store_true", help="scan once and exit")
    sup.add_argument("--queue", action="store_true", help="queue resumes for the workers")
    sup.add_argument("--stalled-after", type=float, default=30.0, help="(--queue) seconds")
    work = sub.add_parser("worker", help="run a procrastinate worker for the graph")
    _common(work)
    work.add_argument("--concurrency", type=int, default=1, help="jobs run at once")
    work.add_argument("--name", default=None, help="the worker's name")
    work.add_argument("--supervise-every", type=float, default=1.0, help="seconds between scans")
    work.add_argument("--no-supervise", action="store_true", help="leave scans to `supervise`")
    work.add_argument("--stalled-after", type=float, default=30.0, help="seconds of silence")
    work.add_argument("--heartbeat", type=float, default=5.0, help="seconds between heartbeats")
    work.add_argument("--burst", action="store_true", help="exit once the queue is empty")
    return parser


def run_supervise(args: Any) -> int:
    """The ``supervise`` command (``args`` as parsed above, or the same attributes)."""
    from taskpilots_graph.supervisor import ScanReport, serve_supervisor

    def show(report: ScanReport) -> None:
        print(report.summary(), flush=True)

    if args.queue:
        from taskpilots_graph.workers import serve_queue_supervisor

        serve_queue_supervisor(
            args.graph,
            db=args.db,
            leases=args.leases,
            interval=args.interval,
            once=args.once,
            stalled_after=args.stalled_after,
            on_report=show,
        )
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    serve_supervisor(
        args.graph,
        db=args.db,
        leases=args.leases,
        interval=args.interval,
        once=args.once,
        stop=stop,
        on_report=show,
    )
    return 0


def run_worker(args: Any) -> int:
    """The ``worker`` command."""
    from taskpilots_graph.workers import serve_worker

    serve_worker(
        args.graph,
        db=args.db,
        leases=args.leases,
        concurrency=args.concurrency,
        name=args.name,
        supervise_every=None if args.no_supervise else args.supervise_every,
        stalled_after=args.stalled_after,
        heartbeat=args.heartbeat,
        wait=not args.burst,
        on_ready=lambda: print(READY, flush=True),
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for a configuration mistake)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run_supervise(args) if args.command == "supervise" else run_worker(args)
    except TaskPilotsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
