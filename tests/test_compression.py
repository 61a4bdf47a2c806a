"""Bounded state: observation summaries and event compaction.

The pure functions are checked directly (with Hypothesis for the properties that must hold
for *any* input: summaries are deterministic and bounded, compaction never loses a ledger
field); the store compaction runs on real SQLite files and PostgreSQL (the ``cp`` fixture) and
on the in-memory backend, and must keep every event's seq, kind and time while shrinking the
old payloads.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sqlite3
from collections.abc import Mapping, Sequence
from contextlib import closing
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from taskpilots_graph import (
    AsyncRecoveryCheckpointer,
    ConfigurationError,
    Event,
    EventKind,
    RecoveryCheckpointer,
)
from taskpilots_graph.compaction import (
    COMPACTED_KEY,
    DEFAULT_PROTECTED_KINDS,
    LEDGER_FIELDS,
    compact_events,
)
from taskpilots_graph.compression import compress_observation, structural_summary
from taskpilots_graph.errors import CorruptRecordError

# --- helpers ----------------------------------------------------------------------------------

# Text every backend can store (no NUL, no lone surrogates), as the event log requires.
storable_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=20,
)


def _json(max_leaves: int) -> st.SearchStrategy[Any]:
    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | storable_text,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(storable_text.map(lambda k: k[:12]), children, max_size=4)
        ),
        max_leaves=max_leaves,
    )


json_values = _json(30)
payloads = st.dictionaries(
    st.sampled_from(
        ["key", "status", "proof", "tool", "tool_call_id", "args", "result", "failure", "x"]
    ),
    _json(6),
    max_size=6,
)


def _event(seq: int, kind: EventKind, payload: Mapping[str, Any], thread_id: str = "t") -> Event:
    return Event(thread_id=thread_id, seq=seq, kind=kind, ts=datetime.now(UTC), payload=payload)


def _tool_payload(i: int) -> dict[str, Any]:
    """A realistic, bulky event payload: what the executor logs around a tool call."""
    return {
        "tool": "create_ticket",
        "key": f"create_ticket:{i}",
        "tool_call_id": f"call-{i}",
        "status": "committed",
        "proof": {"ticket_id": f"T-{i}"},
        "attempt": 1,
        "args": {"customer_id": f"c-{i}", "subject": "printer on fire " * 20},
        "result": "created " + "x" * 600,
        "failure": {"kind": "transient", "error_type": "TimeoutError", "message": "m" * 300},
    }


def _is_postgres(conn_string: str) -> bool:
    return conn_string.startswith(("postgresql://", "postgres://"))


def _raw_sql(conn_string: str, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    if _is_postgres(conn_string):
        with psycopg.connect(conn_string, autocommit=True) as pg:
            cur = pg.execute(statement.replace("?", "%s"), params)
            return cur.fetchall() if cur.description else []
    with closing(sqlite3.connect(conn_string.removeprefix("sqlite:///"))) as lite, lite:
        return lite.execute(statement, params).fetchall()


def _stored_sizes(conn_string: str, thread_id: str) -> dict[int, int]:
    """Bytes each event's payload occupies as stored (JSON text / JSONB text)."""
    column = "octet_length(payload::text)" if _is_postgres(conn_string) else "length(payload)"
    rows = _raw_sql(
        conn_string,
        f"SELECT seq, {column} FROM taskpilots_events WHERE thread_id = ? ORDER BY seq",
        (thread_id,),
    )
    return {int(seq): int(size) for seq, size in rows}


# --- structural summaries ---------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(value=json_values, max_chars=st.integers(min_value=1, max_value=600))
def test_summaries_are_deterministic_and_bounded(value: Any, max_chars: int) -> None:
    """For any JSON value, its text and its bytes, and any bound: the summary fits the bound
    and is the same for equal inputs (no ids, clocks or hash-order leak into it)."""
    text = json.dumps(value)
    for form in (value, text, text.encode()):
        summary = structural_summary(form, max_chars=max_chars)
        assert len(summary) <= max_chars
        assert structural_summary(copy.deepcopy(form), max_chars=max_chars) == summary


