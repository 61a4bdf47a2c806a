"""Event compaction: old events of a thread reduced to their kind and key fields (I/O free).

:class:`CompactionPolicy` / :func:`compact_events` decide which events older than the last
*N* of a thread are reduced to their kind plus key parameters. Ledger-relevant fields
(:data:`LEDGER_FIELDS`) are never dropped, and events whose whole payload is a ledger or
human fact (:data:`DEFAULT_PROTECTED_KINDS`) are never reduced. The checkpointers apply the
plan with ``checkpointer.compact_events(thread_id, keep_last=N)``; observation summaries,
the other half of bounded state, are in :mod:`taskpilots_graph.compression`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import Event, EventKind, encode_payload

__all__ = [
    "COMPACTED_KEY",
    "DEFAULT_KEY_FIELDS",
    "DEFAULT_PROTECTED_KINDS",
    "LEDGER_FIELDS",
    "CompactionPolicy",
    "EventCompaction",
    "compact_events",
]

LEDGER_FIELDS: Final = frozenset({"key", "proof", "status", "tool", "tool_call_id"})
"""Event fields compaction always keeps: they tie an event to its ledger entry and outcome."""

DEFAULT_KEY_FIELDS: Final = (
    "artifact_id",
    "attempt",
    "failure.error_type",
    "failure.kind",
    "failure.sqlstate",
    "failure.status",
    "maybe_sent",
    "outcome",
    "reason",
    "retry_at",
)
"""Small parameters kept besides :data:`LEDGER_FIELDS`; ``a.b`` keeps ``b`` inside ``a``.

