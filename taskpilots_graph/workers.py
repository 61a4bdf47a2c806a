"""Runs spread over processes and machines on procrastinate, a PostgreSQL task queue.

Optional extra ``workers`` (``pip install 'taskpilots-graph[workers]'``). The queue lives
in the same PostgreSQL database as the runs; nothing here is a home-made queue:

* :func:`enqueue` defers a run of a thread with an input, :func:`enqueue_resume` a resume.
  Every job is locked on its thread id (procrastinate ``lock=``: jobs of one thread run one
  after the other, in order) *and* holds the thread's lease while it runs (a runner outside
  the queue gets ``ThreadBusy``, never a lost write). A resume is queued at most once at a
  time (``queueing_lock=``).
* :func:`serve_worker` (``python -m taskpilots_graph worker --graph module:attr``) runs a
  worker; with ``supervise_every`` it also runs the supervisor's scan as a procrastinate
  *periodic* job: one scan per period across all workers, which queues resumes of orphaned
  and due threads and re-queues the jobs of workers whose heartbeat stopped.
* A job that a killed worker left behind is run again (the stalled-job retry); it starts
  the thread at most once: the input carries a marker recorded in the checkpoint metadata,
  so a retried job finds it and resumes instead of sending the input twice.

Another queue (Celery, arq)? Call :func:`taskpilots_graph.resume` from your own task (see the
README), and lock the task on the thread id if your queue can.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from langchain_core.runnables import RunnableConfig
from langgraph.pregel import Pregel

from taskpilots_graph._twins import arun_steps, both
from taskpilots_graph.config import StorageSettings, open_graph
from taskpilots_graph.errors import ConfigurationError, ThreadBusy, ToolWaiting
from taskpilots_graph.health import Attribution, ScanReport
from taskpilots_graph.runner import leased_thread, recover, thread_config
from taskpilots_graph.supervisor import Supervisor, check_interval, scan_loop, stopped_within

try:
    import procrastinate
    from procrastinate.exceptions import AlreadyEnqueued
    from procrastinate.schema import SchemaManager
except ImportError as _missing:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "taskpilots_graph.workers needs procrastinate: pip install 'taskpilots-graph[workers]'"
    ) from _missing

__all__ = [
    "INPUT_MARKER",
    "QUEUE",
    "RUN_TASK",
    "SUPERVISE_TASK",
    "aenqueue",
    "aenqueue_resume",
    "aretry_stalled_jobs",
    "create_worker_app",
    "enqueue",
    "enqueue_resume",
    "serve_queue_supervisor",
    "serve_worker",
    "setup_queue",
]

RUN_TASK: Final = "taskpilots.run_thread"
SUPERVISE_TASK: Final = "taskpilots.supervise"
QUEUE: Final = "taskpilots"
INPUT_MARKER: Final = "taskpilots_input"
"""Checkpoint metadata key holding the id of the job input a run started from."""

# Supervisor scans jump the queue: behind a backlog of runs they would find dead workers late.
_SUPERVISE_PRIORITY: Final = 10
# Recovering a thread a dead worker left half done goes before starting new ones.
_RECOVERY_PRIORITY: Final = 5
# procrastinate's own key space for advisory locks is unrelated; this one guards setup.
_SETUP_LOCK: Final = 0x7470_7172_6F63  # "tp" "proc"

_log: Final = logging.getLogger("taskpilots_graph.workers")


# --- the app ----------------------------------------------------------------------------------


def _postgres(db_url: str | None) -> str:
    settings = StorageSettings.resolve(db=db_url)
    if not settings.postgres:
        raise ConfigurationError(
            "the workers' queue lives in PostgreSQL: pass a postgresql:// URL or set "
            "TASKPILOTS_POSTGRES_URL (the embedded SQLite mode runs in one process)"
        )
    return settings.db_url


def create_worker_app(db_url: str | None = None, *, pool_size: int = 4) -> procrastinate.App:
    """A procrastinate app on the runs database, with the run and supervise tasks registered.

    Open it (``with app.open():`` or ``async with app.open_async():``) to enqueue;
    :func:`serve_worker` opens its own.

    Raises:
        ConfigurationError: If the database is not PostgreSQL.
    """
    connector = procrastinate.PsycopgConnector(
        conninfo=_postgres(db_url), min_size=1, max_size=pool_size
    )
    app = procrastinate.App(connector=connector)
    app.task(
        name=RUN_TASK,
        queue=QUEUE,
        pass_context=True,
        # A job whose thread is still leased (its killed worker's TTL not yet out) waits.
        retry=procrastinate.RetryStrategy(max_attempts=600, wait=1, retry_exceptions={ThreadBusy}),
    )(_run_job)
    app.task(name=SUPERVISE_TASK, queue=QUEUE, pass_context=True)(_supervise_job)
    return app


def setup_queue(db_url: str | None = None) -> None:
    """Create procrastinate's tables once per database (safe to call from many workers)."""
    import psycopg

    with psycopg.connect(_postgres(db_url), autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (_SETUP_LOCK,))
        try:
            exists = conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()
            if exists is None or exists[0] is None:
                conn.execute(SchemaManager.get_schema())
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_SETUP_LOCK,))


