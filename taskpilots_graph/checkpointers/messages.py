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
:class:`MessageLog` remembers, per (thread, namespace, channel), the message objects last
written and last read, and compares object identity: ``add_messages`` keeps unchanged
messages as the same objects and replaces an edited one. Only the new tail is serialized and
hashed. A message whose attributes are assigned in place after it entered the state (instead
of being replaced through the reducer) is therefore not noticed; LangGraph state is updated
by returning values, not by mutating them.

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
checkpoint that refers to them (a :class:`Ride`) when the saver is one the checkpointer
opened itself (``from_conn_string``): the savers of :mod:`.sqlite` and :mod:`._pg_connect`
take them into their ``put``, so a reader never sees the checkpoint without its rows and
the rows cost no commit of their own. Any other saver gets them first, in a transaction of
their own (a crash in between leaves unreferenced rows, never a checkpoint pointing at
nothing). Retention never deletes message rows (a kept checkpoint may refer to any of
them); ``delete_thread`` deletes them all.

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

import hashlib
import secrets
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from operator import is_
from typing import Any, Final

from langchain_core.messages import BaseMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import Checkpoint
from langgraph.checkpoint.serde.base import SerializerProtocol

from taskpilots_graph._messages import MessageList
from taskpilots_graph.errors import CorruptRecordError

__all__ = [
    "MARKER",
    "MESSAGES_TABLE",
    "NS_SEP",
    "REMEMBERED_LISTS",
    "LoadedRow",
    "MessageLog",
    "MessageRef",
    "MessageRows",
    "RecordMap",
    "Ride",
    "SequenceRow",
    "StoredMessage",
    "as_value",
    "message_refs",
    "pending_ride",
    "read_marker",
    "rebuild",
    "riding",
    "with_values",
]

MARKER: Final = "__taskpilots_messages__"
"""The key that marks a channel value as a reference to stored messages."""

MESSAGES_TABLE: Final = "taskpilots_messages"

LoadedRow = tuple[int, bytes, str, bytes]
"""A stored message as a read returns it: ``(position, key, serde type, payload)``."""

_Key = tuple[str, str, str]  # (thread_id, checkpoint_ns, channel)

NS_SEP: Final = "|"
"""Separates the levels of a ``checkpoint_ns`` (LangGraph's ``NS_SEP``)."""

REMEMBERED_LISTS: Final = 128
"""Lists remembered per checkpointer (written and read, each), least recently used out.

They hold the message objects alive, so the bound is on memory; a thread forgotten while
it still runs pays once: its next write starts a sequence with the whole list's references
(messages already stored are not stored again)."""


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
    names: list[str] = []
    records: list[Any] = []
    for entry in decoded:
        if type(entry) not in (list, tuple) or len(entry) != 2 or type(entry[0]) is not str:
            raise CorruptRecordError(
                f"a stored record is not a [key, record] pair: {type(entry).__name__}",
                table=MESSAGES_TABLE,
                key=f"{thread_id}/{ref.seq}",
            )
        names.append(entry[0])
        records.append(entry[1])
    return RecordMap(zip(names, records, strict=True)), records, names


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
            if not value:
                continue
            if type(value) is list or type(value) is MessageList:
                planned = self._plan((thread_id, ns, channel), value, None, serde)
            elif type(value) is RecordMap:
                planned = self._plan(
                    (thread_id, ns, channel), list(value.values()), list(value), serde
                )
            else:
                continue
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
            if names is None:
                if not all(map(_storable, value[shared:])):
                    return None  # stored inline, exactly as the saver would
            elif not all(map(_storable_name, names[shared:])):
                return None
            if best is not None and shared == len(value):
                # Unchanged, or an earlier point of the stored list (a fork): no rows.
                return MessageRef(best.seq, shared, mapping), None, [], []
            if names is None:
                tail = [_stored(m, serde) for m in value[shared:]]
            else:
                pairs = zip(value[shared:], names[shared:], strict=True)
                tail = [_stored(record, serde, name) for record, name in pairs]
            known = best.keys[:shared] if best is not None else []
            # Only the namespace that wrote a sequence appends to it (one writer per sequence).
            appends = own and best is not None and best.end == shared == len(best.messages)
            sequence: SequenceRow | None = None
            if appends:
                assert best is not None
                seq = best.seq
            else:
                seq = _new_seq()
                parent = best.seq if best is not None and shared else None
                parent_len = 0 if parent is None else shared
                sequence = SequenceRow(seq, key[1], key[2], parent, parent_len)
            if not appends and best is not None:
                # A child after a removal or an edit re-refers to messages already stored:
                # only their references are new.
                stored_keys = set(best.keys)
                new_messages = [s for s in tail if s.key not in stored_keys]
            else:
                new_messages = tail
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
        found = [(base, True) for base in (self._written.get(key), self._read.get(key)) if base]
        parts = ns.split(NS_SEP) if ns else []
        for depth in range(len(parts) - 1, -1, -1):
            parent = (thread_id, NS_SEP.join(parts[:depth]), channel)
            found += [
                (base, False)
                for base in (self._written.get(parent), self._read.get(parent))
                if base
            ]
        return found

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


@dataclass(slots=True, eq=False)
class Ride:
    """A checkpoint's message rows, handed from the store to the saver's own transaction.

    Open around one ``put`` by :func:`riding`: the store's ``messages_write`` finds it and
    leaves the rows here (with the function that inserts them on the saver's cursor or
    connection) instead of committing them; the saver's ``put`` inserts them in the
    transaction that writes the checkpoint and marks the ride ``written`` once it committed.
    A failed attempt leaves them unwritten, and a saver's retry inserts them again (every
    insert ignores rows already there).
    """

    store: object
    """The store whose ``messages_write`` may hand its rows over (the saver's database)."""
    rows: object | None = None
    """The rows held: :class:`MessageRows`, or the ledger commits riding a put_writes."""
    write: Callable[[Any], None] | None = None
    awrite: Callable[[Any], Awaitable[None]] | None = None
    written: bool = False

    def take(
        self,
        rows: object,
        write: Callable[[Any], None] | None = None,
        awrite: Callable[[Any], Awaitable[None]] | None = None,
    ) -> None:
        """Hold ``rows`` for the saver, with their sync or async insert."""
        self.rows, self.write, self.awrite = rows, write, awrite

    @property
    def stranded(self) -> bool:
        """Rows were handed over, but no saver transaction wrote them."""
        return self.rows is not None and not self.written


_RIDE: ContextVar[Ride | None] = ContextVar("taskpilots_message_ride", default=None)


@contextmanager
def riding(store: object) -> Iterator[Ride]:
    """Within the block, ``store.messages_write`` hands its rows to the saver's next put.

    A context variable, so concurrent puts (threads, tasks) each carry their own rows.
    """
    ride = Ride(store)
    token = _RIDE.set(ride)
    try:
        yield ride
    finally:
        _RIDE.reset(token)


def pending_ride(store: object | None = None) -> Ride | None:
    """The open ride of this context: for ``store`` to hand rows to (``store`` given), or
    for a saver to write (rows held, not yet written)."""
    ride = _RIDE.get()
    if ride is None:
        return None
    if store is not None:
        return ride if ride.store is store and ride.rows is None else None
    return ride if ride.rows is not None and not ride.written else None
