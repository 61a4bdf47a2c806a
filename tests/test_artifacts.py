"""The artifact store: raw tool outputs kept by content hash beside the checkpoints.

Runs against real SQLite files and a real PostgreSQL database (the ``cp`` / ``conn_string``
fixtures), plus the in-memory backend and the folder store where the case is backend-neutral.
What recovery relies on: a payload comes back byte-for-byte (10 MB included) from a fresh
connection, one thread stores one copy of a payload, an unknown id and a damaged payload are
two different typed errors (damage is never "not found"), and ``delete_thread`` takes the
thread's artifacts, and only its own, with it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sqlite3
import sys
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg
import pytest

import taskpilots_graph as tp
from taskpilots_graph import AsyncRecoveryCheckpointer, ConfigurationError, RecoveryCheckpointer
from taskpilots_graph.checkpointers import ArtifactRef, FileArtifactStore, FsspecArtifactStore
from taskpilots_graph.checkpointers._migrations import SCHEMA_VERSION
from taskpilots_graph.errors import ArtifactNotFound, CorruptRecordError

TEN_MB = 10 * 1024 * 1024
UNKNOWN_ID = "sha256:" + "0" * 64


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _is_postgres(conn_string: str) -> bool:
    return conn_string.startswith(("postgresql://", "postgres://"))


def _raw_sql(conn_string: str, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Run one statement outside the library (``?`` placeholders) and commit it."""
    if _is_postgres(conn_string):
        with psycopg.connect(conn_string, autocommit=True) as pg:
            cur = pg.execute(statement.replace("?", "%s"), params)
            return cur.fetchall() if cur.description else []
    with closing(sqlite3.connect(conn_string.removeprefix("sqlite:///"))) as lite, lite:
        return lite.execute(statement, params).fetchall()


def _rows(conn_string: str, thread_id: str) -> int:
    sql = "SELECT COUNT(*) FROM taskpilots_artifacts WHERE thread_id = ?"
    return int(_raw_sql(conn_string, sql, (thread_id,))[0][0])


# --- round trip -------------------------------------------------------------------------------


def test_ten_megabytes_round_trip_byte_for_byte(cp: RecoveryCheckpointer, conn_string: str) -> None:
    """A 10 MB payload holding every byte value comes back identical, also from a new
    connection (it was committed, not just cached), with its id equal to its SHA-256."""
    data = bytes(range(256)) * 4 + os.urandom(TEN_MB - 1024)
    ref = cp.put_artifact("t-big", data, media_type="application/x-tar")

    assert ref == ArtifactRef(id=_sha(data), size=TEN_MB, media_type="application/x-tar")
    assert cp.artifact(ref.id) == data
    with RecoveryCheckpointer.from_conn_string(conn_string) as fresh:
        assert fresh.artifact(ref.id) == data
    stored = _raw_sql(
        conn_string,
        "SELECT size, media_type FROM taskpilots_artifacts WHERE id = ?",
        (ref.id,),
    )
    assert stored == [(TEN_MB, "application/x-tar")]


def test_text_is_stored_as_utf8(cp: RecoveryCheckpointer) -> None:
    """``str`` data is stored as UTF-8 (its id is the hash of those bytes) and typed as text;
    bytes default to ``application/octet-stream``."""
    text = "résumé — 工单 🚀\n" * 10
    ref = cp.put_artifact("t-text", text)
    assert ref.media_type == "text/plain; charset=utf-8"
    assert ref.id == _sha(text.encode())
    assert ref.size == len(text.encode())
    assert cp.artifact(ref.id).decode() == text
    assert cp.put_artifact("t-text", b"\x00\xff").media_type == "application/octet-stream"


