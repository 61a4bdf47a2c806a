"""One retry owner: refuse a middleware stack in which two layers would retry one tool.

``create_agent`` composes the ``wrap_tool_call`` hooks of its middleware into one chain
(the first in the list is the outermost) and hands each hook the rest of the chain as its
``handler``. :func:`check_middleware` looks at that order and refuses:

* a ``ToolRetryMiddleware`` covering a tool that :class:`RecoveryMiddleware` also retries
  (its policy has ``max_attempts > 1``): two owners multiply the attempts and the second
  one knows nothing of the tool policy or the ledger;
* a ``ToolRetryMiddleware`` *inside* the recovery middleware (later in the list) covering a
  side-effecting tool: its retries would run the effect again within one ledger attempt,
  behind the pre-check's back;
* a ``ToolErrorMiddleware`` inside the recovery middleware covering a side-effecting tool:
  it turns a timeout into an error message, which hides from the ledger that the request may
  have reached the service.

:func:`middleware_chain` recovers the stack from a ``handler`` at the first call, so the
check also runs for users who never call :func:`check_middleware` themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from langchain.agents.middleware import AgentMiddleware, ToolRetryMiddleware
from langchain.agents.middleware.tool_error import ToolErrorMiddleware
from langchain_core.tools import BaseTool

from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.tools import spec_of

if TYPE_CHECKING:
    from taskpilots_graph.middleware._middleware import RecoveryMiddleware

__all__ = ["check_middleware", "middleware_chain"]

_ANY_TOOL = "*"
_MAX_DEPTH = 8


def _covers(layer: AgentMiddleware[Any, Any, Any], tool: str) -> bool:
    wanted: list[str] | None = getattr(layer, "_tool_filter", None)
    return wanted is None or tool == _ANY_TOOL or tool in wanted


def check_middleware(
    middleware: Sequence[AgentMiddleware[Any, Any, Any]],
    tools: Iterable[BaseTool | str] | None = None,
) -> None:
    """Refuse a ``create_agent`` middleware list with two retry owners for one tool.

    Call it where the agent is built (``RecoveryMiddleware`` runs the same check on the
    first call of each tool in any case)::

        middleware = [tp.RecoveryMiddleware(cp), ToolRetryMiddleware(tools=["kb_search"])]
        tp.check_middleware(middleware, tools)  # ConfigurationError: two retry owners

    Args:
        middleware: The list given to ``create_agent``, in its order (first = outermost).
        tools: The agent's tools (or their names); without them, a filterless
            ``ToolRetryMiddleware`` is judged against the default policy.

    Raises:
        ConfigurationError: Naming the tool and the two layers, with the fix.
    """
    from taskpilots_graph.middleware._middleware import RecoveryMiddleware

    layers = list(middleware)
    ours = [i for i, m in enumerate(layers) if isinstance(m, RecoveryMiddleware)]
    if len(ours) > 1:
        raise ConfigurationError(
            "RecoveryMiddleware appears more than once; use one instance per agent"
        )
    if not ours:
        return
    index = ours[0]
    recovery = layers[index]
    assert isinstance(recovery, RecoveryMiddleware)
    known = [t for t in tools or () if isinstance(t, BaseTool)]
    names = [t.name if isinstance(t, BaseTool) else str(t) for t in tools or ()]
    effects = {t.name for t in known if spec_of(t) is not None}
    candidates = names or [*recovery.policies, _ANY_TOOL]
    for position, layer in enumerate(layers):
        inner = position > index
        for tool in candidates:
            if not _covers(layer, tool):
                continue
            _check_layer(recovery, layer, tool, inner=inner, side_effect=tool in effects)


def _check_layer(
    recovery: RecoveryMiddleware,
    layer: AgentMiddleware[Any, Any, Any],
    tool: str,
    *,
    inner: bool,
    side_effect: bool,
) -> None:
    label = "every tool" if tool == _ANY_TOOL else f"tool {tool!r}"
    if isinstance(layer, ToolRetryMiddleware):
        if recovery.policy(None if tool == _ANY_TOOL else tool).max_attempts > 1:
            raise ConfigurationError(
                f"both RecoveryMiddleware and ToolRetryMiddleware would retry {label}; one "
                "layer owns retries: drop ToolRetryMiddleware (set tp.ToolPolicy(max_attempts="
                "...) for the tool instead), or give the tool tp.ToolPolicy(max_attempts=1) and "
                "limit ToolRetryMiddleware(tools=[...]) to it, placed before RecoveryMiddleware"
            )
        if inner and side_effect:
            raise ConfigurationError(
                f"ToolRetryMiddleware placed after RecoveryMiddleware would retry the side "
                f"effect {label} inside one ledger attempt, without the pre-check; drop it or "
                "place it before RecoveryMiddleware in the middleware list"
            )
    if isinstance(layer, ToolErrorMiddleware) and inner and side_effect:
        raise ConfigurationError(
            f"ToolErrorMiddleware placed after RecoveryMiddleware would hide from the ledger "
            f"that a failed call of the side effect {label} may have reached the service; "
            "place it before RecoveryMiddleware in the middleware list"
        )


def _owner_of(fn: Any) -> AgentMiddleware[Any, Any, Any] | None:
    for _ in range(_MAX_DEPTH):
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, AgentMiddleware):
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


def _flatten(composed: Any, depth: int = 0) -> list[AgentMiddleware[Any, Any, Any]]:
    """The middleware of a chain composed by ``create_agent``, outermost first."""
    if depth > 64:
        return []
    owner = _owner_of(composed)
    if owner is not None:
        return [owner]
    cells = _cells(composed)
    if "outer" in cells and "inner" in cells:
        return [*_flatten(cells["outer"], depth + 1), *_flatten(cells["inner"], depth + 1)]
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


def middleware_chain(
    handler: Callable[..., Any], *, is_async: bool
) -> list[AgentMiddleware[Any, Any, Any]] | None:
    """The tool-call middleware of the running agent, outermost first, or ``None``.

    ``None`` when the chain cannot be recovered (a handler not built by ``create_agent``);
    then only an explicit :func:`check_middleware` call guards the configuration.
    """
    node = _tool_node(handler)
    if node is None:
        return None
    composed = getattr(node, "_awrap_tool_call" if is_async else "_wrap_tool_call", None)
    if composed is None:
        return None
    return _flatten(composed) or None
