"""Bad input and storage faults, on real SQLite files and a real PostgreSQL (issue 22).

Each case asserts the error type and that nothing recorded was lost: scheme typos create no
file; a read-only file opens for inspection; bad paths are refused before anything is
touched; a lock held past the busy timeout during a ledger commit is ``StorageBusy`` and the
same write succeeds later; odd thread ids are refused before any write (no orphan
checkpoint); the CLI prints one line for a malformed URL; one corrupt event row does not fail
``threads`` and ``metrics`` for the whole store.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from langgraph.graph import START, MessagesState, StateGraph
from test_cli import assert_one_line_error, fill, invoke

import taskpilots_graph as tp
from taskpilots_graph._thread_index import thread_ids
from taskpilots_graph.checkpointers._conn_string import parse_conn_string
from taskpilots_graph.errors import (
    ConfigurationError,
    CorruptRecordError,
    StorageBusy,
)
from taskpilots_graph.events import MAX_THREAD_ID_BYTES, prepare_event
from taskpilots_graph.ledger import LedgerEntry, LedgerStatus

TYPOS = [
    "postgresql:/postgres@127.0.0.1/db",
    "postgres:/postgres@127.0.0.1/db",
    "sqlite:/runs.db",
    "sqlite:runs.db",
    "postgresql:postgres@127.0.0.1/db",
]


def _entry(thread_id: str, key: str = "k-1") -> LedgerEntry:
    now = datetime.now(UTC)
    return LedgerEntry(
        key=key,
        thread_id=thread_id,
        tool="ship",
        status=LedgerStatus.INTENDED,
        args={"ref": "A"},
        args_digest="d" * 64,
        attempt=1,
        created_at=now,
        updated_at=now,
    )


def _recorded(cp: Any, thread_id: str) -> tuple[list[Any], list[Any]]:
    """What is recorded for the thread: its events (kind, payload) and ledger keys."""
    events = [(e.kind.value, dict(e.payload)) for e in cp.events(thread_id)]
    return events, [(e.key, e.status.value) for e in cp.ledger(thread_id)]


def _echo_graph(cp: Any) -> Any:
    builder = StateGraph(MessagesState)
    builder.add_node("echo", lambda state: {"messages": []})
    builder.add_edge(START, "echo")
    return builder.compile(checkpointer=cp)


# --- scheme typos -----------------------------------------------------------------------------


@pytest.mark.parametrize("typo", TYPOS)
def test_scheme_typo_is_refused_and_creates_no_file(
    typo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match="://"):
        parse_conn_string(typo)
    with pytest.raises(ConfigurationError), tp.RecoveryCheckpointer.from_conn_string(typo):
        pass

    async def open_async() -> None:
        async with tp.AsyncRecoveryCheckpointer.from_conn_string(typo):
            pass

    with pytest.raises(ConfigurationError):
        asyncio.run(open_async())
    assert_one_line_error(invoke("threads", "--db", typo), "://")
    assert list(tmp_path.iterdir()) == []  # no file, no folder named like the URL


def test_plain_paths_stay_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_conn_string("runs.db").address == "runs.db"
    assert parse_conn_string("sub/dir:x/runs.db").address == "sub/dir:x/runs.db"
    assert parse_conn_string("./a:b.db").address == "./a:b.db"
    with tp.RecoveryCheckpointer.from_conn_string("./a:b.db") as cp:
        cp.append_event("t", "agent_started", {})
        assert len(cp.events("t")) == 1


# --- read-only file ---------------------------------------------------------------------------

_READ_ONLY_PROBE = textwrap.dedent(
    """
    import asyncio, json, sys
    import taskpilots_graph as tp
    from taskpilots_graph.errors import StorageReadOnly

    url = sys.argv[1]
    out = {}
    with tp.RecoveryCheckpointer.from_conn_string(url) as cp:
        cp.setup()
        out["events"] = [e.kind.value for e in cp.events("t")]
        out["ledger"] = [e.key for e in cp.ledger()]
        out["threads"] = [i.thread_id for i in tp.list_threads(cp, thread_ids=["t"])]
        for name, write in [
            ("append_event", lambda: cp.append_event("t", "agent_started", {})),
            ("put_artifact", lambda: cp.put_artifact("t", b"x")),
        ]:
            try:
                write()
                out[name] = "written"
            except StorageReadOnly as exc:
                out[name] = [type(exc).__name__, exc.backend, exc.operation]

    async def main():
        async with tp.AsyncRecoveryCheckpointer.from_conn_string(url) as acp:
            await acp.setup()
            out["async_events"] = len(await acp.aevents("t"))
            try:
                await acp.aappend_event("t", "agent_started", {})
                out["async_append"] = "written"
            except StorageReadOnly as exc:
                out["async_append"] = type(exc).__name__

    asyncio.run(main())
    print(json.dumps(out))
    """
)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder another user may enter (pytest's own tmp folders are private to root)."""
    path = Path(tempfile.mkdtemp(prefix="tp-ro-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_read_only_file_opens_for_inspection(shared_dir: Path) -> None:
    """Reads work, writes raise StorageReadOnly, and nothing recorded changes."""
    path = shared_dir / "runs.db"
    with tp.RecoveryCheckpointer.from_conn_string(str(path)) as cp:
        cp.setup()
        cp.append_event("t", "agent_started", {"goal": "ship"})
        cp.write_ledger(_entry("t"), expect=None)
        before = _recorded(cp, "t")
    path.chmod(0o444)
    command = [sys.executable, "-c", _READ_ONLY_PROBE, f"sqlite:///{path}"]
    if os.geteuid() == 0:
        # Root writes anyway, so the probe gives up the capabilities that override file
        # modes. It stays root otherwise: another user could not enter a private checkout
        # (mode 0700) to load the virtualenv.
        caps = "-dac_override,-dac_read_search"
        command = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["events"] == ["agent_started"]
    assert out["ledger"] == ["k-1"]
    assert out["threads"] == ["t"]
    assert out["append_event"] == ["StorageReadOnly", "sqlite", "append_events"]
    assert out["put_artifact"] == ["StorageReadOnly", "sqlite", "put_artifact"]
    assert out["async_events"] == 1
    assert out["async_append"] == "StorageReadOnly"
    path.chmod(0o644)
    with tp.RecoveryCheckpointer.from_conn_string(str(path)) as cp:
        assert _recorded(cp, "t") == before


# --- bad paths --------------------------------------------------------------------------------


def _bad_path(tmp_path: Path, kind: str) -> tuple[str, bytes | None]:
    if kind == "directory":
        (tmp_path / "runs").mkdir()
        return str(tmp_path / "runs"), None
    junk = tmp_path / "notes.txt"
    content = b"not a database " * 100
    junk.write_bytes(content)
    if kind == "parent is a file":
        return str(junk / "runs.db"), content
    return str(junk), content


@pytest.mark.parametrize("kind", ["directory", "parent is a file", "not sqlite"])
def test_bad_sqlite_paths_are_typed(tmp_path: Path, kind: str) -> None:
    path, content = _bad_path(tmp_path, kind)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigurationError), tp.RecoveryCheckpointer.from_conn_string(path):
        pass

    async def open_async() -> None:
        async with tp.AsyncRecoveryCheckpointer.from_conn_string(f"sqlite:///{path}"):
            pass

    with pytest.raises(ConfigurationError):
        asyncio.run(open_async())
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    if content is not None:
        assert (tmp_path / "notes.txt").read_bytes() == content  # untouched


# --- locked past the busy timeout -------------------------------------------------------------


def test_locked_past_the_busy_timeout_during_a_ledger_commit(tmp_path: Path) -> None:
    """StorageBusy, nothing half-written, deferred records kept; the retry succeeds."""
    path = str(tmp_path / "runs.db")
    with tp.RecoveryCheckpointer.from_conn_string(path) as cp:
        cp.setup()
        cp.append_event("t", "agent_started", {"goal": "ship"})
        cp.write_ledger(_entry("t", "k-0"), expect=None)
        before = _recorded(cp, "t")
        cp.inner.conn.execute("PRAGMA busy_timeout = 200")  # the file's wait, shortened
        waiting = prepare_event(
            "t", "tool_invoked", {"tool": "ship"}, checkpoint_id=None, checkpoint_ns=""
        )
        cp.defer_records([waiting])
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            with pytest.raises(StorageBusy) as caught:
                cp.write_ledger(_entry("t", "k-1"), expect=None)
            assert (caught.value.backend, caught.value.operation) == ("sqlite", "ledger_write")
            assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        finally:
            other.execute("ROLLBACK")
            other.close()
        events, keys = _recorded(cp, "t")  # nothing half-written, nothing lost
        assert keys == before[1]
        assert events == [*before[0], ("tool_invoked", {"tool": "ship"})]  # deferred kept
        cp.write_ledger(_entry("t", "k-1"), expect=None)  # the same write, later: fine
        assert _recorded(cp, "t") == (events, [*keys, ("k-1", "intended")])


async def test_locked_past_the_busy_timeout_async(tmp_path: Path) -> None:
    path = str(tmp_path / "runs.db")
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(path) as cp:
        await cp.setup()
        await cp.awrite_ledger(_entry("t", "k-0"), expect=None)
        await cp.inner.conn.execute("PRAGMA busy_timeout = 200")
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(StorageBusy):
                await cp.awrite_ledger(_entry("t", "k-1"), expect=None)
        finally:
            other.execute("ROLLBACK")
            other.close()
        await cp.awrite_ledger(_entry("t", "k-1"), expect=None)
        assert [e.key for e in await cp.aledger("t")] == ["k-0", "k-1"]


# --- odd thread ids ---------------------------------------------------------------------------

ODD_IDS = {
    "nul": "t\x00x",
    "lone surrogate": "t\ud800x",
    "10 KB": "x" * 10_240,
    "empty": "",
}


@pytest.mark.parametrize("name", list(ODD_IDS))
def test_odd_thread_ids_are_refused_before_any_write(cp: Any, name: str) -> None:
    bad = ODD_IDS[name]
    cp.append_event("good", "agent_started", {})
    before = _recorded(cp, "good")
    graph = _echo_graph(cp)
    attempts = [
        lambda: graph.invoke({"messages": []}, {"configurable": {"thread_id": bad}}),
        lambda: tp.run(graph, bad, {"messages": []}),
        lambda: cp.append_event(bad, "agent_started", {}),
        lambda: cp.write_ledger(_entry(bad), expect=None),
        lambda: cp.record_decision(bad, "", "digest", "{}"),
        lambda: cp.put_artifact(bad, b"x"),
    ]
    for attempt in attempts:
        with pytest.raises(ConfigurationError, match="thread_id"):
            attempt()
    assert thread_ids(cp) == []  # no orphan checkpoint
    assert cp.ledger() == []
    assert _recorded(cp, "good") == before


def test_longest_thread_id_is_stored(cp: Any) -> None:
    """The limit is one every backend can index: an id of exactly the limit works."""
    longest = "x" * MAX_THREAD_ID_BYTES
    _echo_graph(cp).invoke({"messages": []}, {"configurable": {"thread_id": longest}})
    cp.append_event(longest, "agent_started", {})
    cp.write_ledger(_entry(longest), expect=None)
    assert thread_ids(cp) == [longest]
    assert [e.thread_id for e in cp.ledger()] == [longest]
    with pytest.raises(ConfigurationError, match="bytes"):
        cp.append_event(longest + "x", "agent_started", {})


# --- the CLI line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("postgresql://postgres@[::1/db", ["malformed PostgreSQL URL"]),
        ("postgresql://u:secret@127.0.0.1:9,127.0.0.1:9/none", ["cannot reach", "***"]),
    ],
)
def test_malformed_postgres_url_is_one_cli_line(url: str, words: list[str]) -> None:
    for command in ("threads", "metrics"):
        result = invoke(command, "--db", url)
        assert_one_line_error(result, *words)
        assert "secret" not in result.stderr


