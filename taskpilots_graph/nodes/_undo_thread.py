"""A thread's compensation as a whole (I/O free): which of its effects to undo, newest first,
and the report of what the undos did.

Each undo itself follows :mod:`taskpilots_graph.nodes._undo`;
:func:`~taskpilots_graph.nodes.compensate.compensate_thread` carries them out in this order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.tools import BaseTool

from taskpilots_graph.ledger import LedgerEntry, LedgerStatus, SideEffectSpec
from taskpilots_graph.nodes._undo import UndoOutcome, is_undo
from taskpilots_graph.tools import spec_of

__all__ = ["CompensationReport", "plan_thread", "report_of"]


@dataclass(frozen=True, slots=True)
class CompensationReport:
    """What undoing a thread's committed effects did, by effect key (newest first).

    Attributes:
        undone: Effects undone now.
        already: Effects found compensated by an earlier run (not undone again).
        left: Effects a person chose to leave in place (``skip`` on an uncertain undo).
        missing: Committed effects whose tool declares no compensator.
    """

    undone: tuple[str, ...] = ()
    already: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()


def plan_thread(
    entries: Sequence[LedgerEntry], tools: Mapping[str, BaseTool]
) -> tuple[list[tuple[LedgerEntry, SideEffectSpec]], list[str], list[dict[str, Any]]]:
    """A thread's compensation, from its ledger entries (oldest first): the effects to undo
    newest first with their specs, the keys without a compensator, and the committed
    effects as a person sees them."""
    todo: list[tuple[LedgerEntry, SideEffectSpec]] = []
    missing: list[str] = []
    committed = [
        {"key": e.key, "tool": e.tool}
        for e in entries
        if e.status is LedgerStatus.COMMITTED and not is_undo(e)
    ]
    for entry in reversed(entries):
        if entry.status not in (LedgerStatus.COMMITTED, LedgerStatus.COMPENSATED) or is_undo(entry):
            continue
        tool = tools.get(entry.tool)
        spec = spec_of(tool) if tool is not None else None
        if spec is not None and spec.compensate is not None:
            # Compensated ones too: a re-run of the task replays the answers their undos
            # got, so that later questions meet their own answers (see _undo).
            todo.append((entry, spec))
        elif entry.status is LedgerStatus.COMMITTED:
            missing.append(entry.key)
    return todo, missing, committed


def report_of(outcomes: Sequence[UndoOutcome], missing: Sequence[str]) -> CompensationReport:
    """The report of a thread's compensation from the outcome of each undo."""

    def keys(status: str) -> tuple[str, ...]:
        return tuple(o.effect_key for o in outcomes if o.status == status)

    return CompensationReport(keys("undone"), keys("already"), keys("left"), tuple(missing))
