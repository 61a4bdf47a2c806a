"""Child-process side of the event-log tests: concurrent writers, SIGKILL drills, setup races.

``test_event_log`` runs these functions in separate processes started by a multiprocessing
*forkserver* that imported this module (and with it LangGraph) once. Importing
``taskpilots_graph`` costs 1.5-2 s of CPU, which over some twenty children would dominate the
whole test file; forking a server that has already paid for it costs milliseconds. Each child
is still a process of its own: it opens its own database connections after the fork, and
SIGKILL really kills it with those connections open.

Every function talks to the test over a ``multiprocessing`` connection, one message at a time,
``(tag, value)``: ``("ready", None)`` once its connections are open, then it waits for the
test's ``"go"`` (so all children are released at the same instant), then ``("done", ...)``.
A failure is sent as ``("error", traceback)`` before the child exits non-zero.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Concatenate, ParamSpec

from taskpilots_graph import RecoveryCheckpointer

P = ParamSpec("P")


def _reporting(
    fn: Callable[Concatenate[Connection, P], None],
) -> Callable[Concatenate[Connection, P], None]:
    """Send any exception to the test as ``("error", traceback)``, then exit with status 1."""

    @functools.wraps(fn)
    def run(chan: Connection, *args: P.args, **kwargs: P.kwargs) -> None:
        try:
            fn(chan, *args, **kwargs)
        except BaseException:
            chan.send(("error", traceback.format_exc()))
            sys.exit(1)

    return run


def _wait_for_go(chan: Connection) -> None:
    chan.send(("ready", None))
    if chan.recv() != "go":
        raise RuntimeError("expected 'go' from the test")


@_reporting
def append_events(
    chan: Connection, conn_string: str, *, thread: str, count: int, writer: int
) -> None:
    """Append ``count`` events ``{"writer": writer, "i": i}`` to ``thread``; send the seqs."""
    with RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        _wait_for_go(chan)
        seqs = [
            cp.append_event(thread, "step_completed", {"writer": writer, "i": i}).seq
            for i in range(count)
        ]
    chan.send(("done", seqs))


@_reporting
def append_then_hang(chan: Connection, conn_string: str, *, thread: str, attempt: int) -> None:
    """Append one event, report its seq once ``append_event`` returned, then wait to be killed."""
    with RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        event = cp.append_event(thread, "tool_invoked", {"attempt": attempt})
        chan.send(("done", event.seq))
        time.sleep(300)  # the test SIGKILLs us long before this ends


@_reporting
def run_setup(chan: Connection, conn_string: str) -> None:
    """Call ``setup()`` when the test says go."""
    with RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        _wait_for_go(chan)
        cp.setup()
    chan.send(("done", None))