# --- enqueueing -------------------------------------------------------------------------------


def _job(
    app: procrastinate.App, graph_ref: str, thread_id: str, resume: bool, **kwargs: Any
) -> tuple[Any, dict[str, Any]]:
    """The run task configured for ``thread_id``, and the job's arguments. A resume is queued
    at most once at a time, ahead of runs that start threads."""
    thread_config(thread_id, None)  # validates the thread id
    options: dict[str, Any] = {"lock": thread_id, "queue": QUEUE}
    if resume:
        options["queueing_lock"] = f"taskpilots-resume:{thread_id}"
        options["priority"] = _RECOVERY_PRIORITY
    task = app.tasks[RUN_TASK].configure(**options)
    return task, {"graph": graph_ref, "thread_id": thread_id, **kwargs}


def enqueue(app: procrastinate.App, graph_ref: str, thread_id: str, input: Any) -> int:
    """Queue a run of ``thread_id`` with ``input`` (JSON: e.g. ``{"messages": [...]}``).

    Example:
        >>> with app.open():
        ...     enqueue(app, "myapp.agents:build", "t-1",
        ...             {"messages": [{"role": "user", "content": "refund order 42"}]})
        ... # doctest: +SKIP

    Returns:
        The job id.
    """
    task, job = _job(app, graph_ref, thread_id, False, input=input, marker=secrets.token_hex(12))
    job_id: int = task.defer(**job)
    return job_id


async def aenqueue(app: procrastinate.App, graph_ref: str, thread_id: str, input: Any) -> int:
    """Async form of :func:`enqueue`."""
    task, job = _job(app, graph_ref, thread_id, False, input=input, marker=secrets.token_hex(12))
    job_id: int = await task.defer_async(**job)
    return job_id


def enqueue_resume(
    app: procrastinate.App, graph_ref: str, thread_id: str, attribution: Attribution | None = None
) -> int | None:
    """Queue a resume of ``thread_id``, unless one is queued already.

    Returns:
        The job id, or ``None`` if a resume of the thread was already waiting in the queue.
    """
    why = attribution.payload() if attribution is not None else None
    task, job = _job(app, graph_ref, thread_id, True, attribution=why)
    try:
        job_id: int = task.defer(**job)
    except AlreadyEnqueued:
        return None
    return job_id


async def aenqueue_resume(
    app: procrastinate.App, graph_ref: str, thread_id: str, attribution: Attribution | None = None
) -> int | None:
    """Async form of :func:`enqueue_resume`."""
    why = attribution.payload() if attribution is not None else None
    task, job = _job(app, graph_ref, thread_id, True, attribution=why)
    try:
        job_id: int = await task.defer_async(**job)
    except AlreadyEnqueued:
        return None
    return job_id


async def aretry_stalled_jobs(app: procrastinate.App, *, stalled_after: float) -> list[int]:
    """Put back in the queue the run jobs of workers silent for ``stalled_after`` seconds.

    procrastinate records each worker's heartbeat; a job still "doing" on a worker whose
    heartbeat stopped (SIGKILL, a lost machine) would otherwise hold its thread's job lock
    forever. The retried job resumes the thread (its lease protects against a worker that
    was only slow), ahead of jobs that start new threads.
    """
    stalled = await app.job_manager.get_stalled_jobs(
        task_name=RUN_TASK, seconds_since_heartbeat=stalled_after
    )
    retried = []
    for job in stalled:
        await app.job_manager.retry_job(job, priority=_RECOVERY_PRIORITY)
        retried.append(int(job.id or 0))
    if retried:
        _log.warning("re-queued %d job(s) of stalled workers: %s", len(retried), retried)
    return retried


