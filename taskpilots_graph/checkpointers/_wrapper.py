"""Delegation of every ``BaseCheckpointSaver`` method to the wrapped LangGraph saver.

Both recovery checkpointers inherit from this class, so the sync and async faces forward the
saver protocol through one piece of code. Anything that touches the recovery store (setup,
``delete_thread``, events) is defined by the two subclasses.

One thing changes on the way: message lists are stored once per thread in the recovery
store (:mod:`.messages`) and the checkpoint handed to the saver refers to them. ``put``
writes the message rows in the checkpoint's transaction when the saver takes them (see
:class:`~.messages.Ride`), otherwise first, then the checkpoint; every read (``get_tuple``,
``list``, ``get``, their async forms, the seeds of ``get_delta_channel_history``) rebuilds
the exact lists, so callers see what the bare saver would have returned.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

from langchain_core.messages import BaseMessage
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

from taskpilots_graph._twins import Steps, arun_steps, io, run_steps
from taskpilots_graph.checkpointers._sqlite_connect import mapped_errors
from taskpilots_graph.checkpointers.density import HeldCheckpoints
from taskpilots_graph.checkpointers.messages import (
    LoadedRow,
    MessageLog,
    MessageRef,
    MessageRows,
    Ride,
    as_value,
    message_refs,
    read_marker,
    rebuild,
    riding,
    with_values,
)
from taskpilots_graph.errors import CorruptRecordError
from taskpilots_graph.events import check_thread_id

__all__ = ["DelegatingSaver"]


def _checked(config: RunnableConfig | None) -> None:
    """Refuse a thread id no backend can store before the saver writes (or reads) it."""
    configurable = (config or {}).get("configurable") or {}
    if "thread_id" in configurable:
        value = configurable["thread_id"]
        check_thread_id(value if isinstance(value, str) else str(value))


def _where(config: RunnableConfig) -> tuple[str, str]:
    conf = config.get("configurable") or {}
    return str(conf.get("thread_id", "")), str(conf.get("checkpoint_ns", ""))


class _Listing:
    """What one listing has read: rows by sequence (longest read) and messages by key.

    Checkpoints of one history mostly refer to prefixes of one sequence: the longest is
    read once (a listing goes newest first) and each stored message is decoded once.
    """

    def __init__(self) -> None:
        self.rows: dict[int, list[LoadedRow]] = {}
        self.messages: dict[bytes, BaseMessage] = {}

    def known(self, ref: MessageRef) -> list[LoadedRow] | None:
        rows = self.rows.get(ref.seq)
        return None if rows is None or len(rows) < ref.length else rows[: ref.length]

    def add(self, ref: MessageRef, rows: list[LoadedRow]) -> None:
        if len(rows) > len(self.rows.get(ref.seq, ())):
            self.rows[ref.seq] = rows


class DelegatingSaver(BaseCheckpointSaver[Any]):
    """A ``BaseCheckpointSaver`` that forwards every call to ``self.inner``.

    LangGraph's optional operations (``copy_thread``, ``delete_for_runs``, ``prune`` and
    their async forms) are not forwarded here: most LangGraph savers lack them, and LangGraph
    finds them by override, so a forwarding override would claim what the saver cannot do.
    :class:`~taskpilots_graph.checkpointers._api.RecoveryAPI` implements them on every
    backend, recovery records included (:mod:`._optional`, :mod:`.retention`).
    """

    inner: BaseCheckpointSaver[Any]
    held: HeldCheckpoints | None = None
    """Checkpoints not stored under the graph's density (``None``: every one is stored)."""

    store_messages: bool = True
    """Store message lists once per thread and refer to them from checkpoints (see
    :mod:`.messages`); ``False`` leaves them inside the checkpoints, as LangGraph does.
    Checkpoints referring to stored messages are read either way."""

    message_log: MessageLog

    def __init__(self, inner: BaseCheckpointSaver[Any]) -> None:
        # BaseCheckpointSaver.__init__ is deliberately not called: it would set a serde of
        # our own, while the graph must encode exactly as the inner saver does.
        self.inner = inner
        # Shared (not copied) by the views made with copy.copy (density, allowlist).
        self.message_log = MessageLog()

    # -- messages stored once ----------------------------------------------------------------
    # The two primitives reaching the recovery store (defined by the checkpointers).

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def _acall(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _message_store(self) -> bool:
        store = getattr(self, "store", None)
        return callable(getattr(store, "messages_write", None))

    def _encoded(
        self, config: RunnableConfig, checkpoint: Checkpoint
    ) -> tuple[Checkpoint, MessageRows | None]:
        if not (self.store_messages and self._message_store()):
            return checkpoint, None
        return self.message_log.encode(config, checkpoint, self.serde)

    def _failed_write(self, rows: MessageRows) -> None:
        # The log already counts the rows as written; forgetting the thread makes the next
        # write start a new sequence instead of appending after rows that may be missing.
        self.message_log.forget(rows.thread_id)

    def _riding(self) -> AbstractContextManager[Ride | None]:
        # Only a saver that declares it takes the rows into its put (see .messages.Ride).
        if getattr(self.inner, "rides_messages", False):
            return riding(getattr(self, "store", None))
        return nullcontext()

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
            self._on_disk(stored)
            return cast(RunnableConfig, stored)
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

    def _check_readable(self, thread_id: str, refs: Mapping[str, MessageRef]) -> None:
        if refs and not self._message_store():
            raise CorruptRecordError(
                "the checkpoint refers to stored messages, but this checkpointer's recovery "
                "store keeps none; open it with the store that wrote it",
                table="checkpoints",
                key=thread_id,
            )

    def _rebuilt(
        self,
        tup: CheckpointTuple,
        loaded: Mapping[str, list[LoadedRow]],
        refs: Mapping[str, MessageRef],
        *,
        remember: bool,
        listing: _Listing | None,
    ) -> CheckpointTuple:
        thread_id, ns = _where(tup.config)
        values: dict[str, Any] = {}
        for channel, ref in refs.items():
            memo = None if listing is None else listing.messages
            decoded, keys = rebuild(thread_id, ref, loaded[channel], self.serde, memo)
            value, elements, names = as_value(thread_id, ref, decoded)
            if remember:  # the graph continues from this list: its next put extends it
                self.message_log.remember(thread_id, ns, channel, ref, elements, keys, names)
            values[channel] = value
        return tup._replace(checkpoint=with_values(tup.checkpoint, values))

    def _decoded(
        self, tup: CheckpointTuple | None, remember: bool, listing: _Listing | None
    ) -> Steps[CheckpointTuple | None]:
        """``tup`` with its message references replaced by the lists they stand for."""
        if tup is None or not (refs := message_refs(tup.checkpoint)):
            return tup
        thread_id, _ = _where(tup.config)
        self._check_readable(thread_id, refs)
        loaded: dict[str, list[LoadedRow]] = {}
        for channel, ref in refs.items():
            rows = None if listing is None else listing.known(ref)
            if rows is None:
                rows = yield io(self, "_call", "messages_read", thread_id, ref.seq, ref.length)
                if listing is not None:
                    listing.add(ref, rows)
            loaded[channel] = rows
        return self._rebuilt(tup, loaded, refs, remember=remember, listing=listing)

    # LangGraph's SQLite savers hold their lock (shared with the store) while a listing is
    # open, so the store cannot be read in the middle of one. Checkpoints without references
    # pass through as they come; at the first one with references the rest of the listing
    # is read to its end (small: it holds references, not lists) and the lock released.

    def _decoding(self, tuples: Iterator[CheckpointTuple]) -> Iterator[CheckpointTuple]:
        listing = _Listing()
        for tup in tuples:
            if message_refs(tup.checkpoint):
                rest = [tup, *tuples]
                for item in rest:
                    decoded = run_steps(self._decoded(item, False, listing))
                    assert decoded is not None
                    yield decoded
                return
            yield tup

    async def _adecoding(
        self, tuples: AsyncIterator[CheckpointTuple]
    ) -> AsyncIterator[CheckpointTuple]:
        listing = _Listing()
        async for tup in tuples:
            if message_refs(tup.checkpoint):
                rest = [tup, *[item async for item in tuples]]
                for item in rest:
                    decoded = await arun_steps(self._decoded(item, False, listing))
                    assert decoded is not None
                    yield decoded
                return
            yield tup

    def _seed_refs(
        self, config: RunnableConfig, history: Mapping[str, DeltaChannelHistory]
    ) -> dict[str, MessageRef]:
        # A channel turned into a DeltaChannel after it was stored here seeds from a marker.
        refs = {
            channel: ref
            for channel, entry in history.items()
            if (ref := read_marker(entry.get("seed"))) is not None
        }
        self._check_readable(_where(config)[0], refs)
        return refs

    def _get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Steps[Mapping[str, DeltaChannelHistory]]:
        history = yield io(
            self.inner, "get_delta_channel_history", config=config, channels=channels
        )
        if not (refs := self._seed_refs(config, history)):
            return cast(Mapping[str, DeltaChannelHistory], history)
        thread_id, _ = _where(config)
        result = dict(history)
        for channel, ref in refs.items():
            rows = yield io(self, "_call", "messages_read", thread_id, ref.seq, ref.length)
            entry = DeltaChannelHistory(writes=history[channel]["writes"])
            decoded = rebuild(thread_id, ref, rows, self.serde)[0]
            entry["seed"] = as_value(thread_id, ref, decoded)[0]
            result[channel] = entry
        return result

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

    def get(self, config: RunnableConfig) -> Checkpoint | None:
        tup = self.get_tuple(config)  # not the inner get: its lists must be rebuilt
        return None if tup is None else tup.checkpoint

    async def aget(self, config: RunnableConfig) -> Checkpoint | None:
        tup = await self.aget_tuple(config)
        return None if tup is None else tup.checkpoint

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

    def _get_tuple(self, config: RunnableConfig) -> Steps[CheckpointTuple | None]:
        _checked(config)
        yield from self._before_read(config)
        with mapped_errors("get_tuple"):
            if self.held is not None:
                yield from self._held_calls(self.held.release(config))
            tup = yield io(self.inner, "get_tuple", config)
            if tup is not None:
                self._on_disk(tup.config)
            return (yield from self._decoded(tup, True, None))

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return run_steps(self._get_tuple(config))

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await arun_steps(self._get_tuple(config))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        if self.held is not None:
            run_steps(self._held_calls(self.held.release(config)))
        return self._decoding(self.inner.list(config, filter=filter, before=before, limit=limit))

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        if self.held is not None:
            await arun_steps(self._held_calls(self.held.release(config)))
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

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return run_steps(self._put(config, checkpoint, metadata, new_versions))

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return await arun_steps(self._put(config, checkpoint, metadata, new_versions))

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

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        run_steps(self._put_writes(config, writes, task_id, task_path))

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await arun_steps(self._put_writes(config, writes, task_id, task_path))

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return run_steps(self._get_delta_channel_history(config=config, channels=channels))

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        steps = self._get_delta_channel_history(config=config, channels=channels)
        return await arun_steps(steps)
