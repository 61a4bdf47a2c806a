"""Every use of a LangGraph / langchain internal, in one module.

A release that changes one breaks one function here, and ``tests/test_compat.py`` pins
each on the installed versions; each degrades to a safe answer when what it reads is gone.

* :func:`answers_waiting`, :func:`task_durability`, :func:`task_checkpointer`: LangGraph's
  per-task config keys. ``get_config()`` / ``get_runtime()`` expose neither the durability
  mode, the graph's saver, nor whether a resume value waits; no upstream issue found.
* :func:`create_agent_arguments`, :func:`middleware_chain`, :func:`tool_filter`:
  ``create_agent``'s middleware list, to refuse two retry owners of one tool. No hook
  receives the other middleware, the composed ``wrap_tool_call`` handler is a closure, and
  the tool filters of ``ToolRetryMiddleware`` / ``ToolErrorMiddleware`` are private. The
  nearest upstream work, a construction-time check of the order of ``wrap_tool_call``
  middleware, was closed unmerged: https://github.com/langchain-ai/langchain/issues/40694
  (PR https://github.com/langchain-ai/langchain/pull/40695).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "answers_waiting",
    "create_agent_arguments",
    "middleware_chain",
    "node_runnable",
    "task_checkpointer",
    "task_durability",
    "task_id",
    "tool_filter",
]

_SCRATCHPAD = "__pregel_scratchpad"  # per-task state, holding the task's resume values
_DURABILITY = "__pregel_durability"  # the run's durability mode, set for every task
_CHECKPOINTER = "__pregel_checkpointer"  # the compiled graph's saver, set for every task
_TASK_ID = "__pregel_task_id"  # the id the task's put_writes are written under
_MAX_DEPTH = 8


def _configurable(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return config.get("configurable") or {}


def answers_waiting(config: Mapping[str, Any]) -> int:
    """How many of this task's ``interrupt()``s will return an answer when the task runs
    again (0 if unknown: the task then meets its questions the slow way, calling its tools
    again on the way back to them)."""
    pad = _configurable(config).get(_SCRATCHPAD)
    if pad is None:
        return 0
    given = getattr(pad, "resume", None)
    null_resume = getattr(pad, "get_null_resume", None)
    fresh = callable(null_resume) and null_resume(False) is not None
    return (len(given) if isinstance(given, list) else 0) + int(fresh)


def task_durability(config: Mapping[str, Any]) -> str:
    """The run's durability mode (``"async"`` when LangGraph does not say, the cautious
    answer: decisions are then recorded before their side effects)."""
    return str(_configurable(config).get(_DURABILITY) or "async")


def node_runnable(invoke: Any, ainvoke: Any, name: str) -> Any:
    """A graph node with a sync and an async face: LangGraph's own node wrapper (what
    ``add_node`` builds for a plain function; it inspects the signature once, where
    ``RunnableLambda`` does on every call), or ``RunnableLambda`` if that moved."""
    try:
        from langgraph._internal._runnable import RunnableCallable
    except ImportError:  # pragma: no cover - a LangGraph without the private module
        from langchain_core.runnables import RunnableLambda

        return RunnableLambda(invoke, afunc=ainvoke, name=name)
    return RunnableCallable(invoke, ainvoke, name=name)


def task_id(config: Mapping[str, Any]) -> str | None:
    """The id of the LangGraph task running (``None`` outside a task)."""
    found = _configurable(config).get(_TASK_ID)
    return found if isinstance(found, str) and found else None


def task_checkpointer(config: Mapping[str, Any]) -> Any:
    """The saver of the graph running this task (``None`` when LangGraph does not say)."""
    return _configurable(config).get(_CHECKPOINTER)


def create_agent_arguments(depth: int = 4) -> tuple[list[Any], list[Any]] | None:
    """``(middleware, tools)`` of the ``create_agent`` call building the agent, read from its
    frame when called (at most ``depth`` frames) from inside it; ``None`` elsewhere."""
    frame = inspect.currentframe()
    try:
        for _ in range(depth + 1):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            if frame.f_code.co_name == "create_agent" and "middleware" in frame.f_locals:
                middleware = frame.f_locals["middleware"]
                tools = frame.f_locals.get("tools") or ()
                return list(middleware), list(tools)
        return None
    finally:
        del frame  # frames hold their locals alive


def tool_filter(layer: Any) -> list[str] | None:
    """The tools a ``ToolRetryMiddleware`` / ``ToolErrorMiddleware`` covers (``None``: all)."""
    wanted = getattr(layer, "_tool_filter", None)
    return list(wanted) if isinstance(wanted, Sequence) else None


def _owner_of(fn: Any, kind: type) -> Any:
    for _ in range(_MAX_DEPTH):
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, kind):
            return owner
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is None:
            return None
        fn = wrapped  # traceable() keeps the bound hook as __wrapped__
    return None


def _cells(fn: Any) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if code is None or not closure:
        return {}
    values: dict[str, Any] = {}
    for name, cell in zip(code.co_freevars, closure, strict=False):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return values


def _flatten(composed: Any, kind: type, depth: int = 0) -> list[Any]:
    """The middleware of a chain composed by ``create_agent``, outermost first."""
    if depth > 64:
        return []
    owner = _owner_of(composed, kind)
    if owner is not None:
        return [owner]
    cells = _cells(composed)
    if "outer" in cells and "inner" in cells:
        return [
            *_flatten(cells["outer"], kind, depth + 1),
            *_flatten(cells["inner"], kind, depth + 1),
        ]
    return []


def _tool_node(handler: Callable[..., Any]) -> Any:
    """The ``ToolNode`` behind a ``wrap_tool_call`` handler, found through its closures."""
    seen: set[int] = set()
    frontier: list[Any] = [handler]
    for _ in range(_MAX_DEPTH):
        following: list[Any] = []
        for fn in frontier:
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            for value in _cells(fn).values():
                if hasattr(value, "_wrap_tool_call") and hasattr(value, "tools_by_name"):
                    return value
                if callable(value):
                    following.append(value)
        frontier = following
    return None


def middleware_chain(handler: Callable[..., Any], *, is_async: bool) -> list[Any] | None:
    """The ``wrap_tool_call`` middleware of the running agent, outermost first, recovered
    from the ``handler`` a hook is given; ``None`` when it cannot be (then only an explicit
    ``check_middleware`` call guards the configuration)."""
    from langchain.agents.middleware import AgentMiddleware

    node = _tool_node(handler)
    if node is None:
        return None
    composed = getattr(node, "_awrap_tool_call" if is_async else "_wrap_tool_call", None)
    if composed is None:
        return None
    return _flatten(composed, AgentMiddleware) or None
