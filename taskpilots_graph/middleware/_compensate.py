"""Undo a thread's committed side effects, newest first (abandon, ``on_exhausted="compensate"``).

The recovery agent's rules, from the same code (:func:`~taskpilots_graph.nodes.compensate.
compensate_thread`): each committed effect whose tool declares ``compensate=`` is undone
through the ledger under its own key ``undo:<key>`` (intent, compensator, commit), then its
entry becomes ``compensated``. A compensator killed mid-way is reconciled with the tool's
``compensate_precheck`` when the tool task runs again; without one (or when it cannot tell)
the run pauses on a takeover naming the undo, answered with ``tp.decide``: the compensator
is never run twice blindly. Runs inside the tool node, so ``interrupt()`` is available.
"""

from __future__ import annotations

from collections.abc import Mapping

from langchain_core.tools import BaseTool

from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.locks.base import LeaseBackend
from taskpilots_graph.nodes.compensate import acompensate_thread, compensate_thread

__all__ = ["acompensate", "compensate"]


def compensate(
    cp: RecoveryAPI,
    thread_id: str,
    checkpoint_ns: str,
    tools: Mapping[str, BaseTool],
    *,
    leases: LeaseBackend | None = None,
    lease_ttl: float = 30.0,
) -> None:
    """Undo the thread's committed effects that have a compensator, newest first.

    ``leases`` / ``lease_ttl``: the middleware's lease backend and TTL, for the business
    lock of an undo of a ``lock=`` tool (default: the checkpointer's own database).
    """
    compensate_thread(
        cp,
        thread_id,
        tools,
        checkpoint_ns=checkpoint_ns,
        ask=True,
        leases=leases,
        lease_ttl=lease_ttl,
    )


async def acompensate(
    cp: RecoveryAPI,
    thread_id: str,
    checkpoint_ns: str,
    tools: Mapping[str, BaseTool],
    *,
    leases: LeaseBackend | None = None,
    lease_ttl: float = 30.0,
) -> None:
    """Async form of :func:`compensate` (a compensator may be a coroutine function)."""
    await acompensate_thread(
        cp,
        thread_id,
        tools,
        checkpoint_ns=checkpoint_ns,
        ask=True,
        leases=leases,
        lease_ttl=lease_ttl,
    )