# --- one corrupt event row --------------------------------------------------------------------


def _corrupt_one_event(conn_string: str, thread_id: str) -> str:
    """Give the thread's second event an unknown kind; its key (``thread#seq``)."""
    target = parse_conn_string(conn_string)
    if target.backend == "postgres":
        with psycopg.connect(conn_string, autocommit=True) as conn:
            conn.execute(
                "UPDATE taskpilots_events SET kind = 'no_such_kind' "
                "WHERE thread_id = %s AND seq = 2",
                (thread_id,),
            )
    else:
        with sqlite3.connect(target.address) as conn:
            conn.execute(
                "UPDATE taskpilots_events SET kind = 'no_such_kind' "
                "WHERE thread_id = ? AND seq = 2",
                (thread_id,),
            )
        conn.close()
    return f"{thread_id}#2"


def test_a_corrupt_event_row_is_skipped_and_reported_in_listings(conn_string: str) -> None:
    store = fill(conn_string)
    with tp.RecoveryCheckpointer.from_conn_string(store) as cp:
        counts = {t: len(cp.events(t)) for t in ("ok", "t")}
        ledger = cp.ledger()
    key = _corrupt_one_event(store, "ok")
    with tp.RecoveryCheckpointer.from_conn_string(store) as cp:
        infos = {i.thread_id: i for i in tp.list_threads(cp)}
        assert set(infos) == {"ok", "t"}
        assert infos["ok"].corrupt_events == (key,)
        assert infos["ok"].events == counts["ok"] - 1  # only the bad row is left out
        assert infos["t"].corrupt_events == ()
        assert infos["t"].events == counts["t"]
        assert infos["t"].status == "awaiting_human"
        metrics = tp.recovery_metrics(cp)
        assert metrics.corrupt_events == (key,)
        assert metrics.runs.total == 2
        assert metrics.as_dict()["corrupt_events"] == [key]
        with pytest.raises(CorruptRecordError):  # everywhere else a corrupt row is refused
            cp.events("ok")
        with pytest.raises(CorruptRecordError):
            tp.thread_info(cp, "ok")
        assert cp.ledger() == ledger  # nothing recorded was lost
        assert len(cp.events("t")) == counts["t"]

    threads = invoke("threads", "--db", store, "--json")
    assert threads.exit_code == 0, threads.output
    rows = {row["thread_id"]: row for row in json.loads(threads.stdout)}
    assert rows["ok"]["corrupt_events"] == [key]
    assert threads.stderr.strip().startswith("warning: skipped 1 corrupt event row")
    assert key in threads.stderr
    table = invoke("threads", "--db", store)
    assert table.exit_code == 0
    assert "2 thread(s)" in table.stdout
    metrics_out = invoke("metrics", "--db", store, "--json")
    assert metrics_out.exit_code == 0, metrics_out.output
    assert json.loads(metrics_out.stdout)["corrupt_events"] == [key]
    assert key in metrics_out.stderr


async def test_a_corrupt_event_row_async_listing(tmp_path: Path) -> None:
    path = str(tmp_path / "runs.db")
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(path) as cp:
        for thread in ("a", "b"):
            for i in range(3):
                await cp.aappend_event(thread, "agent_started", {"i": i})
    key = _corrupt_one_event(path, "a")
    async with tp.AsyncRecoveryCheckpointer.from_conn_string(path) as cp:
        infos = await tp.alist_threads(cp, thread_ids=["a", "b"])
        assert [(i.thread_id, i.events, i.corrupt_events) for i in infos] == [
            ("a", 2, (key,)),
            ("b", 3, ()),
        ]
        metrics = await tp.arecovery_metrics(cp, thread_ids=["a", "b"])
        assert metrics.corrupt_events == (key,)