def test_json_summary_lists_keys_types_sizes_counts_and_first_items() -> None:
    """A JSON object's summary names each key with its type and encoded size, counts array
    items and their types, and shows the first item."""
    doc = {
        "customer": {"id": "c-7", "tier": "gold", "since": 2019},
        "tickets": [{"id": f"T-{i}", "open": i % 2 == 0} for i in range(120)],
        "note": "n" * 500,
        "score": 0.25,
        "archived": None,
    }
    summary = structural_summary(doc, max_chars=2000)
    lines = summary.splitlines()
    size = len(json.dumps(doc, separators=(",", ":")))
    assert lines[0] == f"JSON object: 5 keys, {size:,} bytes"
    assert lines[1].startswith("- customer: object(3 keys, ")
    assert 'id: string(3) "c-7"' in lines[1]
    assert lines[2].startswith("- tickets: array(120 items of object, ")
    assert 'first: object(2 keys, 24 bytes) {id: string(3) "T-0", open: true}' in lines[2]
    assert lines[3].startswith('- note: string(500) "nnnn')
    assert lines[3].endswith("…")
    assert lines[4:] == ["- score: number 0.25", "- archived: null"]


def test_json_array_summary_and_truncation_say_what_was_left_out() -> None:
    """A big array shows its first items and how many more there are, within the bound."""
    rows = [{"id": i, "name": f"row {i}"} for i in range(10_000)]
    summary = structural_summary(rows, max_chars=400)
    assert len(summary) <= 400
    assert summary.startswith("JSON array: 10,000 items of object, ")
    assert "\n- [0] object(2 keys" in summary
    assert summary.endswith("more")
    shown = summary.count("\n- [")
    assert f"… {10_000 - shown:,} items more" in summary


def test_text_summary_has_length_lines_head_and_tail() -> None:
    """Text gets its size and line count, then the beginning and the end of it."""
    text = "\n".join(f"log line {i:04d}: ok" for i in range(2000))
    summary = structural_summary(text, max_chars=500)
    assert len(summary) <= 500
    assert summary.startswith(f"text: {len(text):,} chars, 2,000 lines\nhead:\nlog line 0000: ok")
    assert "\n…\ntail:\n" in summary
    assert summary.endswith("log line 1999: ok")
    short = structural_summary("just this", max_chars=500)
    assert short == "text: 9 chars, 1 line\njust this"


def test_binary_summary() -> None:
    """Bytes that are not UTF-8 are described by size and their first bytes."""
    data = b"\x89PNG\r\n\x1a\n" + bytes(1000)
    assert structural_summary(data, max_chars=200) == (
        "binary: 1,008 bytes; starts with: 89 50 4e 47 0d 0a 1a 0a 00 00 00 00 00 00 00 00 …"
    )


def test_max_chars_is_validated() -> None:
    """A bound below 1 is a configuration error, not an empty summary."""
    with pytest.raises(ConfigurationError):
        structural_summary("x", max_chars=0)


# --- compress_observation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "summary", "media_type"),
    [
        ("ticket T-1 created", "ticket T-1 created", "text/plain; charset=utf-8"),
        ({"id": "T-1", "ok": True}, '{"id":"T-1","ok":true}', "application/json"),
        ('{"id": "T-1"}', '{"id": "T-1"}', "application/json"),
        (b"plain bytes", "plain bytes", "application/octet-stream"),
        ([1, 2, 3], "[1,2,3]", "application/json"),
    ],
)
def test_small_content_passes_through(content: Any, summary: str, media_type: str) -> None:
    """Results up to the threshold are kept whole in state: no artifact, nothing to store."""
    done = compress_observation(content, threshold_bytes=4096)
    assert not done.needs_artifact
    assert done.payload is None
    assert done.observation == {
        "summary": summary,
        "artifact_id": None,
        "size": len(summary.encode()),
        "media_type": media_type,
    }


