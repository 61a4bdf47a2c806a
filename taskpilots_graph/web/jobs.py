"""Decisions carried out in the background: the page answers at once and shows the outcome.

A decision continues the run (``tp.decide``), which may take as long as the run does, so it
runs on one worker thread; decisions are carried out one at a time, in order.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal

from langgraph.pregel import Pregel

from taskpilots_graph.decisions import decide
from taskpilots_graph.errors import StaleDecision, TaskPilotsError, ToolWaiting
from taskpilots_graph.takeover import Decision
from taskpilots_graph.threads import recovery_api, thread_info
from taskpilots_graph.web.view import named_effects, outcome_of

__all__ = ["DecisionJob", "DecisionJobs", "JobStatus"]

JobStatus = Literal["running", "done", "failed"]


@dataclass(frozen=True, slots=True)
class DecisionJob:
    """One decision being carried out.

    Attributes:
        job_id: Its id (in the thread page's URL).
        thread_id: The thread decided.
        action: The decision's action.
        decided_by: Who decided.
        interrupt_id: The takeover it answers.
        status: ``running``, ``done`` or ``failed``.
        outcome: What happened, in words (the thread's status, or the error).
        submitted_at: When the decision was sent.
    """

    job_id: str
    thread_id: str
    action: str
    decided_by: str
    interrupt_id: str
    status: JobStatus
    outcome: str
    submitted_at: datetime


_SHOWN = 300  # characters of the run's last message shown with the outcome


def _last_text(result: Any) -> str:
    messages = result.get("messages") if isinstance(result, dict) else None
    content = getattr(messages[-1], "content", None) if messages else None
    text = content if isinstance(content, str) else ""
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "…"


class DecisionJobs:
    """Runs decisions on a worker thread and remembers how each ended."""

    def __init__(self, graph: Pregel[Any, Any], checkpointer: Any) -> None:
        self.graph = graph
        self.checkpointer = checkpointer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="taskpilots-inbox")
        self._jobs: dict[str, DecisionJob] = {}
        self._lock = threading.Lock()

    def submit(self, thread_id: str, decision: Decision) -> DecisionJob:
        """Queue ``decision`` for ``thread_id``; returns the job (status ``running``)."""
        job = DecisionJob(
            job_id=uuid.uuid4().hex,
            thread_id=thread_id,
            action=decision.action,
            decided_by=decision.decided_by or "",
            interrupt_id=decision.interrupt_id or "",
            status="running",
            outcome="the decision is being carried out",
            submitted_at=datetime.now(UTC),
        )
        with self._lock:
            self._jobs[job.job_id] = job
        self._pool.submit(self._run, job, decision)
        return job

    def running_for(self, interrupt_id: str) -> DecisionJob | None:
        """The job still carrying out an answer to that takeover, if any (a form sent twice
        before the first answer was applied must not queue a second one)."""
        with self._lock:
            jobs = list(self._jobs.values())
        running = [j for j in jobs if j.interrupt_id == interrupt_id and j.status == "running"]
        return running[0] if running else None

    def get(self, job_id: str) -> DecisionJob | None:
        """The job with that id, if this process ran it."""
        with self._lock:
            return self._jobs.get(job_id)

    def recent(self, limit: int = 20) -> list[DecisionJob]:
        """The latest jobs, newest first."""
        with self._lock:
            jobs = sorted(self._jobs.values(), key=lambda j: j.submitted_at, reverse=True)
        return jobs[:limit]

    def _finish(self, job: DecisionJob, status: JobStatus, outcome: str) -> None:
        with self._lock:
            self._jobs[job.job_id] = replace(job, status=status, outcome=outcome)

    def _run(self, job: DecisionJob, decision: Decision) -> None:
        try:
            result = decide(self.graph, job.thread_id, decision)
        except ToolWaiting as waiting:
            when = datetime.fromtimestamp(waiting.retry_at, UTC).isoformat(timespec="seconds")
            self._finish(job, "done", f"the run waits for a tool until {when}")
        except StaleDecision as exc:
            self._finish(job, "failed", f"refused, nothing changed: {exc}")
        except TaskPilotsError as exc:
            self._finish(job, "failed", str(exc))
        except Exception as exc:  # the run itself failed: show it rather than lose it
            self._finish(job, "failed", f"{type(exc).__name__}: {exc}")
        else:
            cp = recovery_api(self.checkpointer)
            info = thread_info(cp, job.thread_id)
            outcome = outcome_of(info, cp.events(job.thread_id), cp.ledger(job.thread_id))
            words = f"the thread is now {outcome.label}"
            if outcome.not_undone:
                words += f"; not undone (no compensator): {named_effects(outcome.not_undone)}"
            if outcome.uncertain:
                words += f"; may have happened, not undone: {named_effects(outcome.uncertain)}"
            last = _last_text(result)
            self._finish(job, "done", words + (f"; last message: {last}" if last else ""))

    def close(self) -> None:
        """Wait for the running decision, then stop the worker."""
        self._pool.shutdown(wait=True)
