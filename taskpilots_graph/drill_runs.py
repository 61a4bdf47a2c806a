"""How a drill runs a thread: as an operator would, here or in a child process.

:func:`drive` runs (or resumes) a thread until it settles or looks endless, with its tools
journaled (:mod:`taskpilots_graph.drill_journal`), one of them faulty if the drill says so,
on a virtual clock (backoffs take no time). :func:`in_child` does the same in a fresh Python
process, which the crash drill has SIGKILLed right after a side effect, then starts again
to resume the thread by id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from langchain_core.runnables import RunnableConfig

from taskpilots_graph.config import load_graph
from taskpilots_graph.drill_journal import Journal, Wrap, instrumented
from taskpilots_graph.errors import ConfigurationError

__all__ = ["MAX_ROUNDS", "Drive", "child_drive", "drive", "in_child", "last_line"]

MAX_ROUNDS = 12
"""Resumes a drill allows before it calls the run an endless replay."""

CHILD_TIMEOUT_S = 180.0
RUN_CONFIG: RunnableConfig = {"recursion_limit": 200}


def _settled(graph: Any, thread_id: str) -> str:
    snapshot = graph.get_state({"configurable": {"thread_id": thread_id}})
    if snapshot.interrupts:
        return "awaiting_human"
    flow = snapshot.values.get("flow") if isinstance(snapshot.values, dict) else None
    if isinstance(flow, dict) and flow.get("stage"):
        return str(flow["stage"])
    return "running" if (snapshot.next or snapshot.tasks) else "closed"


@dataclass
class Drive:
    """Where a drill thread's run ended, after how many resumes, and the errors on the way."""

    settled: str
    resumes: int = 0
    errors: list[str] = field(default_factory=list)


def _operate(graph: Any, thread_id: str, input_: Any, clock: Any, *, start: bool) -> Drive:
    """Run (or resume) a thread as an operator would until it settles or looks endless.

    A ``ToolWaiting`` run is resumed once its ``retry_at`` has passed on the virtual clock;
    a run that raised is resumed by id, as after any failure; a takeover stops the drive.
    """
    from taskpilots_graph import runner
    from taskpilots_graph.errors import PendingTakeover, ThreadNotFound, ToolWaiting

    drive = Drive(settled="running")
    for round_ in range(MAX_ROUNDS + 1):
        try:
            if start and round_ == 0:
                runner.run(graph, thread_id, input_, config=RUN_CONFIG)
            else:
                drive.resumes += 1
                runner.resume(graph, thread_id, config=RUN_CONFIG)
        except ToolWaiting as waiting:
            clock.advance(max(0.0, waiting.retry_at - clock.now()))
            continue
        except PendingTakeover:
            drive.settled = "awaiting_human"
            return drive
        except ThreadNotFound:
            drive.settled = "lost"
            drive.errors.append("no checkpoint to resume: the run would restart from its entry")
            return drive
        except ConfigurationError:
            raise  # the graph is set up wrongly: no drill can say anything about it
        except Exception as exc:  # the user's graph failed: resume it, as an operator would
            drive.errors.append(f"{type(exc).__name__}: {exc}")
            continue
        drive.settled = _settled(graph, thread_id)
        if drive.settled != "running":
            return drive
    drive.settled = "endless"
    return drive


def drive(
    graph: Any,
    journal: Journal,
    thread_id: str,
    input_: Any,
    *,
    start: bool = True,
    fault: tuple[str, Wrap] | None = None,
    kill_after: str | None = None,
) -> tuple[Drive, dict[str, Any]]:
    """Drive a thread with its tools journaled (``fault``: one tool's injector, ``kill_after``:
    the tool whose first execution kills the process); the drive, and the fault injectors
    (:class:`~taskpilots_graph.testing.FaultyTool`) by tool."""
    from taskpilots_graph import testing

    with (
        instrumented(graph, journal, thread_id, fault=fault, kill_after=kill_after) as faults,
        testing.fake_clock() as clock,
    ):
        return _operate(graph, thread_id, input_, clock, start=start), faults


def in_child(
    spec: str, conn: str, journal: Journal, thread_id: str, input_: Any, kill_after: str | None
) -> subprocess.CompletedProcess[str]:
    """Start (to be killed right after tool ``kill_after``) or resume (``kill_after=None``)
    a thread in a child process, which prints its :class:`Drive` last (see
    :func:`child_drive`)."""
    where = {"spec": spec, "conn": conn, "journal": journal.path, "thread_id": thread_id}
    payload = {**where, "input": input_, "start": kill_after is not None, "kill_after": kill_after}
    env = dict(os.environ)
    # The child imports the user's module exactly as this process can.
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    return subprocess.run(
        [sys.executable, "-m", "taskpilots_graph.drill_runs", json.dumps(payload)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )


def last_line(child: subprocess.CompletedProcess[str]) -> str:
    """The last line a child process wrote to its stderr."""
    return (child.stderr.strip().splitlines() or ["no output"])[-1]


def child_drive(child: subprocess.CompletedProcess[str]) -> Drive:
    """The drive a child process reported, or ``error`` (its last line) if it failed."""
    if child.returncode != 0:
        return Drive(settled="error", errors=[last_line(child)])
    return Drive(**json.loads(child.stdout.strip().splitlines()[-1]))


def _child_main(argv: list[str]) -> int:
    """One life of the crash drill's worker: start (and die) or resume the thread."""
    from taskpilots_graph.checkpointers import RecoveryCheckpointer

    payload = json.loads(argv[0])
    ref = load_graph(payload["spec"])
    journal = Journal(payload["journal"])
    with RecoveryCheckpointer.from_conn_string(payload["conn"]) as cp:
        graph = ref.build(cp)
        flags = {k: payload[k] for k in ("start", "kill_after")}
        done, _ = drive(graph, journal, payload["thread_id"], payload["input"], **flags)
    print(json.dumps(asdict(done)))
    return 0


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))
