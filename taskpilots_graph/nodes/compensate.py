"""The compensate node: undo the run's committed side effects, newest first.

Each committed effect of the thread whose tool declares ``compensate=`` is undone by calling
``compensate(key, args, result)``; the entry then becomes ``compensated`` in the same durable
write as its ``compensated`` event. A crash in between runs that compensator again on
resume (compensators should be idempotent by key); an entry already ``compensated`` is never
undone twice. Effects without a compensator are listed in the event, for a person.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from langchain_core.runnables import RunnableConfig

from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.checkpointers.base import prepare_event
from taskpilots_graph.events import EventKind
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus
from taskpilots_graph.nodes._context import run_context
from taskpilots_graph.nodes.executor import RecoveryExecutor
from taskpilots_graph.tools import spec_of

__all__ = ["ABANDONED", "CompensateNode"]

ABANDONED = "abandoned by a person"
"""The flow reason of a run a person abandoned: compensated, then closed (not failed)."""


class CompensateNode:
    """Runs registered compensators for the thread's committed effects in reverse order."""

    def __init__(self, executor: RecoveryExecutor, *, checkpointer: RecoveryAPI) -> None:
        self.executor = executor
        self.checkpointer = checkpointer

    def _compensator(self, entry: LedgerEntry) -> Any:
        tool = self.executor.tools.get(entry.tool)
        spec = spec_of(tool) if tool is not None else None
        return spec.compensate if spec is not None else None

    def _done(self, entry: LedgerEntry, ns: str) -> tuple[LedgerEntry, Any]:
        undone = replace(entry, status=LedgerStatus.COMPENSATED, updated_at=datetime.now(UTC))
        event = prepare_event(
            entry.thread_id,
            EventKind.COMPENSATED,
            {"tool": entry.tool, "key": entry.key},
            checkpoint_id=None,
            checkpoint_ns=ns,
        )
        return undone, event

    @staticmethod
    def _summary(state: dict[str, Any], missing: list[str]) -> dict[str, Any]:
        reason = (state.get("flow") or {}).get("reason") or "failed"
        stage = "closed" if reason == ABANDONED else "failed"
        note = f"; not undone (no compensator): {', '.join(missing)}" if missing else ""
        return {"flow": {"stage": stage, "reason": reason + note}}

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Compensate synchronously."""
        ctx = run_context(config)
        missing = []
        for entry in reversed(self.checkpointer.ledger(ctx.thread_id)):
            if entry.status is not LedgerStatus.COMMITTED:
                continue
            compensate = self._compensator(entry)
            if compensate is None:
                missing.append(entry.key)
                continue
            compensate(entry.key, dict(entry.args), entry.result)
            undone, event = self._done(entry, ctx.graph_ns)
            self.checkpointer.write_ledger(
                undone, expect=(LedgerStatus.COMMITTED, entry.attempt), events=[event]
            )
        if missing:
            self.checkpointer.append_event(
                ctx.thread_id, EventKind.COMPENSATED, {"without_compensator": missing}
            )
        return self._summary(state, missing)

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Compensate asynchronously."""
        ctx = run_context(config)
        missing = []
        for entry in reversed(await self.checkpointer.aledger(ctx.thread_id)):
            if entry.status is not LedgerStatus.COMMITTED:
                continue
            compensate = self._compensator(entry)
            if compensate is None:
                missing.append(entry.key)
                continue
            answer = compensate(entry.key, dict(entry.args), entry.result)
            if inspect.isawaitable(answer):
                await answer
            undone, event = self._done(entry, ctx.graph_ns)
            await self.checkpointer.awrite_ledger(
                undone, expect=(LedgerStatus.COMMITTED, entry.attempt), events=[event]
            )
        if missing:
            await self.checkpointer.aappend_event(
                ctx.thread_id, EventKind.COMPENSATED, {"without_compensator": missing}
            )
        return self._summary(state, missing)
