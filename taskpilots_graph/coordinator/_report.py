"""How a coordination ended: per sub-agent, and as a whole (:meth:`Coordinator.run`'s
answer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from taskpilots_graph.coordinator._plan import FailureAttribution, SubAgentState

__all__ = ["CoordinationReport", "SubAgentReport"]


@dataclass(frozen=True, slots=True)
class SubAgentReport:
    """How one sub-agent ended.

    Attributes:
        name: The sub-agent.
        state: Where it stands.
        thread_id: Its thread (``None`` if it never started); every attempt continues it.
        attempts: Attempts started (a re-run is a new attempt, a resume is not).
        resumes: Resumes of a dead worker's attempt by this coordinator.
    """

    name: str
    state: SubAgentState
    thread_id: str | None
    attempts: int
    resumes: int


@dataclass(frozen=True, slots=True)
class CoordinationReport:
    """The outcome of :meth:`Coordinator.run`.

    Attributes:
        parent: The coordinator's thread.
        subagents: Per sub-agent, in plan order.
        stuck: The sub-agents reported STUCK (a dependency cycle or a mutual wait).
        attributions: The failures attributed during this run, in order.
    """

    parent: str
    subagents: Mapping[str, SubAgentReport]
    stuck: tuple[str, ...] = ()
    attributions: tuple[FailureAttribution, ...] = ()

    @property
    def done(self) -> bool:
        """Whether every sub-agent finished its work."""
        return all(r.state is SubAgentState.DONE for r in self.subagents.values())