They are what failure statistics and attribution read (which tool failed how, on which
attempt, whether the request may have been sent); arguments, results and messages go.
"""

DEFAULT_PROTECTED_KINDS: Final = frozenset(
    {
        EventKind.COMPENSATED,
        EventKind.DECISION_RECORDED,
        EventKind.EFFECT_RECONCILED,
        EventKind.EFFECT_UNCERTAIN,
        EventKind.MILESTONE_REACHED,
    }
)
"""Kinds never compacted: their payload *is* a ledger fact, a human decision or a rewind
target, and all of it may be needed to explain or undo an effect."""

COMPACTED_KEY: Final = "_compacted"
"""Marker added to a compacted payload: ``{"bytes": <original size>, "dropped": [...]}``."""


@dataclass(frozen=True, slots=True)
class EventCompaction:
    """One event to rewrite: its identity and its reduced payload.

    Attributes:
        thread_id: The event's thread.
        seq: The event's position (unchanged by compaction).
        kind: The event's kind (unchanged by compaction).
        payload: The reduced payload, with a :data:`COMPACTED_KEY` marker.
        encoded: ``payload`` in the store's encoding.
        bytes_before: Size of the encoded payload before compaction.
    """

    thread_id: str
    seq: int
    kind: EventKind
    payload: Mapping[str, Any]
    encoded: str
    bytes_before: int


_Tree = dict[str, "_Tree | None"]  # field path tree: None = keep the whole value


@dataclass(frozen=True, slots=True)
class CompactionPolicy:
    """Which events of a thread are reduced, and to what.

    Build it with :meth:`of` to pass lists or kind names.

    Attributes:
        keep_last: Events kept whole at the end of each thread's log (>= 0).
        key_fields: Fields kept besides :data:`LEDGER_FIELDS`; ``"a.b"`` keeps field ``b``
            of the object in field ``a``.
        protected_kinds: Kinds never reduced.
    """

    keep_last: int
    key_fields: tuple[str, ...] = DEFAULT_KEY_FIELDS
    protected_kinds: frozenset[EventKind] = DEFAULT_PROTECTED_KINDS

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or isinstance(self.keep_last, bool):
            raise ConfigurationError(f"keep_last must be an int, got {self.keep_last!r}")
        if self.keep_last < 0:
            raise ConfigurationError(f"keep_last must be >= 0, got {self.keep_last}")
        for path in self.key_fields:
            if not isinstance(path, str) or not all(path.split(".")):
                raise ConfigurationError(
                    f"key field {path!r} must be a field name or a dotted path like 'a.b'"
                )

    @classmethod
    def of(
        cls,
        keep_last: int,
        *,
        key_fields: Iterable[str] = DEFAULT_KEY_FIELDS,
        protected_kinds: Iterable[EventKind | str] = DEFAULT_PROTECTED_KINDS,
    ) -> CompactionPolicy:
        """A policy from any iterables; kind names are checked against :class:`EventKind`.

        Raises:
            ConfigurationError: For a negative ``keep_last``, an empty field path or an
                unknown kind.
        """
        if isinstance(key_fields, str):
            raise ConfigurationError("key_fields must be a collection of names, not one str")
        fields = tuple(key_fields)
        for path in fields:
            if not isinstance(path, str):
                raise ConfigurationError(f"key field {path!r} must be a str")
        kinds = set()
        for kind in protected_kinds:
            try:
                kinds.add(EventKind(kind))
            except ValueError as exc:
                raise ConfigurationError(f"unknown event kind {kind!r}") from exc
        return cls(keep_last, tuple(sorted(set(fields))), frozenset(kinds))

    def _tree(self) -> _Tree:
        tree: _Tree = dict.fromkeys((*LEDGER_FIELDS, COMPACTED_KEY))
        for path in self.key_fields:
            node = tree
            *parents, leaf = path.split(".")
            for part in parents:
                if part in node and node[part] is None:
                    break  # an ancestor is kept whole already
                child = node.setdefault(part, {})
                assert child is not None
                node = child
            else:
                node[leaf] = None
        return tree

    def reduce(self, payload: Mapping[str, Any]) -> dict[str, Any] | None:
        """``payload`` reduced to the kept fields and marked, or ``None`` if that would not
        make it smaller (nothing to drop, or the marker would outweigh what is dropped)."""
        return _reduce(payload, self._tree())

    def plan(self, events: Iterable[Event]) -> list[EventCompaction]:
        """The events to rewrite: per thread, all but the last ``keep_last``, unprotected,
        and only those that shrink. Ordered by thread and seq."""
        tree = self._tree()
        by_thread: dict[str, list[Event]] = {}
        for event in events:
            by_thread.setdefault(event.thread_id, []).append(event)
        out = []
        for thread_id in sorted(by_thread):
            log = sorted(by_thread[thread_id], key=lambda e: e.seq)
            for event in log[: max(0, len(log) - self.keep_last)]:
                if event.kind in self.protected_kinds:
                    continue
                reduced = _reduce(event.payload, tree)
                if reduced is None:
                    continue
                out.append(
                    EventCompaction(
                        thread_id=thread_id,
                        seq=event.seq,
                        kind=event.kind,
                        payload=reduced,
                        encoded=encode_payload(reduced),
                        bytes_before=len(encode_payload(event.payload).encode()),
                    )
                )
        return out


def _reduce(payload: Mapping[str, Any], tree: _Tree) -> dict[str, Any] | None:
    reduced = _project(payload, tree)
    dropped = sorted(k for k in payload if k not in reduced or reduced[k] != payload[k])
    if not dropped:
        return None
    size = len(encode_payload(payload).encode())
    before = size
    previous = payload.get(COMPACTED_KEY)
    if isinstance(previous, Mapping):
        # Compacted before under a wider policy: report the original size, merge the lists.
        if isinstance(previous.get("bytes"), int):
            before = previous["bytes"]
        earlier = previous.get("dropped")
        if isinstance(earlier, list):
            dropped = sorted({*(d for d in earlier if isinstance(d, str)), *dropped})
    reduced[COMPACTED_KEY] = {"bytes": before, "dropped": dropped}
    if len(encode_payload(reduced).encode()) >= size:
        return None
    return reduced


def _project(value: Mapping[str, Any], tree: _Tree) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key not in tree:
            continue
        sub = tree[key]
        if sub is None:
            out[key] = item
        elif isinstance(item, Mapping):
            kept = _project(item, sub)
            if kept:
                out[key] = kept
    return out


def compact_events(
    events: Iterable[Event],
    *,
    keep_last: int,
    key_fields: Iterable[str] = DEFAULT_KEY_FIELDS,
    protected_kinds: Iterable[EventKind | str] = DEFAULT_PROTECTED_KINDS,
) -> list[EventCompaction]:
    """Which events to reduce to their kind plus key parameters, and their new payloads.

    Per thread, events older than the last ``keep_last`` keep only :data:`LEDGER_FIELDS`
    (always), ``key_fields`` and a :data:`COMPACTED_KEY` marker saying how big the payload
    was and which fields went. Kinds in ``protected_kinds`` are never reduced, and an event
    is only rewritten if that makes it smaller, so compacting twice changes nothing.

    Raises:
        ConfigurationError: For a negative ``keep_last``, a bad field path or an unknown kind.
    """
    policy = CompactionPolicy.of(keep_last, key_fields=key_fields, protected_kinds=protected_kinds)
    return policy.plan(events)
