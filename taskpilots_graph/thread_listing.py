"""Listing the threads of a store, each described as :mod:`taskpilots_graph.threads` does.

:func:`list_threads` finds the thread ids with one grouped query where the saver allows it
(:mod:`taskpilots_graph._thread_index`), then describes each thread, reading its latest
checkpoint, events and ledger: fine for a CLI or a dashboard, not for a hot path. Threads
with ledger entries but no checkpoint (durability ``"exit"`` and a crash) are listed too;
threads that have only events are found only when named in ``thread_ids``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver

from taskpilots_graph import _thread_index
from taskpilots_graph._twins import Steps, arun_steps, io, run_steps
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.checkpointers.base import skipping_corrupt_events
from taskpilots_graph.errors import CorruptRecordError
from taskpilots_graph.events import Event
from taskpilots_graph.threads import ThreadInfo, listed_thread_info, recovery_api, root_config

__all__ = ["aevents_for_listing", "alist_threads", "events_for_listing", "list_threads"]

_EVENTS_TABLE = "taskpilots_events"
_log = logging.getLogger("taskpilots_graph.threads")  # the name it had before the split


def events_for_listing(cp: RecoveryAPI, thread_id: str) -> tuple[list[Event], tuple[str, ...]]:
    """The thread's events for a listing, and the keys of corrupt rows left out.

    One corrupt event row must not fail a listing of the whole store: it is skipped and
    reported (and logged). Where the skip cannot reach the store (sync calls on an async
    checkpointer) the thread's log is left out whole, reported the same way.
    """
    return run_steps(_events_for_listing(cp, thread_id))


async def aevents_for_listing(
    cp: RecoveryAPI, thread_id: str
) -> tuple[list[Event], tuple[str, ...]]:
    """Async form of :func:`events_for_listing`."""
    return await arun_steps(_events_for_listing(cp, thread_id))


def _events_for_listing(
    cp: RecoveryAPI, thread_id: str
) -> Steps[tuple[list[Event], tuple[str, ...]]]:
    with skipping_corrupt_events() as skipped:
        try:
            events = yield io(cp, "events", thread_id)
        except CorruptRecordError as exc:
            if exc.table != _EVENTS_TABLE:
                raise
            events, skipped = [], [exc]
    return events, _reported(thread_id, skipped)


def _reported(thread_id: str, skipped: Sequence[CorruptRecordError]) -> tuple[str, ...]:
    keys = tuple(exc.key for exc in skipped)
    if keys:
        _log.warning(
            "thread %r: skipped %d corrupt event row(s) in a listing: %s",
            thread_id,
            len(keys),
            "; ".join(str(exc) for exc in skipped),
        )
    return keys


def list_threads(
    checkpointer: BaseCheckpointSaver[Any], *, thread_ids: Sequence[str] | None = None
) -> list[ThreadInfo]:
    """Describe every thread of the store (or the ones named), sorted by thread id.

    Without ``thread_ids``: every thread with a checkpoint or a ledger entry. An event row
    that cannot be decoded is skipped, logged and reported in the thread's
    ``corrupt_events``: one bad row never fails the listing of the whole store.

    Raises:
        ThreadNotFound: If a named thread has neither a checkpoint nor an event.
    """
    return run_steps(_list_threads(checkpointer, thread_ids))


async def alist_threads(
    checkpointer: BaseCheckpointSaver[Any], *, thread_ids: Sequence[str] | None = None
) -> list[ThreadInfo]:
    """Async form of :func:`list_threads`."""
    return await arun_steps(_list_threads(checkpointer, thread_ids))


def _list_threads(
    checkpointer: BaseCheckpointSaver[Any], thread_ids: Sequence[str] | None
) -> Steps[list[ThreadInfo]]:
    cp = recovery_api(checkpointer)
    if thread_ids is not None:
        ids = list(thread_ids)
    else:
        ledger = yield io(cp, "ledger", None)
        indexed = yield io(_thread_index, "thread_ids", checkpointer)
        ids = [*indexed, *(e.thread_id for e in ledger)]
    infos = []
    for thread_id in sorted(dict.fromkeys(ids)):
        found = yield io(cp, "get_tuple", root_config(thread_id))
        events, corrupt = yield from _events_for_listing(cp, thread_id)
        ledger = yield io(cp, "ledger", thread_id)
        infos.append(listed_thread_info(thread_id, found, events, ledger, corrupt))
    return infos