def test_same_payload_is_stored_once_per_thread(cp: RecoveryCheckpointer, conn_string: str) -> None:
    """Storing a payload the thread already holds stores nothing new and returns the same
    id (also when it comes as text the second time); another thread keeps a copy of its own,
    so deleting one thread never takes the other's artifact."""
    data = b'{"rows": [1, 2, 3]}' * 1000
    first = cp.put_artifact("t-a", data, media_type="application/json")
    again = cp.put_artifact("t-a", data.decode(), media_type="application/json")
    assert again == first
    assert _rows(conn_string, "t-a") == 1

    other = cp.put_artifact("t-b", bytearray(data), media_type="application/json")
    assert other.id == first.id
    assert _rows(conn_string, "t-b") == 1

    cp.delete_thread("t-a")
    assert _rows(conn_string, "t-a") == 0
    assert cp.artifact(first.id) == data  # t-b's copy


# --- errors -----------------------------------------------------------------------------------


def test_unknown_id_raises_artifact_not_found(cp: RecoveryCheckpointer) -> None:
    """A well-formed id that nothing is stored under raises the typed, picklable
    ``ArtifactNotFound`` (a ``LookupError``), carrying the id."""
    with pytest.raises(ArtifactNotFound) as raised:
        cp.artifact(UNKNOWN_ID)
    assert raised.value.artifact_id == UNKNOWN_ID
    assert isinstance(raised.value, LookupError)
    assert isinstance(raised.value, tp.TaskPilotsError)
    back = pickle.loads(pickle.dumps(raised.value))
    assert type(back) is ArtifactNotFound
    assert back.__dict__ == raised.value.__dict__
    assert str(back) == str(raised.value)


@pytest.mark.parametrize(
    "bad_id",
    ["", "abc", "sha256:" + "A" * 64, "sha256:" + "0" * 63, "md5:" + "0" * 64, "../etc/passwd"],
)
def test_malformed_id_is_refused(bad_id: str, tmp_path: Path) -> None:
    """An id that cannot be a content hash is a caller mistake (``ConfigurationError``),
    refused before any store is asked: no path is ever built from it."""
    with (
        RecoveryCheckpointer.from_conn_string(
            ":memory:", artifacts=FileArtifactStore(tmp_path)
        ) as cp,
        pytest.raises(ConfigurationError, match="not an artifact id"),
    ):
        cp.artifact(bad_id)


def test_tampered_payload_raises_corrupt_record(cp: RecoveryCheckpointer, conn_string: str) -> None:
    """A stored payload whose bytes no longer hash to its id raises ``CorruptRecordError``
    naming the table and the id: damaged data is never returned, nor reported missing."""
    ref = cp.put_artifact("t-tamper", b"refund 42.00 EUR to customer 7")
    _raw_sql(
        conn_string,
        "UPDATE taskpilots_artifacts SET payload = ? WHERE id = ?",
        (b"refund 4200.00 EUR to customer 7", ref.id),
    )
    with pytest.raises(CorruptRecordError) as raised:
        cp.artifact(ref.id)
    assert raised.value.table == "taskpilots_artifacts"
    assert raised.value.key == ref.id
    assert not isinstance(raised.value, ArtifactNotFound)


@pytest.mark.parametrize(
    ("thread_id", "data", "media_type"),
    [
        ("", b"x", None),
        ("t\x00", b"x", None),
        ("t", 42, None),
        ("t", {"a": 1}, None),
        ("t", "\ud800", None),
        ("t", b"x", ""),
        ("t", b"x", "text/plain\n"),
        ("t", b"x", "x" * 256),
    ],
)
def test_bad_input_is_refused_before_anything_is_stored(
    thread_id: str, data: Any, media_type: str | None
) -> None:
    """Empty thread ids, non-bytes data, lone surrogates and bad media types raise
    ``ConfigurationError`` up front."""
    with RecoveryCheckpointer.from_conn_string(":memory:") as cp:
        with pytest.raises(ConfigurationError):
            cp.put_artifact(thread_id, data, media_type=media_type)
        assert cp.store._artifacts == {}  # type: ignore[attr-defined]


# --- deletion ---------------------------------------------------------------------------------


