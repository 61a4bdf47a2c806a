"""Recovering a failed sub-agent: how it failed, what runs again, which shared effects are
undone first, and what a re-run is told.

The decision itself is pure (:func:`~._plan.plan_recovery`); :class:`Recovery` reads the
sub-agents' ledgers and logs for it, records it in the parent's log before acting on it
(``retry_scheduled``), then undoes each planned effect as a side effect of the parent thread
(``compensated``), so a coordinator started again finishes a recovery it was killed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from taskpilots_graph.coordinator._log import ParentLog
from taskpilots_graph.coordinator._plan import Effect, FailureAttribution, plan_recovery
from taskpilots_graph.coordinator._rerun import notice_id, rerun_input, rerun_notice
from taskpilots_graph.engine._locks import lock_target
from taskpilots_graph.events import EventKind
from taskpilots_graph.ledger import LedgerStatus, SideEffectSpec
from taskpilots_graph.nodes.compensate import compensate_effect
from taskpilots_graph.tool_tables import find_executor
from taskpilots_graph.tools import spec_of

if TYPE_CHECKING:
    from taskpilots_graph.coordinator._run import Coordinator

__all__ = ["MESSAGE_CHARS", "Recovery"]

MESSAGE_CHARS: Final = 500
"""The longest error message an attribution keeps."""


@dataclass
class Recovery:
    """The recoveries of one coordination loop (see the module).

    Attributes:
        c: The coordinator.
        parent: Its thread.
        inputs: Each sub-agent's own input.
        log: What the parent's log says, kept up to date by the loop.
        event: Writes one event to the parent's log.
    """

    c: Coordinator
    parent: str
    inputs: Mapping[str, Any]
    log: ParentLog
    event: Callable[..., None]

    def attribution(self, name: str, thread: str) -> FailureAttribution:
        """How a sub-agent whose thread failed failed: its last ``tool_failed`` event."""
        events = self.c.checkpointer.events(thread)
        failure = next((e for e in reversed(events) if e.kind is EventKind.TOOL_FAILED), None)
        if failure is None:
            return FailureAttribution(self.parent, name, thread, "failed")
        p = failure.payload
        detail = p.get("failure") or {}
        kind = str(detail.get("kind") or "failed")
        where = {"step": p.get("tool_call_id"), "tool": p.get("tool"), "key": p.get("key")}
        message = str(detail.get("message") or "")[:MESSAGE_CHARS] or None
        return FailureAttribution(self.parent, name, thread, kind, message=message, **where)

    def decide(self, why: FailureAttribution, attempt: int) -> bool:
        """Decide what runs again after attempt ``attempt`` of ``why.subagent`` failed,
        record it, then undo what it plans. False: the sub-agent used up its attempts
        (nothing recorded here)."""
        name, thread = why.subagent, why.thread_id
        started = [n for n in self.c.plan.tasks if self.log.threads.get(n)]
        effects, undoable = self.committed(name)
        sharers = {}
        for other in started:
            if other != name:
                sharers[other], more = self.committed(other)
                undoable |= more
        decision = plan_recovery(
            self.c.plan,
            name,
            effects,
            started=started,
            attempts=attempt,
            max_attempts=self.c.max_attempts,
            sharers=sharers,
            undoable=undoable,
        )
        if decision.give_up:
            return False
        undo = [e.payload() for e in decision.shared]
        payload = {
            "subagent": name,
            "attempt": attempt,
            "rerun": list(decision.rerun),
            "compensate": undo,
            "kept": [e.payload() for e in decision.kept],
            "attribution": why.payload(),
        }
        # The decision first, then the undo: a coordinator killed in between finishes the
        # undo from this event when it starts again (``undo_pending``).
        self.event(EventKind.RETRY_SCHEDULED, **payload)
        self.log.fresh |= set(decision.rerun)
        self.log.handled.add((thread, attempt))
        self.log.recovery.update(dict.fromkeys(decision.rerun, payload))
        for planned in undo:
            self.log.planned_undo[planned["key"]] = planned
        self.undo_pending()
        return True

    def _spec(self, name: str, tool: str) -> SideEffectSpec | None:
        """The declaration of sub-agent ``name``'s tool ``tool``, if its executor has it."""
        executor = find_executor(self.c.subagents[name])
        found = executor.tools.get(tool) if executor is not None else None
        return spec_of(found) if found is not None else None

    def committed(self, name: str) -> tuple[list[Effect], set[str]]:
        """A sub-agent's committed effects, oldest first, with the business object of each
        (from its ``lock=`` name), and the keys of those its tools can undo."""
        effects, undoable = [], set()
        for thread in dict.fromkeys(self.log.threads.get(name, ())):
            for entry in self.c.checkpointer.ledger(thread):
                if entry.status is not LedgerStatus.COMMITTED:
                    continue
                obj = lock_target(entry.lock, entry.tool)[0] if entry.lock else None
                effects.append((entry.key, entry.tool, obj))
                spec = self._spec(name, entry.tool)
                if spec is not None and spec.compensate is not None:
                    undoable.add(entry.key)
        return effects, undoable

    def undo_pending(self) -> None:
        """Undo every planned effect whose compensation is not recorded yet, in order."""
        for planned in self.log.pending_undo():
            self.compensate(planned)

    def compensate(self, planned: Mapping[str, Any]) -> None:
        """Undo one planned effect through the ledger's compensation (the undo is a side
        effect of the parent thread: intent, compensator, commit), then record it."""
        key, owner = str(planned["key"]), str(planned["subagent"])
        recovery = self.log.recovery.get(owner, {})
        entry = self.c.checkpointer.ledger_entry(key)
        spec = self._spec(owner, entry.tool) if entry is not None else None
        status = "missing" if entry is None else entry.status.value
        if entry is not None and entry.status is LedgerStatus.COMPENSATED:
            status = "already"  # undone before a crash kept this event from being written
        if entry is not None and spec is not None and entry.status is LedgerStatus.COMMITTED:
            # Uncertain (killed inside the compensator, no ``compensate_precheck`` to ask):
            # CompensationUncertain stops the coordination here, before anything re-runs on
            # the object; a person answers with ``decide_compensation``, then ``run`` again.
            outcome = compensate_effect(
                self.c.checkpointer,
                entry,
                spec,
                thread_id=self.parent,
                by="coordinator",
                leases=self.c.leases,
                lease_ttl=self.c.lease_ttl,
                goal=f"coordination {self.parent}: undo before re-running {recovery.get('rerun')}",
                committed=[{"key": e[0], "tool": e[1]} for e in self.committed(owner)[0]],
            )
            status = outcome.status
        self.event(
            EventKind.COMPENSATED,
            subagent=owner,
            key=key,
            tool=planned.get("tool"),
            object=planned.get("object"),
            readers=list(planned.get("readers") or ()),
            status=status,
            attribution=recovery.get("attribution") or {},
        )
        self.log.undone.add(key)

    def attempt_input(self, name: str, thread: str, attempt: int) -> Any:
        """The graph input of an attempt: the sub-agent's own for the first, the re-run
        notice (what stands, what was undone, why) for the next ones."""
        original = self.inputs[name]
        recovery = self.log.recovery.get(name)
        if attempt <= 1 or recovery is None:
            return original
        planned = [u for u in recovery.get("compensate") or () if u.get("subagent") == name]
        undone_keys = {str(u["key"]) for u in planned}
        ledger = self.c.checkpointer.ledger
        entries = [e for t in dict.fromkeys(self.log.threads[name]) for e in ledger(t)]
        notice = rerun_notice(
            name,
            attempt=attempt,
            max_attempts=self.c.max_attempts,
            why=recovery.get("attribution") or {},
            kept=[e for e in entries if e.status is LedgerStatus.COMMITTED],
            # A planned undo a person chose to skip left its effect committed: kept.
            undone=[
                e for e in entries if e.key in undone_keys and e.status is LedgerStatus.COMPENSATED
            ],
            objects=sorted({str(u["object"]) for u in recovery.get("compensate") or ()}),
        )
        return rerun_input(original, notice, notice_id(thread, attempt))
