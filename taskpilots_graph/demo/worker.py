"""The drills' worker: ``python -m taskpilots_graph.demo.worker [--serve] MODE DB SERVICES BATCH
[DENSITY]``.

Without ``--serve`` it processes the batch file once (start or resume every ticket's
thread) and exits. With ``--serve`` it is a fork server: it imports the library once, then
for every ``run [SECONDS]`` line on stdin forks a fresh child that processes the batch,
reaps it, and answers ``exit CODE`` (``-9`` when the child was SIGKILLed; with SECONDS, the
server itself SIGKILLs a child still running after that long, and answers ``exit -9
timed``). A drill restarts its worker after every kill; forking from a parent that has
only imported modules makes a restart take milliseconds instead of the seconds an
interpreter needs to import LangGraph, while each child is still a process of its own.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from taskpilots_graph.demo.batch import SERVING, run_batch

__all__ = ["main"]

POLL_S = 0.01


def _warm_up() -> None:
    """Import what a child would import lazily, so that every child starts with it loaded."""
    from langgraph.checkpoint.sqlite import SqliteSaver  # noqa: F401  (the plain mode's)

    import taskpilots_graph as tp

    for name in ("RecoveryCheckpointer", "create_recovery_agent", "resume", "PendingTakeover"):
        getattr(tp, name)


def _child(mode: str, conn: str, services: str, tickets: list[dict[str, Any]], density: str) -> int:
    try:
        run_batch(mode, conn, services, tickets, density=density)  # type: ignore[arg-type]
    except BaseException:  # reported like an uncaught error of a worker process
        traceback.print_exc()
        return 1
    return 0


def _reap(pid: int, seconds: float | None) -> tuple[int, bool]:
    """Wait for child ``pid``; SIGKILL it after ``seconds``. Its exit code, and if we killed."""
    deadline = None if seconds is None else time.monotonic() + seconds
    killed = False
    while True:
        # Polling, not a blocking wait: the deadline needs the child still unreaped, so
        # its pid cannot have been reused when the kill is sent.
        done, status = os.waitpid(pid, os.WNOHANG if deadline is not None else 0)
        if done:
            return os.waitstatus_to_exitcode(status), killed
        if deadline is not None and time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            killed, deadline = True, None
        else:
            time.sleep(POLL_S)


def serve(mode: str, conn: str, services: str, tickets: list[dict[str, Any]], density: str) -> int:
    """The fork server's loop (see the module docstring)."""
    _warm_up()
    print(SERVING, flush=True)
    for line in sys.stdin:
        command, *arg = line.split()
        if command != "run":
            break
        sys.stdout.flush()  # a child must not inherit (and print again) buffered output
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = _child(mode, conn, services, tickets, density)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # never back into the server's loop
        seconds = float(arg[0]) if arg and arg[0] != "-" else None
        code, killed = _reap(pid, seconds)
        print(f"exit {code}{' timed' if killed else ''}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    """Process the batch file once, or serve forks of the worker (``--serve``)."""
    serving = argv[:1] == ["--serve"]
    mode, conn_string, services_path, batch_file, *rest = argv[1:] if serving else argv
    density = rest[0] if rest else "every_step"
    if mode not in ("agent", "plain"):
        print(f"unknown mode {mode!r}; use 'agent' or 'plain'", file=sys.stderr)
        return 2
    tickets = json.loads(Path(batch_file).read_text())
    if serving:
        return serve(mode, conn_string, services_path, tickets, density)
    run_batch(mode, conn_string, services_path, tickets, density=density)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