def test_large_content_becomes_summary_plus_artifact_id() -> None:
    """Above the threshold the observation holds a bounded summary and the content hash of
    the raw bytes, which the caller must store; the same content always gives the same
    observation (so a re-run node writes the same state)."""
    content = {"rows": [{"id": i, "text": "lorem ipsum " * 5} for i in range(500)]}
    done = compress_observation(content, threshold_bytes=1024, max_chars=300)
    assert done.needs_artifact
    assert done.payload is not None
    raw = json.dumps(content, separators=(",", ":")).encode()
    assert done.payload == raw
    obs = done.observation
    assert obs["artifact_id"] == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert obs["size"] == len(raw)
    assert obs["media_type"] == "application/json"
    assert len(obs["summary"]) <= 300
    assert obs["summary"].startswith("JSON object: 1 key, ")
    assert compress_observation(copy.deepcopy(content), threshold_bytes=1024, max_chars=300) == done


def test_binary_content_always_goes_to_the_artifact_store() -> None:
    """State holds text: bytes that are not UTF-8 are stored as an artifact at any size."""
    done = compress_observation(b"\xff\x00", threshold_bytes=4096)
    assert done.needs_artifact
    assert done.observation["summary"].startswith("binary: 2 bytes")


def test_pluggable_summarizer_is_used_and_bounded() -> None:
    """A custom summarizer receives the content as returned; its output is cut to the bound,
    and output that is not text is refused."""
    seen: list[Any] = []

    def model_like(payload: Any, /, *, max_chars: int) -> str:
        seen.append(payload)
        return "the model says: " + "blah " * 1000

    content = {"big": "x" * 5000}
    done = compress_observation(content, threshold_bytes=100, summarizer=model_like, max_chars=50)
    assert seen == [content]
    assert len(done.observation["summary"]) == 50
    assert done.observation["summary"].startswith("the model says: ")

    with pytest.raises(ConfigurationError, match="must return str"):
        compress_observation(content, threshold_bytes=100, summarizer=lambda p, **k: 42)  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize("threshold", [-1, 1.5, True])
def test_threshold_is_validated(threshold: Any) -> None:
    """A threshold must be a non-negative int."""
    with pytest.raises(ConfigurationError):
        compress_observation("x", threshold_bytes=threshold)


def test_observation_survives_langgraph_serde() -> None:
    """The observation is plain JSON data, so LangGraph's checkpoint serializer stores and
    restores it unchanged (it can live in graph state)."""
    done = compress_observation({"rows": list(range(5000))}, threshold_bytes=100)
    serde = JsonPlusSerializer()
    assert serde.loads_typed(serde.dumps_typed(done.observation)) == done.observation


def test_compressed_observation_stores_under_its_own_id(cp: RecoveryCheckpointer) -> None:
    """The id computed without I/O is the id the store returns, and the raw payload comes
    back from it: the caller-stores contract holds on every backend."""
    done = compress_observation("line\n" * 10_000, threshold_bytes=1024)
    assert done.payload is not None
    ref = cp.put_artifact("t-obs", done.payload, media_type=done.observation["media_type"])
    assert ref.id == done.observation["artifact_id"]
    assert cp.artifact(ref.id).decode() == "line\n" * 10_000


# --- compact_events (pure) --------------------------------------------------------------------


