"""The encoding side of :mod:`.messages` (whose docs give the format and the reasons): what
each thread's lists are stored as, and the rows a checkpoint's new tail needs."""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from operator import is_
from typing import Any, Final

from langchain_core.messages import BaseMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import Checkpoint
from langgraph.checkpoint.serde.base import SerializerProtocol

from taskpilots_graph._messages import MessageList
from taskpilots_graph.checkpointers.messages import (
    MessageRef,
    MessageRows,
    RecordMap,
    SequenceRow,
    StoredMessage,
    with_values,
)

__all__ = ["NS_SEP", "REMEMBERED_LISTS", "MessageLog"]

_Key = tuple[str, str, str]  # (thread_id, checkpoint_ns, channel)

NS_SEP: Final = "|"
"""Separates the levels of a ``checkpoint_ns`` (LangGraph's ``NS_SEP``)."""

REMEMBERED_LISTS: Final = 128
"""Lists remembered per checkpointer (written and read, each), least recently used out.

They hold the message objects alive, so the bound is on memory; a thread forgotten while
it still runs pays once: its next write starts a sequence with the whole list's references
(messages already stored are not stored again)."""


@dataclass(slots=True)
class _Base:
    """A list known to be stored: positions ``0..len(messages)-1`` of sequence ``seq``."""

    seq: int
    messages: list[Any]
    keys: list[bytes]
    end: int | None
    """The sequence's next free position when this process wrote its tail (and may append
    to it), ``None`` when the list was read (the sequence may have rows beyond it)."""
    names: list[str] | None = None
    """A record map's keys, position by position (``None``: a message list)."""


def _common_prefix(stored: Sequence[Any], value: Sequence[Any]) -> int:
    # One C-level pass for the usual case (every stored message is still there, unchanged);
    # the position of a difference is searched for only when there is one.
    if all(map(is_, stored, value)):
        return min(len(stored), len(value))
    return next(i for i, (a, b) in enumerate(zip(stored, value, strict=False)) if a is not b)


def _same_names(stored: Sequence[str], value: Sequence[str], upto: int) -> int:
    # Keys are compared by value (strings): a record map's prefix ends at the first
    # position whose key or record differs. Fast path as in _common_prefix.
    if stored[:upto] == value[:upto]:
        return upto
    return next((i for i in range(upto) if stored[i] != value[i]), upto)


def _storable_name(name: Any) -> bool:
    if type(name) is not str or "\x00" in name:
        return False
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def _storable(message: Any) -> bool:
    return isinstance(message, BaseMessage) and _storable_name(message.id) and message.id != ""


def _stored(message: Any, serde: SerializerProtocol, name: str | None = None) -> StoredMessage:
    # A record map's entry is stored as ``[key, record]`` under its key; a message under
    # its id.
    type_, payload = serde.dumps_typed(message if name is None else [name, message])
    message_id = str(message.id) if name is None else name
    digest = hashlib.blake2b(digest_size=16)
    for part in (message_id.encode(), type_.encode(), payload):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return StoredMessage(digest.digest(), message_id, type_, payload)


def _keep(known: OrderedDict[_Key, _Base], key: _Key, base: _Base) -> None:
    # Least recently used first out: a long-lived worker serving many threads keeps only
    # its recent conversations in memory (a forgotten one costs one new sequence later).
    known[key] = base
    known.move_to_end(key)
    while len(known) > REMEMBERED_LISTS:
        known.popitem(last=False)


def _new_seq() -> int:
    # Random rather than counted: two processes (or a PostgreSQL pool's connections) never
    # need to agree on a counter. 62 bits fit every backend's signed 64-bit integer; a
    # collision within one thread is a ~k²/2⁶³ event for k sequences.
    return secrets.randbits(62) + 1


