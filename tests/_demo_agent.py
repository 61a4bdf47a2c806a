"""The demo's ticket workflow as the multi-worker tests run it.

The demo's scripted model decides from the tool results present in the conversation. The
agent's memory window (when this library version has one) folds older turns out of the
state, which that model cannot read back, so these tests keep the whole conversation.
"""

from __future__ import annotations

import inspect
from typing import Any

import taskpilots_graph as tp


def whole_memory() -> dict[str, Any]:
    """Keyword arguments of ``create_recovery_agent`` that keep every message in the state."""
    if "memory_window" in inspect.signature(tp.create_recovery_agent).parameters:
        return {"memory_window": None}
    return {}
