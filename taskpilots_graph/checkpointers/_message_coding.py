"""How the delegating saver stores message lists once per thread and reads them back.

The checkpoint handed to the saver refers to message rows of the recovery store
(:mod:`.messages`); every read (``get_tuple``, ``list``, their async forms, the seeds of
``get_delta_channel_history``) rebuilds the exact lists, so callers see what the bare saver
would have returned. :class:`MessageCoding` reaches the store through the ``_call`` /
``_acall`` primitives of :class:`~taskpilots_graph.checkpointers._wrapper.DelegatingSaver`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from langchain_core.messages import BaseMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    Checkpoint,
    CheckpointTuple,
    DeltaChannelHistory,
)

from taskpilots_graph._twins import Steps, arun_steps, io, run_steps
from taskpilots_graph.checkpointers._message_log import MessageLog
from taskpilots_graph.checkpointers._ride_rows import Ride, riding
from taskpilots_graph.checkpointers.messages import (
    LoadedRow,
    MessageRef,
    MessageRows,
    as_value,
    message_refs,
    read_marker,
    rebuild,
    with_values,
)
from taskpilots_graph.errors import CorruptRecordError

__all__ = ["MessageCoding"]


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


class MessageCoding(BaseCheckpointSaver[Any]):
    """Message lists of checkpoints encoded into stored rows, and decoded back on reads."""

    inner: BaseCheckpointSaver[Any]

    store_messages: bool = True
    """Store message lists once per thread and refer to them from checkpoints (see
    :mod:`.messages`); ``False`` leaves them inside the checkpoints, as LangGraph does.
    Checkpoints referring to stored messages are read either way."""

    message_log: MessageLog

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
        # Only a saver that declares it takes the rows into its put (see ._ride_rows.Ride).
        if getattr(self.inner, "rides_messages", False):
            return riding(getattr(self, "store", None))
        return nullcontext()

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

    def _seeded(
        self, config: RunnableConfig, history: Mapping[str, DeltaChannelHistory]
    ) -> Steps[Mapping[str, DeltaChannelHistory]]:
        """``history`` (the saver's) with each seed that refers to stored messages rebuilt."""
        # A channel turned into a DeltaChannel after it was stored here seeds from a marker.
        refs = {
            channel: ref
            for channel, entry in history.items()
            if (ref := read_marker(entry.get("seed"))) is not None
        }
        thread_id, _ = _where(config)
        self._check_readable(thread_id, refs)
        if not refs:
            return history
        result = dict(history)
        for channel, ref in refs.items():
            rows = yield io(self, "_call", "messages_read", thread_id, ref.seq, ref.length)
            entry = DeltaChannelHistory(writes=history[channel]["writes"])
            decoded = rebuild(thread_id, ref, rows, self.serde)[0]
            entry["seed"] = as_value(thread_id, ref, decoded)[0]
            result[channel] = entry
        return result