def test_delete_thread_removes_its_artifacts(cp: RecoveryCheckpointer, conn_string: str) -> None:
    """``delete_thread`` removes the thread's artifacts with its events and ledger; other
    threads' artifacts stay."""
    mine = cp.put_artifact("t-del", b"mine" * 1000)
    shared = cp.put_artifact("t-del", b"shared")
    cp.put_artifact("t-keep", b"shared")
    theirs = cp.put_artifact("t-keep", b"theirs")
    cp.append_event("t-del", "tool_succeeded", {"tool": "search", "artifact_id": mine.id})

    cp.delete_thread("t-del")

    with pytest.raises(ArtifactNotFound):
        cp.artifact(mine.id)
    assert _rows(conn_string, "t-del") == 0
    assert cp.events("t-del") == []
    assert cp.artifact(shared.id) == b"shared"
    assert cp.artifact(theirs.id) == b"theirs"


def test_memory_backend_keeps_artifacts_per_thread() -> None:
    """The in-memory backend follows the same rules as the SQL ones."""
    with RecoveryCheckpointer.from_conn_string(":memory:") as cp:
        ref = cp.put_artifact("t-1", b"payload")
        assert cp.put_artifact("t-2", b"payload") == ref
        cp.delete_thread("t-1")
        assert cp.artifact(ref.id) == b"payload"
        cp.delete_thread("t-2")
        with pytest.raises(ArtifactNotFound):
            cp.artifact(ref.id)


# --- schema -----------------------------------------------------------------------------------


def test_existing_database_gains_the_artifact_table(conn_string: str) -> None:
    """A database set up before artifacts existed (schema 2) is migrated by ``setup()``."""
    assert SCHEMA_VERSION >= 3
    with RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        cp.setup()
    _raw_sql(conn_string, "DROP TABLE taskpilots_artifacts")
    _raw_sql(conn_string, "DELETE FROM taskpilots_migrations WHERE v >= 3")
    with RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        cp.setup()
        ref = cp.put_artifact("t-mig", b"after the upgrade")
        assert cp.artifact(ref.id) == b"after the upgrade"
    versions = _raw_sql(conn_string, "SELECT v FROM taskpilots_migrations ORDER BY v")
    assert [v for (v,) in versions] == list(range(1, SCHEMA_VERSION + 1))


# --- pluggable stores -------------------------------------------------------------------------


def test_file_store_round_trip_dedup_and_delete(tmp_path: Path, sqlite_path: str) -> None:
    """With ``artifacts=FileArtifactStore(path)`` payloads live in the folder, not in the
    database: byte-for-byte round trip, one file per thread and payload, a tampered file is
    corrupt, and ``delete_thread`` removes the thread's files and only those."""
    folder = tmp_path / "artifacts"
    conn_string = f"sqlite:///{sqlite_path}"
    data = os.urandom(1024 * 1024)
    with RecoveryCheckpointer.from_conn_string(
        conn_string, artifacts=FileArtifactStore(folder)
    ) as cp:
        cp.setup()
        ref = cp.put_artifact("t-1", data)
        assert cp.put_artifact("t-1", data) == ref
        cp.put_artifact("t-2", data)
        assert cp.artifact(ref.id) == data
        assert _rows(conn_string, "t-1") == 0  # nothing went to the database
        copies = sorted((folder / "objects").rglob("*"))
        assert len([p for p in copies if p.is_file()]) == 2  # one per thread
        assert not list(folder.rglob(".tmp-*"))

        cp.delete_thread("t-1")
        assert cp.artifact(ref.id) == data  # t-2's copy
        cp.delete_thread("t-2")
        with pytest.raises(ArtifactNotFound):
            cp.artifact(ref.id)
        assert not [p for p in (folder / "objects").rglob("*") if p.is_file()]

        other = cp.put_artifact("t-3", b"original")
        (only,) = [p for p in (folder / "objects").rglob("*") if p.is_file()]
        only.write_bytes(b"tampered")
        with pytest.raises(CorruptRecordError) as raised:
            cp.artifact(other.id)
        assert raised.value.table == str(folder)

    # A second process (here: checkpointer) on the same folder sees the same artifacts.
    with RecoveryCheckpointer.from_conn_string(
        ":memory:", artifacts=FileArtifactStore(folder)
    ) as cp2:
        ref2 = cp2.put_artifact("t-4", b"shared folder")
    with RecoveryCheckpointer.from_conn_string(
        ":memory:", artifacts=FileArtifactStore(folder)
    ) as cp3:
        assert cp3.artifact(ref2.id) == b"shared folder"


