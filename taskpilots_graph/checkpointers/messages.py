"""Messages stored once per thread; checkpoints refer to them (I/O free).

LangGraph's savers store a channel's whole value in every checkpoint that changes it, and the
``messages`` channel changes at every step: a conversation of N messages costs O(N²) bytes.
Here each message of a thread is stored once, content-addressed (by its id and a digest of
its serialized form), and the checkpoint holds a small marker in place of the list::

    {"__taskpilots_messages__": 1, "seq": S, "len": n}    # the first n positions of sequence S

*Sequences* keep the references linear too (N references per checkpoint would be quadratic
again). A sequence is an append-only run of positions, rows ``(thread, seq, position) → key``;
sequence S with parent ``(P, k)`` takes positions ``0..k-1`` from P and has rows of its own
from k on. A list that extends the one last stored appends rows to its sequence; an edit
(same id, new content), a ``RemoveMessage`` or a fork (a list that does not extend it) starts
a child sequence sharing the longest common prefix, so editing the last message costs one
row, not N.

Finding that prefix must not re-hash the conversation at every step (quadratic CPU), so
:class:`~._message_log.MessageLog` remembers, per (thread, namespace, channel), the message
objects last written and last read, and compares object identity: ``add_messages`` keeps
unchanged messages as the same objects and replaces an edited one. Only the new tail is
serialized and hashed. A message whose attributes are assigned in place after it entered the
state (instead of being replaced through the reducer) is therefore not noticed; LangGraph
state is updated by returning values, not by mutating them.

What is encoded: a non-empty list of langchain ``BaseMessage`` whose every message has a
string id (the ``messages`` channel of ``add_messages``), and a non-empty :class:`RecordMap`
(records by string key, e.g. the recovery agent's step layer: one record per tool call,
which grows with the work like the conversation). A record map is stored as a sequence of
``[key, record]`` entries, compared by key and record identity; its reducer promises to
replace a record, never to change one in place, which is why only that type is encoded and
never a plain ``dict``. Anything else, ``DeltaChannel`` snapshots included, is left to the
saver untouched, and checkpoints written without the store (before it existed, or by a
plain LangGraph saver) load as they are.

The stores (memory, SQLite, PostgreSQL) insert :class:`MessageRows` and answer reads with
``(position, key, type, payload)`` rows. The rows are written in the same transaction as the
checkpoint that refers to them (a :class:`~._ride_rows.Ride`) when the saver is one the
checkpointer opened itself (``from_conn_string``): the savers of :mod:`.sqlite` and
:mod:`._pg_connect` take them into their ``put``, so a reader never sees the checkpoint
without its rows and the rows cost no commit of their own. Any other saver gets them first,
in a transaction of their own (a crash in between leaves unreferenced rows, never a
checkpoint pointing at nothing). Retention never deletes message rows (a kept checkpoint may
refer to any of them); ``delete_thread`` deletes them all.

Why not LangGraph's ``DeltaChannel`` (beta in 1.2): it is chosen by the graph's author per
state field, not by the checkpointer, so existing graphs using ``add_messages`` would not
benefit; it rebuilds a value by replaying every write since the last snapshot and writes a
full snapshot every ``snapshot_frequency`` updates (still quadratic, divided by that
frequency); and ``prune(keep_latest)`` refuses threads that use it. This encoding is
invisible to the graph and keeps every read exact; graphs that do use ``DeltaChannel`` are
left alone (their snapshots are not lists), and a seed read through
``get_delta_channel_history`` is rebuilt like any other value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from langchain_core.messages import BaseMessage
from langgraph.checkpoint.base import Checkpoint
from langgraph.checkpoint.serde.base import SerializerProtocol

from taskpilots_graph.errors import CorruptRecordError

__all__ = [
    "MARKER",
    "MESSAGES_TABLE",
    "LoadedRow",
    "MessageRef",
    "MessageRows",
    "RecordMap",
    "SequenceRow",
    "StoredMessage",
    "as_value",
    "message_refs",
    "read_marker",
    "rebuild",
    "with_values",
]

MARKER: Final = "__taskpilots_messages__"
"""The key that marks a channel value as a reference to stored messages."""

MESSAGES_TABLE: Final = "taskpilots_messages"

LoadedRow = tuple[int, bytes, str, bytes]
"""A stored message as a read returns it: ``(position, key, serde type, payload)``."""


class RecordMap(dict[str, Any]):
    """Records by key, each replaced as a whole and never changed in place.

    A reducer returning this type (rather than a plain ``dict``) lets the checkpointer store
    each record once and refer to it from every later checkpoint. Serializers see a plain
    ``dict``; reads through the checkpointer give a ``RecordMap`` back.
    """

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class MessageRef:
    """A checkpoint's reference: the first ``length`` positions of sequence ``seq``;
    ``mapping`` when they are the entries of a :class:`RecordMap`."""

    seq: int
    length: int
    mapping: bool = False

    def marker(self) -> dict[str, int]:
        """The plain dict stored as the channel value (every serde round-trips it)."""
        marker = {MARKER: 1, "seq": self.seq, "len": self.length}
        if self.mapping:
            marker["map"] = 1
        return marker


@dataclass(frozen=True, slots=True)
class SequenceRow:
    """A new sequence; ``parent_seq`` (or ``None`` for a root) gives positions below
    ``parent_len``."""

    seq: int
    checkpoint_ns: str
    channel: str
    parent_seq: int | None
    parent_len: int


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """One message serialized by the saver's serde, under its content key."""

    key: bytes
    message_id: str
    type: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class MessageRows:
    """What one checkpoint needs written before it: new sequences, references, messages.

    Messages are inserted only if the thread does not hold their key yet.
    """

    thread_id: str
    sequences: tuple[SequenceRow, ...]
    refs: tuple[tuple[int, int, bytes], ...]
    """``(seq, position, key)``."""
    messages: tuple[StoredMessage, ...]


