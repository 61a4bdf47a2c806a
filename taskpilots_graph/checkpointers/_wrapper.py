"""Delegation of every ``BaseCheckpointSaver`` method to the wrapped LangGraph saver.

Both recovery checkpointers inherit from this class, so the sync and async faces forward the
saver protocol through one piece of code. Anything that touches the recovery store (setup,
``delete_thread``, events) is defined by the two subclasses.

One thing changes on the way: message lists are stored once per thread in the recovery
store (:mod:`.messages`) and the checkpoint handed to the saver refers to them. ``put``
writes the message rows in the checkpoint's transaction when the saver takes them (see
:class:`~._ride_rows.Ride`), otherwise first, then the checkpoint; every read rebuilds the
exact lists (:mod:`._message_coding`).
"""

from __future__ import annotations

import copy
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from taskpilots_graph._twins import Steps, arun_steps, asynced, io, run_steps, synced
from taskpilots_graph.checkpointers._message_coding import MessageCoding
from taskpilots_graph.checkpointers._message_log import MessageLog
from taskpilots_graph.checkpointers._sqlite_connect import mapped_errors
from taskpilots_graph.checkpointers.density import HeldCheckpoints
from taskpilots_graph.events import check_thread_id

__all__ = ["DelegatingSaver"]

P = ParamSpec("P")
T = TypeVar("T")


def _checked(config: RunnableConfig | None) -> None:
    """Refuse a thread id no backend can store before the saver writes (or reads) it."""
    configurable = (config or {}).get("configurable") or {}
    if "thread_id" in configurable:
        value = configurable["thread_id"]
        check_thread_id(value if isinstance(value, str) else str(value))


def _both(
    steps: Callable[Concatenate[Any, P], Steps[T]],
) -> tuple[Callable[Concatenate[Any, P], T], Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]]:
    """``synced(steps), asynced(steps)``: the sync and async override of a saver method.

    Typed with ``Any`` for ``self``: assigned over the methods LangGraph declares, the twins
    would otherwise be checked against a body taking any ``BaseCheckpointSaver``.
    """
    return synced(steps), asynced(steps)


