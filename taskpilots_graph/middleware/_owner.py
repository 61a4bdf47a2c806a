"""One retry owner: refuse a middleware stack in which two layers would retry one tool.

``create_agent`` composes the ``wrap_tool_call`` hooks of its middleware into one chain
(the first in the list is the outermost) and hands each hook the rest of the chain as its
``handler``. The rules are the package docstring's (composing with langchain's own
middleware): two retry owners multiply the attempts, and a retry or error layer inside this
one acts behind the ledger's back. :func:`taskpilots_graph._compat.middleware_chain`
recovers the stack from a ``handler`` at the first call, so the check also runs for users
who never call :func:`check_middleware` themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from langchain.agents.middleware import AgentMiddleware, ToolRetryMiddleware
from langchain.agents.middleware.tool_error import ToolErrorMiddleware
from langchain_core.tools import BaseTool

from taskpilots_graph._compat import tool_filter
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.tools import spec_of

if TYPE_CHECKING:
    from taskpilots_graph.middleware._middleware import RecoveryMiddleware

__all__ = ["check_middleware"]

_ANY_TOOL = "*"


def _covers(layer: AgentMiddleware[Any, Any, Any], tool: str) -> bool:
    wanted = tool_filter(layer)
    return wanted is None or tool == _ANY_TOOL or tool in wanted


def check_middleware(
    middleware: Sequence[AgentMiddleware[Any, Any, Any]],
    tools: Iterable[BaseTool | str] | None = None,
) -> None:
    """Refuse a ``create_agent`` middleware list with two retry owners for one tool.

    Call it where the agent is built (``RecoveryMiddleware`` runs the same check on the
    first call of each tool in any case)::

        middleware = [tp.RecoveryMiddleware(cp), ToolRetryMiddleware(tools=["kb_search"])]
        check_middleware(middleware, tools)  # ConfigurationError: two retry owners

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
