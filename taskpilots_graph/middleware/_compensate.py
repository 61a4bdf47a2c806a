"""Undo a thread's committed side effects, newest first (abandon, ``on_exhausted="compensate"``).

The same rules as the recovery agent's compensate node: each committed effect whose tool
declares ``compensate=`` is undone, then its entry becomes ``compensated`` in the same
durable write as its ``compensated`` event; an entry already ``compensated`` is never undone
twice (compensators should still be idempotent by key: a crash in between runs one again).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from langchain_core.tools import BaseTool

from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.checkpointers.base import EventRecord, prepare_event
from taskpilots_graph.events import EventKind
from taskpilots_graph.ledger import Compensate, LedgerEntry, LedgerStatus
from taskpilots_graph.tools import spec_of

__all__ = ["acompensate", "compensate"]


def _to_undo(
    entries: list[LedgerEntry], tools: Mapping[str, BaseTool]
) -> list[tuple[LedgerEntry, Compensate]]:
    undo = []
    for entry in reversed(entries):
        tool = tools.get(entry.tool)
        spec = spec_of(tool) if tool is not None else None
        if entry.status is LedgerStatus.COMMITTED and spec is not None and spec.compensate:
            undo.append((entry, spec.compensate))
    return undo


def _undone(entry: LedgerEntry, ns: str) -> tuple[LedgerEntry, EventRecord]:
    after = replace(entry, status=LedgerStatus.COMPENSATED, updated_at=datetime.now(UTC))
    event = prepare_event(
        entry.thread_id,
        EventKind.COMPENSATED,
        {"tool": entry.tool, "key": entry.key},
        checkpoint_id=None,
        checkpoint_ns=ns,
    )
    return after, event


def compensate(
    cp: RecoveryAPI, thread_id: str, checkpoint_ns: str, tools: Mapping[str, BaseTool]
) -> None:
    """Undo the thread's committed effects that have a compensator, newest first."""
    for entry, undo in _to_undo(cp.ledger(thread_id), tools):
        undo(entry.key, dict(entry.args), entry.result)
        after, event = _undone(entry, checkpoint_ns)
        cp.write_ledger(after, expect=(entry.status, entry.attempt), events=[event])


async def acompensate(
    cp: RecoveryAPI, thread_id: str, checkpoint_ns: str, tools: Mapping[str, BaseTool]
) -> None:
    """Async form of :func:`compensate` (a compensator may be a coroutine function)."""
    for entry, undo in _to_undo(await cp.aledger(thread_id), tools):
        done: Any = undo(entry.key, dict(entry.args), entry.result)
        if inspect.isawaitable(done):
            await done
        after, event = _undone(entry, checkpoint_ns)
        await cp.awrite_ledger(after, expect=(entry.status, entry.attempt), events=[event])
