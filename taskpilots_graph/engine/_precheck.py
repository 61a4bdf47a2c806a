"""Running a tool's pre-check for the protocol's :class:`~._requests.RunPrecheck`, bounded.

A pre-check that hangs must not hold the run (and its thread lease) for good, and one that
fails must not let a non-idempotent effect run again: both answer ``Unknown``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import threading
from collections.abc import Callable
from typing import Any

from langgraph.errors import GraphBubbleUp

from taskpilots_graph.engine._call import CallContext
from taskpilots_graph.engine._requests import RunPrecheck
from taskpilots_graph.ledger import Unknown

__all__ = ["acall_precheck", "call_precheck"]


def _timed_out(limit: float) -> Unknown:
    return Unknown(f"pre-check timed out after {limit:g} s")


def _in_worker(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
    """Run ``fn(*args)`` in a new daemon thread (with the caller's context variables).

    Not a pool: a hung pre-check keeps its thread for good (Python cannot kill a thread),
    and a daemon thread at least never holds up the interpreter's exit, as a pool's
    workers would (they are joined at exit).
    """
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    context = contextvars.copy_context()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(context.run(fn, *args))
        except BaseException as exc:  # handed to the waiting caller, if any is left
            future.set_exception(exc)

    threading.Thread(target=run, name="taskpilots-precheck", daemon=True).start()
    return future


async def _await_worker(fn: Callable[..., Any], *args: Any) -> Any:
    """:func:`_in_worker` awaited: the answer is handed to this loop, if it still runs."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[Any] = loop.create_future()

    def deliver(done: concurrent.futures.Future[Any]) -> None:
        def settle() -> None:
            if waiter.done():
                return  # timed out meanwhile: the late answer is dropped
            if (error := done.exception()) is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(done.result())

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle)

    _in_worker(fn, *args).add_done_callback(deliver)
    return await waiter


def call_precheck(ctx: CallContext, request: RunPrecheck) -> Any:
    """Carry out the protocol's :class:`RunPrecheck`: the tool's pre-check, or ``Unknown``
    when the pre-check itself fails (fail closed: a question nobody answered never lets
    a non-idempotent effect run again).

    The pre-check runs in a daemon worker thread and is waited for at most the tool's
    ``precheck_timeout``; past it the answer is ``Unknown("pre-check timed out after N
    s")``, so the run goes on (a non-idempotent effect to a person) and ends, releasing its
    thread lease. The hung thread cannot be killed: it stays until the pre-check returns,
    and its late answer is dropped. ``precheck_timeout=None`` runs it inline, unbounded.
    """
    spec = ctx.spec
    assert spec is not None, "only side effects have a pre-check"
    assert spec.precheck is not None, "the protocol asks only tools that have a pre-check"
    precheck, limit = spec.precheck, spec.precheck_timeout
    try:
        if limit is None:
            return precheck(request.key, request.args)
        future = _in_worker(precheck, request.key, request.args)
        try:
            return future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise  # the pre-check's own TimeoutError
            return _timed_out(limit)
    except GraphBubbleUp:
        raise
    except Exception as exc:
        # A pre-check that cannot answer is an unknown outcome: fail closed, never execute.
        return Unknown(f"pre-check raised {type(exc).__name__}: {exc}")


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


async def acall_precheck(ctx: CallContext, request: RunPrecheck) -> Any:
    """Async form of :func:`call_precheck` (the pre-check may be a coroutine function).

    A coroutine pre-check is awaited with ``asyncio.wait_for`` (cancelled at the limit); a
    plain function runs in a daemon worker thread, as in :func:`call_precheck`, so that a
    hung one blocks neither the event loop nor the run.
    """
    spec = ctx.spec
    assert spec is not None, "only side effects have a pre-check"
    assert spec.precheck is not None, "the protocol asks only tools that have a pre-check"
    precheck, limit = spec.precheck, spec.precheck_timeout
    loop = asyncio.get_running_loop()
    deadline = None if limit is None else loop.time() + limit
    try:
        if limit is None or _is_async(precheck):
            answer = precheck(request.key, request.args)
        else:
            answer = await asyncio.wait_for(
                _await_worker(precheck, request.key, request.args), limit
            )
        if not inspect.isawaitable(answer):
            return answer
        left = None if deadline is None else max(0.0, deadline - loop.time())
        return await asyncio.wait_for(answer, left)
    except TimeoutError as exc:
        if deadline is not None and loop.time() >= deadline:
            return _timed_out(limit or 0.0)
        return Unknown(f"pre-check raised {type(exc).__name__}: {exc}")
    except GraphBubbleUp:
        raise
    except Exception as exc:
        return Unknown(f"pre-check raised {type(exc).__name__}: {exc}")