# --- the jobs ---------------------------------------------------------------------------------


@dataclass
class _Hosted:
    """A graph this worker process serves, and the supervisor scanning it."""

    ref: str
    graph: Pregel[Any, Any]
    supervisor: Supervisor
    stalled_after: float
    found: list[tuple[str, Attribution]] = field(default_factory=list)


_HOSTED: dict[str, _Hosted] = {}


def _hosted(graph_ref: str) -> _Hosted:
    try:
        return _HOSTED[graph_ref]
    except KeyError:
        raise ConfigurationError(
            f"this worker does not serve graph {graph_ref!r} (serving: {sorted(_HOSTED)}); "
            "start one with: python -m taskpilots_graph worker --graph " + graph_ref
        ) from None


def _input_taken(graph: Pregel[Any, Any], thread_id: str, marker: str) -> bool:
    cp = graph.checkpointer
    if cp is None or isinstance(cp, bool):
        return False
    found = cp.list(thread_config(thread_id, None), filter={INPUT_MARKER: marker}, limit=1)
    return next(iter(found), None) is not None


def _start(hosted: _Hosted, thread_id: str, input: Any, marker: str) -> str:
    graph = hosted.graph
    cfg: RunnableConfig = thread_config(thread_id, {"metadata": {INPUT_MARKER: marker}})
    with leased_thread(graph, thread_id, False):  # ThreadBusy: procrastinate retries the job
        if not _input_taken(graph, thread_id, marker):
            try:
                graph.invoke(input, cfg)
            except ToolWaiting:
                return "waiting"
            return "ran"
    # A killed worker took this input already: continue from where the thread stands.
    lost = Attribution(thread_id, "worker_lost", hosted.supervisor.agent)
    return "resumed" if recover(graph, thread_id, lost) else "nothing to do"


def _run_job(
    context: Any,
    graph: str,
    thread_id: str,
    input: Any = None,
    marker: str | None = None,
    attribution: dict[str, Any] | None = None,
) -> str:
    """The run job: start the thread with its input (once), or resume it."""
    hosted = _hosted(graph)
    if marker is not None:
        outcome = _start(hosted, thread_id, input, marker)
    else:
        why = Attribution.from_payload(attribution) if attribution else None
        try:
            outcome = "resumed" if recover(hosted.graph, thread_id, why) else "nothing to do"
        except ThreadBusy:
            outcome = "busy"  # someone runs it; the supervisor looks again if it dies
    _log.info("job %s on thread %r: %s", getattr(context.job, "id", "?"), thread_id, outcome)
    return outcome


async def _supervise_job(context: Any, timestamp: int, graph: str) -> str:
    """The periodic job: one supervisor scan, resumes queued, stalled jobs re-queued."""
    return (await _scan_and_queue(context.app, _hosted(graph))).summary()


async def _scan_and_queue(app: procrastinate.App, hosted: _Hosted) -> ScanReport:
    # The graph is synchronous: scan in a thread, then queue what it found from the loop.
    report = await asyncio.to_thread(hosted.supervisor.tick)
    found, hosted.found = hosted.found, []
    for thread_id, why in found:
        await aenqueue_resume(app, hosted.ref, thread_id, why)
    await aretry_stalled_jobs(app, stalled_after=hosted.stalled_after)
    return report


def _host(ref: str, graph: Pregel[Any, Any], stalled_after: float) -> _Hosted:
    hosted: _Hosted

    def collect(thread_id: str, why: Attribution) -> None:
        hosted.found.append((thread_id, why))

    hosted = _Hosted(ref, graph, Supervisor(graph, dispatch=collect), stalled_after)
    _HOSTED[ref] = hosted
    return hosted


def _every(seconds: float) -> str:
    if not 1 <= seconds <= 59 or seconds != int(seconds):
        raise ConfigurationError(f"supervise_every must be 1..59 whole seconds, got {seconds}")
    return f"* * * * * */{int(seconds)}"  # croniter: the sixth field is seconds