def test_artifacts_argument_is_checked() -> None:
    """Passing a path instead of a store is a clear configuration error."""
    with (
        pytest.raises(ConfigurationError, match="FileArtifactStore"),
        RecoveryCheckpointer.from_conn_string(":memory:", artifacts="/tmp/x"),  # type: ignore[arg-type]
    ):
        pass


def test_fsspec_store_without_fsspec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the optional fsspec package the fsspec store says what to install."""
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ConfigurationError, match="pip install fsspec"):
        FsspecArtifactStore("memory://artifacts")


def test_fsspec_store_round_trip_and_delete() -> None:
    """Under an fsspec URL (its in-memory filesystem) the same rules hold."""
    fsspec = pytest.importorskip("fsspec")
    root = f"memory://tp-{os.getpid()}-{id(fsspec)}"
    with RecoveryCheckpointer.from_conn_string(
        ":memory:", artifacts=FsspecArtifactStore(root)
    ) as cp:
        data = os.urandom(200_000)
        ref = cp.put_artifact("t-1", data)
        assert cp.put_artifact("t-1", data) == ref
        cp.put_artifact("t-2", data)
        assert cp.artifact(ref.id) == data
        cp.delete_thread("t-1")
        assert cp.artifact(ref.id) == data
        cp.delete_thread("t-2")
        with pytest.raises(ArtifactNotFound):
            cp.artifact(ref.id)


# --- async ------------------------------------------------------------------------------------


async def test_async_api(conn_string: str) -> None:
    """``aput_artifact`` / ``aartifact`` / ``adelete_thread`` behave like the sync forms
    and share the same table (an artifact written by one face is read by the other)."""
    data = os.urandom(TEN_MB)
    async with AsyncRecoveryCheckpointer.from_conn_string(conn_string) as acp:
        await acp.setup()
        ref = await acp.aput_artifact("t-async", data, media_type="image/png")
        assert ref == ArtifactRef(_sha(data), TEN_MB, "image/png")
        assert await acp.aput_artifact("t-async", data, media_type="image/png") == ref
        assert await acp.aartifact(ref.id) == data
        assert _rows(conn_string, "t-async") == 1
        with pytest.raises(ArtifactNotFound):
            await acp.aartifact(UNKNOWN_ID)

    with RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        assert cp.artifact(ref.id) == data
        text_ref = cp.put_artifact("t-async", "written by the sync face")

    async with AsyncRecoveryCheckpointer.from_conn_string(conn_string) as acp:
        assert await acp.aartifact(text_ref.id) == b"written by the sync face"
        await acp.adelete_thread("t-async")
        with pytest.raises(ArtifactNotFound):
            await acp.aartifact(ref.id)
    assert _rows(conn_string, "t-async") == 0


async def test_async_api_with_file_store(tmp_path: Path) -> None:
    """A plugged-in (synchronous) store also serves the async API."""
    store = FileArtifactStore(tmp_path)
    async with AsyncRecoveryCheckpointer.from_conn_string(":memory:", artifacts=store) as acp:
        ref = await acp.aput_artifact("t-1", b"from a worker thread")
        assert await acp.aartifact(ref.id) == b"from a worker thread"
        await acp.adelete_thread("t-1")
        with pytest.raises(ArtifactNotFound):
            await acp.aartifact(ref.id)
