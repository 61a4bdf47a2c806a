"""One body for a sync function and its async twin.

The body is a generator that yields each I/O call it needs as :func:`io` (or :func:`both`)
and receives its result; :func:`run_steps` makes the calls in their sync form,
:func:`arun_steps` their async form (awaiting what is awaitable). An exception a call raises
is thrown into the body at its ``yield``, where its handlers are. :func:`synced` and
:func:`asynced` turn a body method ``_name`` into the methods ``name`` and ``aname``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine, Generator
from functools import partial, wraps
from typing import Any, NamedTuple, ParamSpec, TypeVar

__all__ = ["IO", "Steps", "arun_steps", "asynced", "both", "io", "run_steps", "synced"]

P = ParamSpec("P")
T = TypeVar("T")


class IO(NamedTuple):
    """One I/O call in its two forms."""

    sync: Callable[[], Any]
    async_: Callable[[], Any]  # awaited when it returns an awaitable


Steps = Generator[IO, Any, T]


def both(sync: Callable[..., Any], async_: Callable[..., Any], /, *args: Any, **kwargs: Any) -> IO:
    """``sync(*args, **kwargs)``, or ``async_(*args, **kwargs)`` (awaited if awaitable)."""
    return IO(partial(sync, *args, **kwargs), partial(async_, *args, **kwargs))


def io(target: Any, name: str, *args: Any, **kwargs: Any) -> IO:
    """``target.name(...)``, or ``await target.aname(...)`` (``_aname`` for ``_name``)."""
    aname = f"_a{name[1:]}" if name.startswith("_") else f"a{name}"
    return IO(
        lambda: getattr(target, name)(*args, **kwargs),
        lambda: getattr(target, aname)(*args, **kwargs),
    )


def run_steps(steps: Steps[T]) -> T:
    """Run ``steps`` with the sync form of each call."""
    send: Callable[[Any], IO] = steps.send
    value: Any = None
    while True:
        try:
            call = send(value)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            value, send = call.sync(), steps.send
        except BaseException as exc:
            value, send = exc, steps.throw


async def arun_steps(steps: Steps[T]) -> T:
    """Run ``steps`` with the async form of each call."""
    send: Callable[[Any], IO] = steps.send
    value: Any = None
    while True:
        try:
            call = send(value)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            value = call.async_()
            if inspect.isawaitable(value):
                value = await value
            send = steps.send
        except BaseException as exc:
            value, send = exc, steps.throw


def _named(function: Callable[..., Any], name: str) -> None:
    function.__name__ = name
    function.__qualname__ = f"{function.__qualname__.rpartition('.')[0]}.{name}".lstrip(".")
    # ``wraps`` points signature() at the body, whose return is ``Steps[T]``: show ``T``,
    # what a caller gets (help(), Jupyter, documentation tools).
    signature = inspect.signature(function)
    returned = signature.return_annotation
    if isinstance(returned, str) and returned.startswith("Steps[") and returned.endswith("]"):
        function.__signature__ = signature.replace(  # type: ignore[attr-defined]
            return_annotation=returned[len("Steps[") : -1]
        )


def synced(steps: Callable[P, Steps[T]]) -> Callable[P, T]:
    """The function (or method) running body ``steps`` (``_name``) with :func:`run_steps`, named
    ``name`` and documented by the body's docstring."""

    @wraps(steps)
    def method(*args: P.args, **kwargs: P.kwargs) -> T:
        return run_steps(steps(*args, **kwargs))

    _named(method, steps.__name__[1:])
    return method


def asynced(steps: Callable[P, Steps[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """The coroutine function (or method) running body ``steps`` (``_name``) with
    :func:`arun_steps`, named ``aname``."""

    @wraps(steps)
    async def method(*args: P.args, **kwargs: P.kwargs) -> T:
        return await arun_steps(steps(*args, **kwargs))

    _named(method, f"a{steps.__name__[1:]}")
    role = "meth" if "." in steps.__qualname__ else "func"
    method.__doc__ = f"Async form of :{role}:`{steps.__name__[1:]}`."
    return method
