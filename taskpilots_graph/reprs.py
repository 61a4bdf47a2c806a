"""HTML views of the run objects, drawn by whoever registered one (no presentation here).

A thread's :class:`~taskpilots_graph.threads.ThreadInfo`, a
:class:`~taskpilots_graph.replay.Replay`, the
:class:`~taskpilots_graph.metrics.RecoveryMetrics` and a
:class:`~taskpilots_graph.takeover.TakeoverRequest` show as HTML tables in Jupyter. The
HTML is presentation and lives in :mod:`taskpilots_graph.notebook`, which registers one
renderer per type here when it is imported. The domain modules depend on this registry
only, so reading a thread's metrics in a worker never loads the HTML code, and the
notebook package can change without touching them.

Types are named by their qualified name (``module.Class``), so registering a renderer
imports no domain module either. In IPython, ``import taskpilots_graph`` also hands these
types to IPython's HTML formatter by name (see the package's ``__init__``), so they show as
HTML without the notebook package being imported first.

Example:
    >>> from taskpilots_graph.reprs import html_view, register_html
    >>> class Point:
    ...     pass
    >>> register_html(f"{__name__}.Point", lambda p: "<b>point</b>")
    >>> html_view(Point())
    '<b>point</b>'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["html_view", "register_html"]

_RENDERERS: dict[str, Callable[[Any], str]] = {}


def register_html(type_name: str, render: Callable[[Any], str]) -> None:
    """Draw instances of the type named ``type_name`` (``module.Class``) with ``render``."""
    _RENDERERS[type_name] = render


def html_view(obj: object) -> str | None:
    """``obj`` as HTML, from the renderer registered for its type (or a base), else ``None``.

    ``None`` is what IPython's ``_repr_html_`` protocol expects when there is no HTML: the
    object is then shown by its plain ``repr``.
    """
    for cls in type(obj).__mro__:
        render = _RENDERERS.get(f"{cls.__module__}.{cls.__qualname__}")
        if render is not None:
            return render(obj)
    return None