class DelegatingSaver(MessageCoding):
    """A ``BaseCheckpointSaver`` that forwards every call to ``self.inner``.

    LangGraph's optional operations (``copy_thread``, ``delete_for_runs``, ``prune`` and
    their async forms) are not forwarded here: most LangGraph savers lack them, and LangGraph
    finds them by override, so a forwarding override would claim what the saver cannot do.
    :class:`~taskpilots_graph.checkpointers._api.RecoveryAPI` implements them on every
    backend, recovery records included (:mod:`._optional`, :mod:`.retention`).
    """

    held: HeldCheckpoints | None = None
    """Checkpoints not stored under the graph's density (``None``: every one is stored)."""

    def __init__(self, inner: BaseCheckpointSaver[Any]) -> None:
        # BaseCheckpointSaver.__init__ is deliberately not called: it would set a serde of
        # our own, while the graph must encode exactly as the inner saver does.
        self.inner = inner
        # Shared (not copied) by the views made with copy.copy (density, allowlist).
        self.message_log = MessageLog()

    # The two primitives reaching the recovery store (defined by the checkpointers).

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def _acall(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _store(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> Steps[RunnableConfig]:
        """The saver's ``put``, with the messages the checkpoint refers to stored in its
        transaction, or before it."""
        encoded, rows = self._encoded(config, checkpoint)
        if rows is None:
            stored = yield io(self.inner, "put", config, encoded, metadata, new_versions)
        else:
            try:
                with self._riding() as ride:
                    yield io(self, "_call", "messages_write", rows)
                    stored = yield io(self.inner, "put", config, encoded, metadata, new_versions)
                if ride is not None and ride.stranded:
                    # The store handed the rows over but the saver's put did not take them (a
                    # put reached through another thread or loop): store them now.
                    yield io(self, "_call", "messages_write", rows)
            except BaseException:
                self._failed_write(rows)
                raise
        self._on_disk(stored)
        return cast(RunnableConfig, stored)

    # -- attributes LangGraph reads -------------------------------------------------------

    @property
    def serde(self) -> SerializerProtocol:
        """The inner saver's serializer (shared, never copied)."""
        return self.inner.serde

    @serde.setter
    def serde(self, value: SerializerProtocol) -> None:
        self.inner.serde = value

    @property
    def config_specs(self) -> list[Any]:
        return self.inner.config_specs

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.inner.get_next_version(current, channel)

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> DelegatingSaver:
        inner = self.inner.with_allowlist(extra_allowlist)
        if inner is self.inner:
            return self
        clone = copy.copy(self)
        clone.inner = inner
        return clone

    # -- the protocol ------------------------------------------------------------------------

    def _get(self, config: RunnableConfig) -> Steps[Checkpoint | None]:
        tup = yield from self._get_tuple(config)  # not the inner get: its lists are rebuilt
        return None if tup is None else tup.checkpoint

    get, aget = _both(_get)

    def _held_calls(self, calls: list[Any]) -> Steps[None]:
        """Perform storage calls from :class:`HeldCheckpoints`: ``put`` is our own (it
        stores the messages a checkpoint refers to), ``put_writes`` the saver's."""
        for kind, args in calls:
            if kind == "put":
                yield from self._store(*args)
            else:
                yield io(self.inner, "put_writes", *args)

    def _before_read(self, config: RunnableConfig) -> Steps[None]:
        """What a subclass does before a checkpoint of ``config``'s thread is read."""
        yield from ()

    def _before_put(self, config: RunnableConfig) -> Steps[None]:
        """What a subclass does before a checkpoint of ``config``'s thread is written."""
        yield from ()

    def _on_disk(self, config: RunnableConfig) -> None:
        """What a subclass does once the checkpoint ``config`` names is known to be stored
        (written, or read back)."""

    def _release(self, config: RunnableConfig | None) -> Steps[None]:
        """Store what is held for ``config``'s thread, so that a read finds it."""
        if self.held is not None:
            yield from self._held_calls(self.held.release(config))

    def _get_tuple(self, config: RunnableConfig) -> Steps[CheckpointTuple | None]:
        _checked(config)
        yield from self._before_read(config)
        with mapped_errors("get_tuple"):
            yield from self._release(config)
            tup = yield io(self.inner, "get_tuple", config)
            if tup is not None:
                self._on_disk(tup.config)
            return (yield from self._decoded(tup, True, None))

    get_tuple, aget_tuple = _both(_get_tuple)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        run_steps(self._release(config))
        return self._decoding(self.inner.list(config, filter=filter, before=before, limit=limit))

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        await arun_steps(self._release(config))
        tuples = self.inner.alist(config, filter=filter, before=before, limit=limit)
        async for item in self._adecoding(tuples):
            yield item

    def _put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> Steps[RunnableConfig]:
        _checked(config)
        yield from self._before_put(config)
        with mapped_errors("put"):
            if self.held is None:
                return (yield from self._store(config, checkpoint, metadata, new_versions))
            args, next_config = self.held.put(config, checkpoint, metadata, new_versions)
            return next_config if args is None else (yield from self._store(*args))

    put, aput = _both(_put)

    def _put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> Steps[None]:
        _checked(config)
        with mapped_errors("put_writes"):
            if self.held is None:
                yield io(self.inner, "put_writes", config, writes, task_id, task_path)
            else:
                held = self.held.put_writes(config, writes, task_id, task_path)
                yield from self._held_calls(held)

    put_writes, aput_writes = _both(_put_writes)

    def _get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Steps[Mapping[str, DeltaChannelHistory]]:
        history = yield io(
            self.inner, "get_delta_channel_history", config=config, channels=channels
        )
        return (yield from self._seeded(config, history))

    get_delta_channel_history, aget_delta_channel_history = _both(_get_delta_channel_history)