def read_marker(value: Any) -> MessageRef | None:
    """The reference a channel value stands for, or ``None`` if it is an ordinary value.

    Raises:
        CorruptRecordError: For a value carrying the marker key but not a valid reference.
    """
    if type(value) is not dict or MARKER not in value:
        return None
    seq, length, mapping = value.get("seq"), value.get("len"), value.get("map", 0)
    if (
        value[MARKER] != 1
        or type(seq) is not int
        or type(length) is not int
        or length < 0
        or mapping not in (0, 1)
    ):
        raise CorruptRecordError(
            f"a checkpoint holds an unreadable message reference {value!r}",
            table="checkpoints",
            key=MARKER,
        )
    return MessageRef(seq, length, bool(mapping))


def message_refs(checkpoint: Checkpoint) -> dict[str, MessageRef]:
    """The checkpoint's channels that refer to stored messages, and their references."""
    return {
        channel: ref
        for channel, value in (checkpoint.get("channel_values") or {}).items()
        if (ref := read_marker(value)) is not None
    }


def with_values(checkpoint: Checkpoint, values: Mapping[str, Any]) -> Checkpoint:
    """A copy of ``checkpoint`` with some channel values replaced (the input is untouched)."""
    copied = checkpoint.copy()
    copied["channel_values"] = {**checkpoint.get("channel_values", {}), **values}
    return copied


def rebuild(
    thread_id: str,
    ref: MessageRef,
    rows: Sequence[LoadedRow],
    serde: SerializerProtocol,
    memo: dict[bytes, BaseMessage] | None = None,
) -> tuple[list[BaseMessage], list[bytes]]:
    """The exact message list (and its keys) a reference stands for, from its rows.

    Args:
        thread_id: The thread, for the error message.
        ref: The reference.
        rows: The rows a store read for it, ordered by position.
        serde: The saver's serializer (the one that wrote the payloads).
        memo: Messages already decoded by key, shared by one listing (each stored message
            is decoded once however many checkpoints refer to it).

    Raises:
        CorruptRecordError: If a referenced position or message is missing.
    """
    if len(rows) != ref.length or any(row[0] != i for i, row in enumerate(rows)):
        raise CorruptRecordError(
            f"a checkpoint refers to {ref.length} stored messages, {len(rows)} were found",
            table=MESSAGES_TABLE,
            key=f"{thread_id}/{ref.seq}/{ref.length}",
        )
    messages: list[BaseMessage] = []
    keys: list[bytes] = []
    for _, key, type_, payload in rows:
        message = None if memo is None else memo.get(key)
        if message is None:
            try:
                message = serde.loads_typed((type_, payload))
            except Exception as exc:
                raise CorruptRecordError(
                    f"a stored message cannot be decoded ({type(exc).__name__}: {exc})",
                    table=MESSAGES_TABLE,
                    key=f"{thread_id}/{key.hex()}",
                ) from exc
            if memo is not None:
                memo[key] = message
        messages.append(message)
        keys.append(key)
    return messages, keys


def as_value(
    thread_id: str, ref: MessageRef, decoded: list[Any]
) -> tuple[list[Any] | RecordMap, list[Any], list[str] | None]:
    """The channel value that :func:`rebuild`'s objects stand for, the elements to remember
    (messages, or a map's records) and the map's keys (``None`` for a list).

    Raises:
        CorruptRecordError: If a record map's entry is not a ``[key, record]`` pair.
    """
    if not ref.mapping:
        return decoded, decoded, None
    for entry in decoded:
        if type(entry) not in (list, tuple) or len(entry) != 2 or type(entry[0]) is not str:
            raise CorruptRecordError(
                f"a stored record is not a [key, record] pair: {type(entry).__name__}",
                table=MESSAGES_TABLE,
                key=f"{thread_id}/{ref.seq}",
            )
    names, records = [entry[0] for entry in decoded], [entry[1] for entry in decoded]
    return RecordMap(zip(names, records, strict=True)), records, names