def test_compaction_keeps_last_n_and_reduces_older_ones() -> None:
    """Per thread, all but the last N events are reduced to ledger fields, key parameters
    and a marker; the last N are not touched; other threads are counted on their own."""
    events = [_event(i, EventKind.TOOL_SUCCEEDED, _tool_payload(i)) for i in range(1, 11)]
    events += [_event(i, EventKind.TOOL_FAILED, _tool_payload(i), "u") for i in range(1, 3)]
    plan = compact_events(events, keep_last=3)
    assert [(c.thread_id, c.seq) for c in plan] == [("t", i) for i in range(1, 8)]
    first = plan[0]
    assert first.kind is EventKind.TOOL_SUCCEEDED
    assert dict(first.payload) == {
        "tool": "create_ticket",
        "key": "create_ticket:1",
        "tool_call_id": "call-1",
        "status": "committed",
        "proof": {"ticket_id": "T-1"},
        "attempt": 1,
        "failure": {"kind": "transient", "error_type": "TimeoutError"},
        COMPACTED_KEY: {"bytes": first.bytes_before, "dropped": ["args", "failure", "result"]},
    }
    assert len(first.encoded.encode()) < first.bytes_before
    assert json.loads(first.encoded) == first.payload


@settings(max_examples=100, deadline=None)
@given(
    batch=st.lists(st.tuples(st.sampled_from(list(EventKind)), payloads), max_size=8),
    keep_last=st.integers(min_value=0, max_value=5),
    key_fields=st.lists(st.sampled_from(["args", "result.x", "x", "failure.kind"]), max_size=3),
)
def test_compaction_never_drops_ledger_fields(
    batch: list[tuple[EventKind, dict[str, Any]]], keep_last: int, key_fields: list[str]
) -> None:
    """Whatever the payloads and the configured key fields (even none): every ledger field
    (key, status, proof, tool, tool_call_id) keeps its exact value, protected kinds and the
    last N are never planned, every rewrite shrinks, and a second pass finds nothing."""
    events = [_event(i + 1, kind, payload) for i, (kind, payload) in enumerate(batch)]
    plan = compact_events(events, keep_last=keep_last, key_fields=key_fields)
    by_seq = {e.seq: e for e in events}
    for change in plan:
        original = by_seq[change.seq]
        assert change.seq <= len(events) - keep_last
        assert original.kind not in DEFAULT_PROTECTED_KINDS
        for name in LEDGER_FIELDS & set(original.payload):
            assert change.payload[name] == original.payload[name]
        assert len(change.encoded.encode()) < change.bytes_before
    rewritten = {c.seq: c.payload for c in plan}
    after = [_event(e.seq, e.kind, rewritten.get(e.seq, e.payload)) for e in events]
    assert compact_events(after, keep_last=keep_last, key_fields=key_fields) == []


def test_protected_kinds_and_small_payloads_are_left_alone() -> None:
    """Reconciliations, decisions and other protected kinds keep their whole payload, and a
    payload that the marker would make bigger is not rewritten."""
    bulky = {"key": "k", "proof": {"refund_id": "R-1"}, "result": "r" * 1000}
    events = [
        _event(1, EventKind.EFFECT_RECONCILED, bulky),
        _event(2, EventKind.DECISION_RECORDED, {"decision": {"action": "abandon"}, "x": "y" * 500}),
        _event(3, EventKind.TOOL_INVOKED, {"tool": "t", "args": {}}),
        _event(4, EventKind.TOOL_SUCCEEDED, bulky),
    ]
    plan = compact_events(events, keep_last=0)
    assert [c.seq for c in plan] == [4]
    custom = compact_events(events, keep_last=0, protected_kinds=[])
    assert [c.seq for c in custom] == [1, 2, 4]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": -1},
        {"keep_last": 1.5},
        {"keep_last": 1, "key_fields": "args"},
        {"keep_last": 1, "key_fields": ["a..b"]},
        {"keep_last": 1, "key_fields": [1, "a"]},
        {"keep_last": 1, "protected_kinds": ["no_such_kind"]},
    ],
)
def test_compaction_settings_are_validated(kwargs: dict[str, Any]) -> None:
    """Bad settings raise ``ConfigurationError`` instead of compacting the wrong thing."""
    with pytest.raises(ConfigurationError):
        compact_events([], **kwargs)


# --- store compaction -------------------------------------------------------------------------

EVENTS = 12
KEEP = 4