class MessageLog:
    """Encodes checkpoints for storage and remembers what each thread's lists are stored as.

    One per checkpointer, shared by its views (density, allowlist) and its sync and async
    faces; thread-safe. Forgetting is always safe: the next write starts a new sequence.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._written: OrderedDict[_Key, _Base] = OrderedDict()
        self._read: OrderedDict[_Key, _Base] = OrderedDict()

    def encode(
        self, config: RunnableConfig, checkpoint: Checkpoint, serde: SerializerProtocol
    ) -> tuple[Checkpoint, MessageRows | None]:
        """The checkpoint to store (message lists replaced by markers) and the rows that
        must be written before it (``None`` when nothing new is referenced).

        The written state is remembered at once: on a failed write call :meth:`forget`.
        """
        conf = config.get("configurable") or {}
        thread_id = str(conf.get("thread_id", ""))
        ns = str(conf.get("checkpoint_ns", ""))
        markers: dict[str, dict[str, int]] = {}
        sequences: list[SequenceRow] = []
        refs: list[tuple[int, int, bytes]] = []
        messages: dict[bytes, StoredMessage] = {}
        for channel, value in (checkpoint.get("channel_values") or {}).items():
            mapped = type(value) is RecordMap
            if not value or not (mapped or type(value) is list or type(value) is MessageList):
                continue
            items, names = (list(value.values()), list(value)) if mapped else (value, None)
            planned = self._plan((thread_id, ns, channel), items, names, serde)
            if planned is None:
                continue
            ref, sequence, new_refs, new_messages = planned
            markers[channel] = ref.marker()
            if sequence is not None:
                sequences.append(sequence)
            refs += new_refs
            for stored in new_messages:
                messages.setdefault(stored.key, stored)
        if not markers:
            return checkpoint, None
        encoded = with_values(checkpoint, markers)
        if not refs and not sequences:
            return encoded, None
        rows = MessageRows(thread_id, tuple(sequences), tuple(refs), tuple(messages.values()))
        return encoded, rows

    def _plan(
        self, key: _Key, value: list[Any], names: list[str] | None, serde: SerializerProtocol
    ) -> (
        tuple[MessageRef, SequenceRow | None, list[tuple[int, int, bytes]], list[StoredMessage]]
        | None
    ):
        # Under the lock throughout: two writers of one thread must not both append to one
        # sequence. Only the new tail is serialized here, so the lock is held briefly.
        with self._lock:
            best: _Base | None = None
            shared = 0
            own = True
            mapping = names is not None
            for base, mine in self._candidates(key):
                if (base.names is not None) != mapping:
                    continue
                n = _common_prefix(base.messages, value)
                if names is not None and base.names is not None:
                    n = _same_names(base.names, names, n)
                if best is None or n > shared:
                    best, shared, own = base, n, mine
            check, checked = (_storable, value) if names is None else (_storable_name, names)
            if not all(map(check, checked[shared:])):
                return None  # stored inline, exactly as the saver would
            if best is not None and shared == len(value):
                # Unchanged, or an earlier point of the stored list (a fork): no rows.
                return MessageRef(best.seq, shared, mapping), None, [], []
            tail_names = [None] * (len(value) - shared) if names is None else names[shared:]
            tail = [_stored(m, serde, n) for m, n in zip(value[shared:], tail_names, strict=True)]
            known = best.keys[:shared] if best is not None else []
            # Only the namespace that wrote a sequence appends to it (one writer per sequence).
            appends = own and best is not None and best.end == shared == len(best.messages)
            sequence: SequenceRow | None = None
            if best is not None and appends:
                seq, new_messages = best.seq, tail
            else:
                seq = _new_seq()
                parent = best.seq if best is not None and shared else None
                sequence = SequenceRow(seq, key[1], key[2], parent, 0 if parent is None else shared)
                # A child after a removal or an edit re-refers to messages already stored:
                # only their references are new.
                stored_keys = set(best.keys) if best is not None else set()
                new_messages = [s for s in tail if s.key not in stored_keys]
            keys = [*known, *(s.key for s in tail)]
            refs = [(seq, shared + i, s.key) for i, s in enumerate(tail)]
            base = _Base(seq, list(value), keys, len(value), None if names is None else list(names))
            _keep(self._written, key, base)
            return MessageRef(seq, len(value), mapping), sequence, refs, new_messages

    def _candidates(self, key: _Key) -> list[tuple[_Base, bool]]:
        """Lists this one may share a prefix with: its own namespace's (written, read), then
        its parent namespaces' (a subgraph starts from its parent's messages, the same
        objects), which it may refer to but never append to."""
        thread_id, ns, channel = key
        parts = ns.split(NS_SEP) if ns else []
        parents = [(thread_id, NS_SEP.join(parts[:depth]), channel) for depth in range(len(parts))]
        return [
            (base, where is key)
            for where in (key, *reversed(parents))
            for base in (self._written.get(where), self._read.get(where))
            if base
        ]

    def remember(
        self,
        thread_id: str,
        checkpoint_ns: str,
        channel: str,
        ref: MessageRef,
        messages: list[Any],
        keys: list[bytes],
        names: list[str] | None = None,
    ) -> None:
        """Note a list (or a record map's records and keys) just read: the graph continues
        from it, so its next write extends it."""
        base = _Base(ref.seq, list(messages), keys, None, names)
        with self._lock:
            _keep(self._read, (thread_id, checkpoint_ns, channel), base)

    def forget(self, thread_id: str) -> None:
        """Drop what is known of a thread (deleted, or a write of its rows failed)."""
        with self._lock:
            for known in (self._written, self._read):
                for key in [k for k in known if k[0] == thread_id]:
                    del known[key]
