"""The supervisor: finds threads whose worker died or whose wait is over, and resumes each once.

A scan looks at every thread of the graph's checkpointer:

* **health check**: a thread with work left whose lease (``thread:<id>``) nobody holds any
  more lost its worker: the heartbeat stopped (SIGKILL, a lost machine) and the TTL ran out,
  or the run was torn down mid-step and dropped the lease. A held lease means a live worker.
* **recovery scheduling**: such *orphaned* threads, and threads parked in ``waiting_tool``
  whose ``retry_at`` has passed, are resumed (in this process, or handed to a queue with
  ``dispatch=``, see :mod:`taskpilots_graph.workers`). A thread waiting on a person is left to
  the person.
* **failure attribution**: every resume records *why*
  (:class:`~taskpilots_graph.health.Attribution`: thread, node, step, tool, agent, failure
  kind) in the ``run_resumed`` event it appends; a thread whose recovery keeps failing is
  given up on with a ``stuck_detected`` event naming the same. What a scan sees and decides
  is pure and lives in :mod:`taskpilots_graph.health`.

Several supervisors may run at once: a resume (:func:`~taskpilots_graph.runner.recover`) takes
the thread's lease and re-checks under it that the thread still needs one, so each thread is
resumed by exactly one of them; the others see ``ThreadBusy`` or nothing left to do.

With a supervisor running, start every run through the lease-holding runners
(``tp.run`` / ``tp.resume`` / ``tp.decide``, or the queue of :mod:`taskpilots_graph.workers`):
a bare ``graph.invoke`` holds no lease, so its thread looks orphaned while it runs.

Example:
    >>> from taskpilots_graph.supervisor import supervise
    >>> supervise(graph, interval=5.0)             # forever, in this process
    ... # doctest: +SKIP
    >>> report = supervise(graph, once=True)       # one scan, e.g. from cron
    ... # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final

from langgraph.pregel import Pregel

from taskpilots_graph import _clock
from taskpilots_graph._thread_index import athread_index, thread_index
from taskpilots_graph._twins import IO, Steps, arun_steps, both, io, run_steps
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.config import StorageSettings, open_graph
from taskpilots_graph.errors import (
    ConfigurationError,
    LockBackendUnavailable,
    StorageError,
    ThreadBusy,
)
from taskpilots_graph.events import EventKind
from taskpilots_graph.health import (
    Attribution,
    HealthStatus,
    ScanReport,
    ThreadHealth,
    thread_health,
    unreadable_health,
    with_effect_in_flight,
)
from taskpilots_graph.leases import LeaseBackend, thread_lease_name
from taskpilots_graph.runner import arecover, recover, thread_config
from taskpilots_graph.tool_tables import find_executor

__all__ = ["Supervisor", "asupervise", "serve_supervisor", "supervise"]

_log: Final = logging.getLogger("taskpilots_graph.supervisor")

Dispatch = Callable[[str, "Attribution"], Any]
"""``dispatch(thread_id, attribution)``: hand a resume to a queue instead of running it here."""


# --- the supervisor ---------------------------------------------------------------------------


@dataclass
class _Failures:
    checkpoint_id: str | None
    count: int = 0
    next_try: float = 0.0
    error: str = ""
    reported: bool = False


# Verdicts that stay true until the thread gets a new checkpoint: kept between scans so a
# scan re-reads only threads that moved. Re-read anyway after this long, in case a run
# wrote to the same checkpoint without a new one (e.g. a decision whose run then crashed).
_STABLE: Final = (HealthStatus.IDLE, HealthStatus.TAKEOVER, HealthStatus.WAITING)
_RECHECK_S: Final = 60.0


class Supervisor:
    """Health checks and recovery for the threads of one graph (sync and async).

    Args:
        graph: A recovery agent (``create_recovery_agent``): its thread leases (in the
            backend named with ``leases=``, else in its checkpointer's own database) tell
            a running thread from one whose worker died.
        dispatch: ``dispatch(thread_id, attribution)`` hands each resume to a queue (e.g.
            :func:`taskpilots_graph.workers.enqueue_resume`) instead of running it here.
        max_failures: Resumes of one checkpoint that may raise before the thread is given up
            on (``FAILING``, a ``stuck_detected`` event); it is tried again once it moves.
        failure_backoff: Seconds before retrying a failed resume, doubling each time.

    Raises:
        ConfigurationError: If the graph has no recovery executor.
    """

    def __init__(
        self,
        graph: Pregel[Any, Any],
        *,
        dispatch: Dispatch | None = None,
        max_failures: int = 3,
        failure_backoff: float = 2.0,
    ) -> None:
        executor = find_executor(graph)
        if executor is None:
            raise ConfigurationError(
                "the supervisor needs a graph built by create_recovery_agent: without its "
                "thread leases a running thread cannot be told from one whose worker died"
            )
        if max_failures < 1 or failure_backoff < 0:
            raise ConfigurationError("max_failures must be >= 1 and failure_backoff >= 0")
        self.graph = graph
        self.leases: LeaseBackend = executor.lease_backend()
        self.agent = str(getattr(graph, "name", None) or "graph")
        self.dispatch = dispatch
        self.max_failures = max_failures
        self.failure_backoff = failure_backoff
        # Per-thread memory between scans: the last verdicts, and the resumes that failed.
        self._known: dict[str, tuple[float, ThreadHealth]] = {}
        self._failures: dict[str, _Failures] = {}

    # -- shared bookkeeping (no I/O) ---------------------------------------------------------

    def _cached(self, thread_id: str, checkpoint_id: str, now: float) -> ThreadHealth | None:
        seen = self._known.get(thread_id)
        if seen is None:
            return None
        at, health = seen
        if health.checkpoint_id != checkpoint_id or time.monotonic() - at > _RECHECK_S:
            return None
        waiting = health.status is HealthStatus.WAITING and health.retry_at is not None
        if waiting and health.retry_at is not None and health.retry_at <= now:
            return None  # due now: re-read (a resume re-checks under the lease anyway)
        return health

    def _judged(self, health: ThreadHealth) -> ThreadHealth:
        if health.status in _STABLE:
            self._known[health.thread_id] = (time.monotonic(), health)
        else:
            self._known.pop(health.thread_id, None)
        failing = self._failures.get(health.thread_id)
        if failing is None:
            return health
        if failing.checkpoint_id != health.checkpoint_id or not health.recoverable:
            del self._failures[health.thread_id]  # it moved on: a fresh start
            return health
        if failing.count >= self.max_failures:  # given up on until it moves
            return replace(health, status=HealthStatus.FAILING, retry_at=None, error=failing.error)
        return health

    def _may_try(self, health: ThreadHealth, now: float) -> bool:
        failing = self._failures.get(health.thread_id)
        return health.recoverable and (failing is None or now >= failing.next_try)

    def _failed(
        self, health: ThreadHealth, exc: BaseException, now: float
    ) -> dict[str, Any] | None:
        """Count a failed resume; the ``stuck_detected`` payload once it is given up on."""
        failing = self._failures.setdefault(health.thread_id, _Failures(health.checkpoint_id))
        failing.count += 1
        failing.error = f"{type(exc).__name__}: {exc}"[:2000]
        failing.next_try = now + self.failure_backoff * 2 ** (failing.count - 1)
        _log.warning("resuming thread %r failed: %s", health.thread_id, failing.error)
        if failing.count < self.max_failures or failing.reported:
            return None
        failing.reported = True
        return {
            "by": "supervisor",
            "reason": f"recovery failed {failing.count} times",
            "error": failing.error,
            "attribution": health.attribution.payload() if health.attribution else None,
        }

    # -- the scan, one body for the sync and the async form ---------------------------------

    def check(self) -> list[ThreadHealth]:
        """The health check: every thread of the checkpointer and what it is doing.

        Raises:
            LockBackendUnavailable: The lease backend is unreachable: liveness cannot be
                judged, so nothing is reported recoverable (fail closed).
        """
        return run_steps(self._check())

    async def acheck(self) -> list[ThreadHealth]:
        """Async form of :meth:`check`."""
        return await arun_steps(self._check())

    def tick(self) -> ScanReport:
        """One scan: the health check, then a resume (or dispatch) of each recoverable thread."""
        return run_steps(self._tick())

    async def atick(self) -> ScanReport:
        """Async form of :meth:`tick` (resumes run one after the other)."""
        return await arun_steps(self._tick())

    def _check(self) -> Steps[list[ThreadHealth]]:
        checkpointer = self.graph.checkpointer
        if checkpointer is None or isinstance(checkpointer, bool):
            raise ConfigurationError("the supervisor needs a graph compiled with a checkpointer")
        now = _clock.now()
        found: list[ThreadHealth] = []
        index = yield both(thread_index, athread_index, checkpointer)
        for thread_id, checkpoint_id in sorted(index.items()):
            cached = self._cached(thread_id, checkpoint_id, now)
            if cached is not None:
                found.append(self._judged(cached))
                continue
            holder = yield io(self.leases, "holder", thread_lease_name(thread_id))
            if holder is not None:
                found.append(
                    ThreadHealth(thread_id, HealthStatus.RUNNING, checkpoint_id, holder.owner)
                )
                continue
            try:
                snapshot = yield io(self.graph, "get_state", thread_config(thread_id, None))
            except Exception as exc:  # one unreadable thread must not blind the supervisor
                found.append(unreadable_health(thread_id, checkpoint_id, exc))
                continue
            health = thread_health(thread_id, snapshot, agent=self.agent, now=now)
            if health.status is HealthStatus.ORPHANED and isinstance(checkpointer, RecoveryAPI):
                entries = yield io(checkpointer, "ledger", thread_id)
                health = with_effect_in_flight(health, entries)
            found.append(self._judged(health))
        return found

    def _tick(self) -> Steps[ScanReport]:
        threads = yield from self._check()
        now = _clock.now()
        resumed: list[str] = []
        dispatched: list[str] = []
        busy: list[str] = []
        failed: list[tuple[str, str]] = []
        for health in threads:
            if not self._may_try(health, now):
                continue
            tid = health.thread_id
            if self.dispatch is not None:
                why = health.attribution or Attribution(tid, "worker_lost", self.agent)
                # The async form awaits a coroutine function's outcome.
                yield both(self.dispatch, self.dispatch, tid, why)
                dispatched.append(tid)
                continue
            try:
                if (yield both(recover, arecover, self.graph, tid, health.attribution)):
                    resumed.append(tid)
            except ThreadBusy:
                busy.append(tid)
            except LockBackendUnavailable:
                raise  # the lease backend is down: the whole tick fails closed
            except Exception as exc:
                failed.append((tid, f"{type(exc).__name__}: {exc}"))
                cp = self.graph.checkpointer
                if (stuck := self._failed(health, exc, now)) and isinstance(cp, RecoveryAPI):
                    yield io(cp, "append_event", tid, EventKind.STUCK_DETECTED, stuck)
        return ScanReport(
            tuple(threads), tuple(resumed), tuple(dispatched), tuple(busy), tuple(failed)
        )


# --- the loop ---------------------------------------------------------------------------------


def check_interval(interval: float) -> None:
    if not interval > 0:
        raise ConfigurationError(f"interval must be > 0 seconds, got {interval!r}")


def supervise(
    graph: Pregel[Any, Any],
    *,
    interval: float = 5.0,
    once: bool = False,
    dispatch: Dispatch | None = None,
    stop: threading.Event | None = None,
    on_report: Callable[[ScanReport], None] | None = None,
    max_failures: int = 3,
) -> ScanReport:
    """Scan the graph's threads every ``interval`` seconds and resume the ones that need it.

    Args:
        graph: A recovery agent (see :class:`Supervisor`).
        interval: Seconds between scans.
        once: Scan once and return (for cron, tests, the CLI's ``--once``).
        dispatch: Hand resumes to a queue instead of running them in this process.
        stop: Set it (from another thread or a signal handler) to end the loop.
        on_report: Called with each scan's report (logging, metrics).
        max_failures: See :class:`Supervisor`.

    Returns:
        The last scan's report (once ``once`` or ``stop`` ends the loop).

    Raises:
        ConfigurationError: For a graph that is no recovery agent, or a bad interval.
        LockBackendUnavailable: With ``once``, when the lease backend is unreachable; the
            loop instead logs it and tries again next interval.
    """
    check_interval(interval)
    supervisor = Supervisor(graph, dispatch=dispatch, max_failures=max_failures)
    stop = stop or threading.Event()
    stopped = both(stop.wait, stop.wait, interval)
    scan = both(supervisor.tick, supervisor.atick)
    return run_steps(scan_loop(scan, interval, once, stopped, on_report))


async def asupervise(
    graph: Pregel[Any, Any],
    *,
    interval: float = 5.0,
    once: bool = False,
    dispatch: Dispatch | None = None,
    stop: asyncio.Event | None = None,
    on_report: Callable[[ScanReport], None] | None = None,
    max_failures: int = 3,
) -> ScanReport:
    """Async form of :func:`supervise` (``dispatch`` may be a coroutine function)."""
    check_interval(interval)
    supervisor = Supervisor(graph, dispatch=dispatch, max_failures=max_failures)
    stopped = both(stopped_within, stopped_within, stop or asyncio.Event(), interval)
    scan = both(supervisor.tick, supervisor.atick)
    return await arun_steps(scan_loop(scan, interval, once, stopped, on_report))


async def stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """Whether ``stop`` is set within ``seconds``."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True


def scan_loop(
    scan: IO,
    interval: float,
    once: bool,
    stopped: IO,
    on_report: Callable[[ScanReport], None] | None,
) -> Steps[ScanReport]:
    """Scan (``scan`` gives a report) until ``once`` or ``stopped`` (waits ``interval`` for
    the stop signal); a scan failing on storage is logged and retried (raised if ``once``)."""
    report = ScanReport()
    while True:
        try:
            report = yield scan
        except StorageError as exc:
            if once:
                raise
            _log.warning("supervisor scan failed, retrying in %g s: %s", interval, exc)
        else:
            _log.info("supervisor scan: %s", report.summary())
            if on_report is not None:
                on_report(report)
        if once or (yield stopped):
            return report


def serve_supervisor(
    graph_ref: str,
    *,
    db: str | None = None,
    leases: str | None = None,
    interval: float = 5.0,
    once: bool = False,
    stop: threading.Event | None = None,
    on_report: Callable[[ScanReport], None] | None = None,
) -> ScanReport:
    """:func:`supervise` the graph ``graph_ref`` on the databases the URLs / environment name.

    What ``python -m taskpilots_graph supervise`` runs: resumes happen in this process. (To
    hand them to queue workers instead, see
    :func:`taskpilots_graph.workers.serve_queue_supervisor`.)

    Args:
        graph_ref: ``"package.module:attr"`` (see :mod:`taskpilots_graph.config`).
        db: The runs database; default ``TASKPILOTS_POSTGRES_URL``, else embedded SQLite.
        leases: The lease backend; default ``TASKPILOTS_REDIS_URL``, else the database.
        interval: Seconds between scans.
        once: Scan once and return.
        stop: Set it to end the loop.
        on_report: Called with each scan's report.
    """
    check_interval(interval)
    settings = StorageSettings.resolve(db=db, leases=leases)
    with open_graph(graph_ref, settings) as graph:
        return supervise(graph, interval=interval, once=once, stop=stop, on_report=on_report)
