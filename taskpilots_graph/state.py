"""Graph state of the recovery agent (the structured, checkpointed part)."""

from __future__ import annotations

from typing import Annotated, TypedDict

from langchain_core.messages import AnyMessage
from langgraph.graph.message import add_messages

__all__ = ["RecoveryState"]


class RecoveryState(TypedDict):
    """State of :func:`~taskpilots_graph.create_recovery_agent` graphs.

    Attributes:
        messages: The conversation, merged with LangGraph's ``add_messages`` reducer.
    """

    messages: Annotated[list[AnyMessage], add_messages]