# --- serving ----------------------------------------------------------------------------------


def serve_worker(
    graph_ref: str,
    *,
    db: str | None = None,
    leases: str | None = None,
    concurrency: int = 1,
    name: str | None = None,
    supervise_every: float | None = 1.0,
    stalled_after: float = 30.0,
    heartbeat: float = 5.0,
    wait: bool = True,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Run a queue worker for the graph ``graph_ref`` until stopped (SIGINT / SIGTERM).

    Args:
        graph_ref: ``"package.module:attr"``: a compiled graph, or a factory
            ``build(*, checkpointer, leases)`` (see :mod:`taskpilots_graph.config`).
        db: The runs database (PostgreSQL); default ``TASKPILOTS_POSTGRES_URL``.
        leases: The lease backend; default ``TASKPILOTS_REDIS_URL``, else the database.
        concurrency: Jobs run at once by this worker (each in a thread).
        name: The worker's name in procrastinate's logs and tables.
        supervise_every: Seconds between supervisor scans (a periodic job shared by all
            workers); ``None`` leaves scanning to a separate ``supervise --queue``.
        stalled_after: Seconds without a worker heartbeat after which its jobs are re-run.
        heartbeat: Seconds between this worker's heartbeats (below ``stalled_after``).
        wait: Keep waiting for jobs (``False``: stop once the queue is empty).
        on_ready: Called once the graph is open and the worker is about to start.

    Raises:
        ConfigurationError: For a database that is not PostgreSQL, a bad graph reference or
            a graph without a lease backend.
    """
    if not 0 < heartbeat < stalled_after:
        raise ConfigurationError("heartbeat must be > 0 and below stalled_after")
    settings = StorageSettings.resolve(db=db, leases=leases)
    app = create_worker_app(settings.db_url, pool_size=max(2, concurrency + 2))
    setup_queue(settings.db_url)
    if supervise_every is not None:
        app.periodic(
            cron=_every(supervise_every),
            periodic_id=graph_ref,
            task_kwargs={"graph": graph_ref},
            queueing_lock=f"{SUPERVISE_TASK}:{graph_ref}",
            lock=f"{SUPERVISE_TASK}:{graph_ref}",
            priority=_SUPERVISE_PRIORITY,
        )(app.tasks[SUPERVISE_TASK])
    with open_graph(graph_ref, settings) as graph:
        _host(graph_ref, graph, stalled_after)
        if on_ready is not None:
            on_ready()
        try:
            app.run_worker(
                queues=[QUEUE],
                concurrency=concurrency,
                name=name,
                wait=wait,
                update_heartbeat_interval=heartbeat,
                stalled_worker_timeout=stalled_after,
                delete_jobs="successful",
            )
        finally:
            _HOSTED.pop(graph_ref, None)


def serve_queue_supervisor(
    graph_ref: str,
    *,
    db: str | None = None,
    leases: str | None = None,
    interval: float = 5.0,
    once: bool = False,
    stalled_after: float = 30.0,
    on_report: Callable[[ScanReport], None] | None = None,
    stop: asyncio.Event | None = None,
) -> ScanReport:
    """The supervisor as a process of its own that hands resumes to the queue's workers.

    Every ``interval`` seconds: one scan of the graph's threads, a queued resume for each
    orphaned or due thread, and the jobs of stalled workers put back in the queue.

    Returns:
        The last scan's report.
    """
    check_interval(interval)
    settings = StorageSettings.resolve(db=db, leases=leases)
    app = create_worker_app(settings.db_url)
    setup_queue(settings.db_url)

    async def loop() -> ScanReport:
        stopped = both(stopped_within, stopped_within, stop or asyncio.Event(), interval)
        async with app.open_async():
            with open_graph(graph_ref, settings) as graph:
                hosted = _host(graph_ref, graph, stalled_after)
                # Async only: run by arun_steps, which awaits the coroutine either form gives.
                scan = both(_scan_and_queue, _scan_and_queue, app, hosted)
                try:
                    return await arun_steps(scan_loop(scan, interval, once, stopped, on_report))
                finally:
                    _HOSTED.pop(graph_ref, None)

    return asyncio.run(loop())
