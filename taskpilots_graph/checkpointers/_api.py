"""The recovery methods both checkpointers offer, each in a sync and an async form.

:class:`RecoveryAPI` composes them by concept: the thread's records (:mod:`._records`), what
rides along with another write and the shared primitives (:mod:`._ride`), and artifacts
(:mod:`._artifact_access`). It adds what concerns the checkpointer as a whole: views of
another checkpoint density, the wait for a stored checkpoint, and whole threads.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Self, cast

from langchain_core.runnables import RunnableConfig

from taskpilots_graph._twins import Steps, asynced, both, io, synced
from taskpilots_graph.checkpointers._artifact_access import ArtifactAccess
from taskpilots_graph.checkpointers._records import RecoveryRecords
from taskpilots_graph.checkpointers._stored import STORED_WAIT, StoredCheckpoints
from taskpilots_graph.checkpointers.density import CheckpointDensity, HeldCheckpoints
from taskpilots_graph.leases import LeaseBackend

# ``retention`` and ``_optional`` (copy, prune, sweep, delete by run) are imported where they
# are used: they load aiosqlite's async saver and more, which a run never needs.
if TYPE_CHECKING:
    from taskpilots_graph.checkpointers.retention import Keep, PruneReport

__all__ = ["RecoveryAPI"]


class RecoveryAPI(RecoveryRecords, ArtifactAccess):
    """Event log, ledger, decision records and artifacts on top of a delegating saver."""

    def with_density(self, density: CheckpointDensity) -> Self:
        """A view of this checkpointer that stores checkpoints as ``density`` says.

        The view shares the saver, the recovery store and the events waiting for their
        write; only LangGraph's checkpoint writes go through the density. The agent builds
        it from ``create_recovery_agent(checkpoint_density=...)``.
        """
        if density.kind == "every_step":
            return self
        self._deferred_lock()  # made now, with the state the view shares (see ``_shared``)
        view = copy.copy(self)
        view.held = HeldCheckpoints(density)
        return view

    # -- stored checkpoints ------------------------------------------------------------------

    def _stored(self) -> StoredCheckpoints:
        return self._shared("_stored_checkpoints", StoredCheckpoints)

    def _on_disk(self, config: RunnableConfig) -> None:
        conf = config.get("configurable") or {}
        if conf.get("checkpoint_id"):
            self._stored().note(str(conf.get("thread_id")), str(conf["checkpoint_id"]))

    def _checkpoint_stored(
        self, thread_id: str, checkpoint_id: str, *, wait: float = STORED_WAIT
    ) -> Steps[bool]:
        """Whether the checkpoint is on disk, waiting up to ``wait`` seconds for its put.

        A step run under ``durability="async"`` asks before its first side effect (see
        :mod:`taskpilots_graph.checkpointers._stored`). Always ``False`` on a view that
        holds checkpoints back (a density other than every step): there is nothing to
        wait for.
        """
        if self.held is not None:
            return False
        stored = self._stored()
        found = yield both(stored.wait, stored.await_stored, thread_id, checkpoint_id, wait)
        return cast(bool, found)

    checkpoint_stored = synced(_checkpoint_stored)
    acheckpoint_stored = asynced(_checkpoint_stored)

    # -- retention ---------------------------------------------------------------------------

    def _prune(
        self,
        thread_ids: Sequence[str],
        *,
        keep: Keep = "latest",
        leases: LeaseBackend | None = None,
        strategy: str | None = None,
    ) -> Steps[PruneReport]:
        """Delete the threads' checkpoints older than the latest, keeping every recovery fact.

        With ``keep="milestones"`` the checkpoints where a business milestone was reached
        (``rewind`` targets) stay too. Events, ledger entries and artifacts are never
        pruned. A thread with a pending takeover, an uncertain ledger entry or a held lease
        (when ``leases`` is given) is refused, and the report says why.

        Called LangGraph's way, with ``strategy=``, it has LangGraph's semantics on every
        backend and none of the checks above (unknown threads are skipped): ``"keep_latest"``
        keeps the latest checkpoint of each namespace with its pending writes, and every
        event, ledger entry, decision and artifact; ``"delete"`` deletes the threads whole,
        as :meth:`delete_thread` does. See :func:`~.retention.prune_strategy`.

        Raises:
            ThreadNotFound: For an unknown thread id (nothing is pruned then).
            ConfigurationError: For an unknown ``keep`` or ``strategy``, or
                ``strategy="keep_latest"`` on a thread that uses a ``DeltaChannel``.
        """
        from taskpilots_graph.checkpointers import retention as r

        if strategy is not None:
            report = yield both(r.prune_strategy, r.aprune_strategy, self, thread_ids, strategy)
        else:
            report = yield both(r.prune, r.aprune, self, thread_ids, keep=keep, leases=leases)
        return cast("PruneReport", report)

    # Typed against LangGraph's methods (whose body takes any saver; its prune returns None).
    prune = synced(_prune)  # type: ignore[arg-type]
    aprune = asynced(_prune)  # type: ignore[arg-type]

    def _copy_thread(self, source_thread_id: str, target_thread_id: str) -> Steps[None]:
        """Copy a thread (every checkpoint, pending write and namespace) to a new thread id,
        with its events, model decisions, artifacts and ledger.

        The copy never performs again an effect the source committed: the source's ledger
        entries come along under the keys the copy asks for, committed ones as committed,
        and those whose outcome only the service knows as ``uncertain`` (a person decides).
        Entries under a business key are shared already and stay the source's. See
        :mod:`taskpilots_graph.checkpointers._optional` for the whole rule.

        Raises:
            ThreadNotFound: The source has no checkpoint.
            ConfigurationError: The target already has checkpoints or recovery records, or
                is the source, or a thread id no backend stores.
        """
        from taskpilots_graph.checkpointers import _optional as o

        yield both(o.copy_thread, o.acopy_thread, self, source_thread_id, target_thread_id)

    copy_thread = synced(_copy_thread)  # type: ignore[arg-type]
    acopy_thread = asynced(_copy_thread)  # type: ignore[arg-type]

    def _delete_for_runs(self, run_ids: Sequence[str]) -> Steps[None]:
        """Delete the checkpoints (and their pending writes) the given runs wrote, in every
        thread, in one transaction.

        What the runs did stays on record (events, ledger entries, decisions, artifacts):
        a later run of the thread finds their committed effects instead of performing them
        again. Unknown run ids are ignored.

        Raises:
            ConfigurationError: ``run_ids`` is a single string.
        """
        from taskpilots_graph.checkpointers import _optional as o

        yield both(o.delete_for_runs, o.adelete_for_runs, self, run_ids)

    delete_for_runs = synced(_delete_for_runs)  # type: ignore[arg-type]
    adelete_for_runs = asynced(_delete_for_runs)  # type: ignore[arg-type]

    def _sweep(
        self, *, older_than: float | timedelta, leases: LeaseBackend | None = None
    ) -> Steps[PruneReport]:
        """Delete whole threads idle for longer than ``older_than`` (seconds or a
        ``timedelta``), never one with a pending takeover, an uncertain ledger entry or a
        held lease. See :func:`taskpilots_graph.checkpointers.retention.sweep`."""
        from taskpilots_graph.checkpointers import retention as r

        report = yield both(r.sweep, r.asweep, self, older_than=older_than, leases=leases)
        return cast("PruneReport", report)

    sweep = synced(_sweep)
    asweep = asynced(_sweep)

    # -- whole threads -----------------------------------------------------------------------

    def _delete_thread(self, thread_id: str, *, forget_effects: bool = False) -> Steps[None]:
        """Delete the thread's checkpoints, writes, events, ledger entries, decisions and
        artifacts.

        Ledger entries under a business key (``side_effect(key=...)``) and their undos stay:
        they record the world, not the conversation, and keep another thread from
        performing the same effect again. ``forget_effects=True`` deletes them too.
        """
        # Checkpoints go first: a crash in between leaves an orphan log, never a thread that
        # could resume without the record of what it already did.
        yield io(self.inner, "delete_thread", thread_id)
        # Its stored messages too.
        yield io(self, "_call", "delete_thread", thread_id, forget_effects=forget_effects)
        self.message_log.forget(thread_id)  # a new run of the id starts new sequences
        if self.artifact_store is not None:
            yield io(self, "_artifacts_call", "delete_artifacts", thread_id)

    delete_thread = synced(_delete_thread)  # type: ignore[arg-type]
    adelete_thread = asynced(_delete_thread)  # type: ignore[arg-type]
