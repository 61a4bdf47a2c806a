"""The coordinator's memory: what its *parent* thread's event log says.

Every decision is written there before it is acted on, so a coordinator started again in a
fresh process rebuilds where it stood from the log alone (:meth:`ParentLog.read`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from taskpilots_graph.events import Event, EventKind

__all__ = ["ParentLog"]


@dataclass
class ParentLog:
    """What the parent's event log says (driver state, rebuilt from the log on start)."""

    planned: bool = False
    threads: dict[str, list[str]] = field(default_factory=dict)  # one per attempt
    # The sub-agent thread's position when a re-run was recorded: the re-run reached the
    # thread once the thread moved past it (see ``Drive.reached``).
    after: dict[str, Mapping[str, Any] | None] = field(default_factory=dict)
    resumes: dict[str, int] = field(default_factory=dict)
    fresh: set[str] = field(default_factory=set)  # a new attempt is due
    given_up: set[str] = field(default_factory=set)
    stuck: set[str] = field(default_factory=set)
    handled: set[tuple[str, int]] = field(default_factory=set)  # failed (thread, attempt)
    recovery: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # why each re-runs
    planned_undo: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # key -> plan
    undone: set[str] = field(default_factory=set)  # keys whose compensation is recorded

    @classmethod
    def read(cls, events: list[Event]) -> ParentLog:
        """Rebuild the state from the parent's events (others, such as the undos' own
        records, carry no ``subagent`` and are passed over)."""
        log = cls()
        for event in events:
            p = event.payload
            name = p.get("subagent")
            if event.kind is EventKind.PLAN_CREATED and "coordination" in p:
                log.planned = True
            elif event.kind is EventKind.STUCK_DETECTED and "subagents" in p:
                log.stuck |= set(p["subagents"])
            elif not isinstance(name, str):
                continue
            elif event.kind is EventKind.AGENT_STARTED:
                log.threads.setdefault(name, []).append(str(p["thread_id"]))
                log.after[name] = p.get("after")
                log.fresh.discard(name)
            elif event.kind is EventKind.RUN_RESUMED:
                log.resumes[name] = log.resumes.get(name, 0) + 1
            elif event.kind is EventKind.RETRY_SCHEDULED:
                # One event per recovery, naming every sub-agent to run again and every
                # effect to undo, written before anything is undone: a crash can never leave
                # half of a decision recorded, and a restart finishes what it lists.
                rerun = list(p.get("rerun") or [name])
                log.fresh |= set(rerun)
                thread = str((p.get("attribution") or {}).get("thread_id") or "")
                attempt = p.get("attempt") or len(log.threads.get(name, ()))
                log.handled.add((thread, int(attempt)))
                log.recovery.update(dict.fromkeys(rerun, p))
                for planned in p.get("compensate") or ():
                    log.planned_undo[str(planned["key"])] = planned
            elif event.kind is EventKind.COMPENSATED and "key" in p:
                log.undone.add(str(p["key"]))
            elif event.kind is EventKind.AGENT_FINISHED and p.get("given_up"):
                log.given_up.add(name)
        return log

    def current(self, name: str) -> str | None:
        """The thread of the sub-agent's latest attempt (``None``: never started)."""
        threads = self.threads.get(name)
        return threads[-1] if threads else None

    def attempts(self, name: str) -> int:
        """Attempts of the sub-agent recorded so far."""
        return len(self.threads.get(name, ()))

    def pending_undo(self) -> list[Mapping[str, Any]]:
        """Planned compensations not recorded yet, in the order they were planned."""
        return [u for k, u in self.planned_undo.items() if k not in self.undone]
