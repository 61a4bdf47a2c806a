"""Interactive exploration in Jupyter: HTML views, plots and a takeover widget.

* :func:`timeline` / :func:`ledger_view` read a thread and return frozen views that a
  notebook shows as colour-coded, JavaScript-free HTML tables (plain text in ``repr``).
  ``RecoveryMetrics``, ``Replay``, ``ThreadInfo`` and ``TakeoverRequest`` show as HTML
  too: importing this package registers their views (:mod:`taskpilots_graph.reprs`), and in
  IPython ``import taskpilots_graph`` alone is enough.
* :func:`plot_timeline` / :func:`plot_batch` draw a run's recovery and a batch's metrics
  with matplotlib (the ``notebooks`` extra), returning a figure.
* :func:`takeover_widget` shows a pending takeover with one button per option
  (ipywidgets, the ``notebooks`` extra); a click calls ``tp.decide``.

The plots and the widget import matplotlib and ipywidgets on first use only.

Example:
    >>> import taskpilots_graph as tp
    >>> from taskpilots_graph import notebook
    >>> notebook.timeline(cp, "t-1")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from taskpilots_graph.notebook.html import VIEWS
from taskpilots_graph.notebook.timeline import (
    LedgerView,
    Timeline,
    aledger_view,
    atimeline,
    ledger_view,
    timeline,
)
from taskpilots_graph.reprs import register_html

if TYPE_CHECKING:
    from taskpilots_graph.notebook.plots import (
        batch_close_times,
        close_times,
        plot_batch,
        plot_batch_metrics,
        plot_timeline,
    )
    from taskpilots_graph.notebook.widget import TakeoverWidget, takeover_widget


# The run objects of the domain modules show as these tables (their ``_repr_html_``): the
# domain modules know the registry of taskpilots_graph.reprs, never this package.
for _type_name, _render in VIEWS.items():
    register_html(_type_name, _render)

# Optional dependencies: matplotlib for the plots, ipywidgets for the widget.
_LAZY = {
    "batch_close_times": "plots",
    "close_times": "plots",
    "plot_batch": "plots",
    "plot_batch_metrics": "plots",
    "plot_timeline": "plots",
    "TakeoverWidget": "widget",
    "takeover_widget": "widget",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'taskpilots_graph.notebook' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"taskpilots_graph.notebook.{module}"), name)


__all__ = [
    "LedgerView",
    "TakeoverWidget",
    "Timeline",
    "aledger_view",
    "atimeline",
    "batch_close_times",
    "close_times",
    "ledger_view",
    "plot_batch",
    "plot_batch_metrics",
    "plot_timeline",
    "takeover_widget",
    "timeline",
]