def _fill(cp: RecoveryCheckpointer, thread_id: str) -> list[Event]:
    kinds = [EventKind.TOOL_INVOKED, EventKind.TOOL_SUCCEEDED, EventKind.EFFECT_RECONCILED]
    for i in range(EVENTS):
        cp.append_event(thread_id, kinds[i % 3], _tool_payload(i))
    return cp.events(thread_id)


def _check_compacted(before: list[Event], after: list[Event]) -> None:
    assert [(e.seq, e.kind, e.ts, e.checkpoint_id) for e in after] == [
        (e.seq, e.kind, e.ts, e.checkpoint_id) for e in before
    ]
    for old, new in zip(before, after, strict=True):
        if old.seq > EVENTS - KEEP or old.kind in DEFAULT_PROTECTED_KINDS:
            assert new.payload == old.payload
        else:
            assert COMPACTED_KEY in new.payload
            assert {k: new.payload[k] for k in LEDGER_FIELDS} == {
                k: old.payload[k] for k in LEDGER_FIELDS
            }
            assert "args" not in new.payload
            assert "result" not in new.payload


def test_store_compaction_keeps_seq_and_kind_and_shrinks_old_payloads(
    cp: RecoveryCheckpointer, conn_string: str
) -> None:
    """``compact_events`` rewrites old payloads in place: the log keeps its order, numbering,
    kinds and times, the last N and the protected events are unchanged, the old ones take
    fewer bytes in the database, a second pass is a no-op, and appending continues the
    numbering without a gap."""
    before = _fill(cp, "t-compact")
    sizes = _stored_sizes(conn_string, "t-compact")

    expected = len(compact_events(before, keep_last=KEEP))
    assert expected > 0
    assert cp.compact_events("t-compact", keep_last=KEEP) == expected
    after = cp.events("t-compact")
    _check_compacted(before, after)

    new_sizes = _stored_sizes(conn_string, "t-compact")
    for event in before:
        if COMPACTED_KEY in after[event.seq - 1].payload:
            assert new_sizes[event.seq] < sizes[event.seq] / 2
        else:
            assert new_sizes[event.seq] == sizes[event.seq]

    assert cp.compact_events("t-compact", keep_last=KEEP) == 0
    assert cp.append_event("t-compact", "agent_finished").seq == EVENTS + 1
    assert cp.compact_events("t-missing", keep_last=0) == 0


def test_store_compaction_on_memory_backend() -> None:
    """The in-memory backend applies the same plan."""
    with RecoveryCheckpointer.from_conn_string(":memory:") as cp:
        before = _fill(cp, "t")
        assert cp.compact_events("t", keep_last=KEEP) > 0
        _check_compacted(before, cp.events("t"))


async def test_async_store_compaction(conn_string: str) -> None:
    """``acompact_events`` rewrites the same events as the sync form."""
    with RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        cp.setup()
        before = _fill(cp, "t-async")
    async with AsyncRecoveryCheckpointer.from_conn_string(conn_string) as acp:
        expected = len(compact_events(before, keep_last=KEEP))
        assert await acp.acompact_events("t-async", keep_last=KEEP) == expected
        _check_compacted(before, await acp.aevents("t-async"))
        assert await acp.acompact_events("t-async", keep_last=KEEP) == 0


def test_store_compaction_refuses_corrupt_rows(cp: RecoveryCheckpointer, conn_string: str) -> None:
    """A corrupt event makes compaction raise before anything is rewritten."""
    before = _fill(cp, "t-corrupt")
    kind = "'not_a_kind'"
    _raw_sql(
        conn_string,
        f"UPDATE taskpilots_events SET kind = {kind} WHERE thread_id = ? AND seq = ?",
        ("t-corrupt", EVENTS),
    )
    with pytest.raises(CorruptRecordError):
        cp.compact_events("t-corrupt", keep_last=0)
    _raw_sql(
        conn_string,
        "UPDATE taskpilots_events SET kind = ? WHERE thread_id = ? AND seq = ?",
        (before[-1].kind.value, "t-corrupt", EVENTS),
    )
    assert cp.events("t-corrupt") == before
