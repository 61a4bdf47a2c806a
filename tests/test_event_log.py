"""The event log of the recovery checkpointers, against real SQLite files and PostgreSQL.

Every test runs on both backends (the ``backend`` fixture yields a connection string of a
fresh database; thread-isolated cases share one database per module instead). The
guarantees under test are the ones recovery depends on: sequence numbers are gapless and
ordered even with concurrent writers in separate processes, an appended event survives a
SIGKILL of its writer, corrupt rows raise instead of reading as "no events", bad input is
refused before anything is written, and ``setup()`` is idempotent and safe to race.

The child-process side lives in ``_event_writer.py``: each concurrent writer, crash-drill
victim and setup racer is a separate process, forked from a multiprocessing forkserver that
imported the library once (see that module for why).
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import signal
import sqlite3
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import UTC
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypedDict

import _event_writer
import psycopg
import pytest
from _services import create_database, drop_database
from langgraph.graph import END, START, StateGraph

from taskpilots_graph import (
    AsyncRecoveryCheckpointer,
    ConfigurationError,
    Event,
    EventKind,
    RecoveryCheckpointer,
)
from taskpilots_graph.checkpointers._migrations import SCHEMA_VERSION
from taskpilots_graph.errors import CorruptRecordError
from taskpilots_graph.events import MAX_PAYLOAD_BYTES

WRITERS = 4
EVENTS_PER_WRITER = 50
CRASH_DRILLS = 3
CHILD_TIMEOUT_S = 60.0

# --- backends -----------------------------------------------------------------------------


def _conn_string(request: pytest.FixtureRequest, name: str, *, shared: bool = False) -> str:
    if name == "sqlite":
        path: str = request.getfixturevalue("shared_sqlite" if shared else "sqlite_path")
        return f"sqlite:///{path}"  # absolute path: sqlite:////tmp/.../runs.db
    url: str = request.getfixturevalue("shared_postgres" if shared else "postgres_url")
    return url


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Connection string of a fresh, empty database (a SQLite file or a PostgreSQL DB)."""
    return _conn_string(request, request.param)


# Tests that only touch thread ids of their own share one database per module: creating a
# PostgreSQL database costs ~0.4 s, and those tests are many small cases.
@pytest.fixture(scope="module")
def shared_sqlite(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite file shared by the module's thread-isolated tests."""
    return str(tmp_path_factory.mktemp("shared") / "runs.db")


@pytest.fixture(scope="module")
def shared_postgres(postgres_admin_url: str) -> Iterator[str]:
    """A PostgreSQL database shared by the module's thread-isolated tests."""
    name = f"shared_{uuid.uuid4().hex}"
    url = create_database(postgres_admin_url, name)
    yield url
    drop_database(postgres_admin_url, name)


@pytest.fixture(params=BACKENDS)
def shared_backend(request: pytest.FixtureRequest) -> str:
    """Connection string of the module's shared database; use a fresh thread id per test."""
    return _conn_string(request, request.param, shared=True)


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


def _migration_counts(conn_string: str) -> dict[int, int]:
    rows = _raw_sql(conn_string, "SELECT v, COUNT(*) FROM taskpilots_migrations GROUP BY v")
    return {int(v): int(n) for v, n in rows}


def _setup(conn_string: str) -> None:
    with RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        cp.setup()


def _summary(events: Sequence[Event]) -> list[tuple[int, str, dict[str, Any], str | None, str]]:
    """What must match across APIs: everything but the thread id and the timestamp."""
    return [
        (e.seq, e.kind.value, dict(e.payload), e.checkpoint_id, e.checkpoint_ns) for e in events
    ]


# --- child processes ----------------------------------------------------------------------


class ChildFailed(ChildProcessError):
    """A writer process failed, died or went silent (the message holds its traceback)."""


@dataclass
class Child:
    """One writer process and the test's end of its message pipe."""

    process: BaseProcess
    chan: Connection

    def receive(self, expected: str, timeout: float = CHILD_TIMEOUT_S) -> Any:
        """The value of the child's next message, which must be tagged ``expected``."""
        if not self.chan.poll(timeout):
            raise ChildFailed(f"{self.process.name} sent nothing for {timeout:.0f} s")
        try:
            tag, value = self.chan.recv()
        except EOFError:
            self.process.join(CHILD_TIMEOUT_S)
            raise ChildFailed(
                f"{self.process.name} died (exit code {self.process.exitcode}) before "
                f"sending {expected!r}"
            ) from None
        if tag == "error":
            raise ChildFailed(f"{self.process.name} failed:\n{value}")
        assert tag == expected, f"{self.process.name} sent {tag!r}, expected {expected!r}"
        return value

    def finish(self) -> Any:
        """The child's result, after checking that it exited cleanly."""
        value = self.receive("done")
        self.process.join(CHILD_TIMEOUT_S)
        if self.process.exitcode != 0:
            raise ChildFailed(f"{self.process.name} exited with {self.process.exitcode}")
        return value


# What the forkserver imports once. Not ``_event_writer`` itself: the server starts with the
# default sys.path, which lacks tests/ (its children get the test's sys.path and import that
# small module themselves, with everything below it already loaded).
_PRELOAD = ["taskpilots_graph", "langgraph.checkpoint.postgres", "psycopg_pool"]


def _forkserver() -> Any:
    # Takes effect when the server starts (at the first start()); later calls change nothing.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


@contextmanager
def _children(target: Callable[..., None], *calls: dict[str, Any]) -> Iterator[list[Child]]:
    """Start ``target(chan, **call)`` per call, each in its own process; none outlives the block."""
    context = _forkserver()
    children: list[Child] = []
    try:
        for n, kwargs in enumerate(calls):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=target, args=(theirs,), kwargs=kwargs, name=f"{target.__name__}-{n}"
            )
            process.start()
            theirs.close()  # so that a dead child reads as EOF, not as silence
            children.append(Child(process, ours))
        yield children
    finally:
        for child in children:
            if child.process.is_alive():
                child.process.kill()
            child.process.join(CHILD_TIMEOUT_S)
            child.process.close()
            child.chan.close()


def _release(children: Sequence[Child]) -> None:
    """Wait until every child is ready, then let them all go at the same instant."""
    for child in children:
        child.receive("ready")
    for child in children:
        child.chan.send("go")


def _run_writer_threads(conn_string: str, thread_id: str) -> list[list[int]]:
    """Four OS threads share one checkpointer (and its pool) and append to one thread."""
    start = threading.Barrier(WRITERS)
    returned: list[list[int]] = [[] for _ in range(WRITERS)]

    with RecoveryCheckpointer.from_conn_string(conn_string) as cp:

        def write(writer: int) -> None:
            start.wait(timeout=CHILD_TIMEOUT_S)
            for i in range(EVENTS_PER_WRITER):
                event = cp.append_event(thread_id, "step_completed", {"writer": writer, "i": i})
                returned[writer].append(event.seq)

        with ThreadPoolExecutor(WRITERS) as pool:
            for future in [pool.submit(write, w) for w in range(WRITERS)]:
                future.result()
    return returned


# --- ordering under concurrent writers ----------------------------------------------------


def _run_writer_processes(conn_string: str, threads: Sequence[str]) -> list[list[int]]:
    """Writer ``w`` appends to ``threads[w]`` in a process of its own; returns each one's seqs."""
    calls = [
        {"conn_string": conn_string, "thread": thread, "count": EVENTS_PER_WRITER, "writer": w}
        for w, thread in enumerate(threads)
    ]
    with _children(_event_writer.append_events, *calls) as children:
        _release(children)
        return [child.finish() for child in children]


def _assert_gapless_and_ordered(
    events: Sequence[Event], returned: Mapping[int, Sequence[int]]
) -> None:
    """Seqs are exactly 1..n; each writer's events keep its order, at the seqs it was told."""
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    stored: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for event in events:
        stored[event.payload["writer"]].append((event.seq, event.payload["i"]))
    assert sorted(stored) == sorted(returned)
    for writer, seqs in returned.items():
        assert [i for _, i in stored[writer]] == list(range(EVENTS_PER_WRITER))
        assert [seq for seq, _ in stored[writer]] == list(seqs)


def test_concurrent_processes_on_own_threads_get_gapless_seqs(backend: str) -> None:
    """Four processes appending 50 events each to their own thread get seqs 1..50 in order."""
    _setup(backend)
    threads = [f"own-{w}" for w in range(WRITERS)]
    returned = _run_writer_processes(backend, threads)
    with RecoveryCheckpointer.from_conn_string(backend) as cp:
        for writer, thread in enumerate(threads):
            events = cp.events(thread)
            assert len(events) == EVENTS_PER_WRITER
            _assert_gapless_and_ordered(events, {writer: returned[writer]})


def test_concurrent_processes_on_one_thread_share_a_gapless_sequence(backend: str) -> None:
    """Four processes on the SAME thread get seqs 1..200, each writer's order preserved."""
    _setup(backend)
    returned = _run_writer_processes(backend, ["shared"] * WRITERS)
    with RecoveryCheckpointer.from_conn_string(backend) as cp:
        events = cp.events("shared")
    assert len(events) == WRITERS * EVENTS_PER_WRITER
    _assert_gapless_and_ordered(events, dict(enumerate(returned)))


def test_concurrent_threads_on_one_thread_share_a_gapless_sequence(backend: str) -> None:
    """Four OS threads sharing one checkpointer get seqs 1..200, each one's order preserved."""
    _setup(backend)
    returned = _run_writer_threads(backend, "shared")
    with RecoveryCheckpointer.from_conn_string(backend) as cp:
        events = cp.events("shared")
    assert len(events) == WRITERS * EVENTS_PER_WRITER
    _assert_gapless_and_ordered(events, dict(enumerate(returned)))


# --- durability -----------------------------------------------------------------------------


@pytest.mark.slow
def test_appended_event_survives_sigkill_of_its_writer(backend: str) -> None:
    """An event is durable once append_event returns: SIGKILLing the writer loses nothing."""
    _setup(backend)
    for attempt in range(1, CRASH_DRILLS + 1):
        call = {"conn_string": backend, "thread": "crashy", "attempt": attempt}
        with _children(_event_writer.append_then_hang, call) as (child,):
            seq = child.receive("done")  # sent only once append_event has returned
            assert child.process.pid is not None
            os.kill(child.process.pid, signal.SIGKILL)
            child.process.join(CHILD_TIMEOUT_S)
            assert child.process.exitcode == -signal.SIGKILL

        assert seq == attempt
        with RecoveryCheckpointer.from_conn_string(backend) as cp:
            events = cp.events("crashy")
        assert [(e.seq, e.kind, dict(e.payload)) for e in events] == [
            (n, EventKind.TOOL_INVOKED, {"attempt": n}) for n in range(1, attempt + 1)
        ]


# --- delete_thread --------------------------------------------------------------------------


class _Counter(TypedDict):
    n: int


def _counter_graph(checkpointer: Any) -> Any:
    builder = StateGraph(_Counter)
    builder.add_node("inc", lambda state: {"n": state["n"] + 1})
    builder.add_edge(START, "inc")
    builder.add_edge("inc", END)
    return builder.compile(checkpointer=checkpointer)


def _config(thread_id: str) -> Any:
    return {"configurable": {"thread_id": thread_id}}


def _stored_event_rows(conn_string: str, thread_id: str) -> int:
    rows = _raw_sql(
        conn_string, "SELECT COUNT(*) FROM taskpilots_events WHERE thread_id = ?", (thread_id,)
    )
    return int(rows[0][0])


def test_delete_thread_removes_only_that_threads_events_and_checkpoints(backend: str) -> None:
    """delete_thread drops the thread's checkpoints, events, decisions; other threads stay."""
    with RecoveryCheckpointer.from_conn_string(backend) as cp:
        cp.setup()
        graph = _counter_graph(cp)
        for thread in ("doomed", "kept"):
            assert graph.invoke({"n": 0}, _config(thread)) == {"n": 1}
            cp.append_event(thread, "agent_started", {"thread": thread})
            cp.append_event(thread, "agent_finished")
            cp.record_decision(thread, "", "digest", f"decided for {thread}")

        cp.delete_thread("doomed")

        assert cp.get_tuple(_config("doomed")) is None
        assert list(cp.list(_config("doomed"))) == []
        assert cp.events("doomed") == []
        assert _stored_event_rows(backend, "doomed") == 0
        assert cp.decision("doomed", "", "digest") is None
        assert graph.get_state(_config("kept")).values == {"n": 1}
        assert [e.seq for e in cp.events("kept")] == [1, 2]
        assert cp.decision("kept", "", "digest") == "decided for kept"
        # A reused thread id starts a new log (the per-thread counter went too).
        assert cp.append_event("doomed", "agent_started").seq == 1


async def test_adelete_thread_removes_only_that_threads_events_and_checkpoints(
    backend: str,
) -> None:
    """adelete_thread on the async checkpointer does the same as delete_thread."""
    async with AsyncRecoveryCheckpointer.from_conn_string(backend) as cp:
        await cp.setup()
        graph = _counter_graph(cp)
        for thread in ("doomed", "kept"):
            assert await graph.ainvoke({"n": 0}, _config(thread)) == {"n": 1}
            await cp.aappend_event(thread, "agent_started", {"thread": thread})
            await cp.aappend_event(thread, "agent_finished")
            await cp.arecord_decision(thread, "", "digest", f"decided for {thread}")

        await cp.adelete_thread("doomed")

        assert await cp.aget_tuple(_config("doomed")) is None
        assert [c async for c in cp.alist(_config("doomed"))] == []
        assert await cp.aevents("doomed") == []
        assert _stored_event_rows(backend, "doomed") == 0
        assert await cp.adecision("doomed", "", "digest") is None
        assert (await graph.aget_state(_config("kept"))).values == {"n": 1}
        assert [e.seq for e in await cp.aevents("kept")] == [1, 2]
        assert await cp.adecision("kept", "", "digest") == "decided for kept"
        assert (await cp.aappend_event("doomed", "agent_started")).seq == 1


# --- corrupt rows ---------------------------------------------------------------------------


def _corruption(backend_name: str, case: str, **row: Any) -> Any:
    marks: list[Any] = [pytest.mark.postgres] if backend_name == "postgres" else []
    return pytest.param(backend_name, row, id=f"{backend_name}-{case}", marks=marks)


_OBJECT_TEXT_AS_JSON_STRING = json.dumps(json.dumps({"goal": "looks like an object"}))

CORRUPTIONS = [
    _corruption("sqlite", "payload-not-json", payload='{"goal": "truncat'),
    _corruption("sqlite", "payload-nan", payload='{"score": NaN}'),
    _corruption("sqlite", "payload-json-array", payload="[1, 2, 3]"),
    _corruption("sqlite", "payload-json-string", payload=_OBJECT_TEXT_AS_JSON_STRING),
    _corruption("sqlite", "unknown-kind", kind="tool_exploded"),
    _corruption("sqlite", "ts-not-numeric", ts="yesterday"),
    # JSONB cannot hold invalid JSON or NaN: store valid JSON that is not an object instead.
    _corruption("postgres", "payload-json-array", payload="[1, 2, 3]"),
    _corruption("postgres", "payload-json-scalar-string", payload='"just text"'),
    _corruption("postgres", "payload-json-null", payload="null"),
    _corruption("postgres", "payload-json-string", payload=_OBJECT_TEXT_AS_JSON_STRING),
    _corruption("postgres", "unknown-kind", kind="tool_exploded"),
    # DOUBLE PRECISION cannot hold text; NaN and infinity are its non-times.
    _corruption("postgres", "ts-nan", ts=math.nan),
    _corruption("postgres", "ts-infinite", ts=math.inf),
]


@pytest.mark.parametrize(("backend_name", "bad_row"), CORRUPTIONS)
async def test_corrupt_row_raises_instead_of_reading_as_empty(
    request: pytest.FixtureRequest, backend_name: str, bad_row: Mapping[str, Any]
) -> None:
    """A stored event that cannot be decoded raises CorruptRecordError from sync and async reads."""
    conn = _conn_string(request, backend_name, shared=True)
    broken, healthy = f"broken-{uuid.uuid4().hex}", f"healthy-{uuid.uuid4().hex}"
    with RecoveryCheckpointer.from_conn_string(conn) as cp:
        cp.setup()
        cp.append_event(broken, "agent_started", {"goal": "fine"})
        cp.append_event(healthy, "agent_started")
    row = {"kind": "step_completed", "ts": time.time(), "payload": "{}", **bad_row}
    cast = "?::jsonb" if _is_postgres(conn) else "?"
    _raw_sql(
        conn,
        f"INSERT INTO taskpilots_events (thread_id, seq, kind, ts, payload) "
        f"VALUES (?, ?, ?, ?, {cast})",
        (broken, 2, row["kind"], row["ts"], row["payload"]),
    )

    with RecoveryCheckpointer.from_conn_string(conn) as cp:
        with pytest.raises(CorruptRecordError) as raised:
            cp.events(broken)
        assert [e.seq for e in cp.events(healthy)] == [1]  # the damage stays local
    assert raised.value.table == "taskpilots_events"
    assert raised.value.key == f"{broken}#2"

    async with AsyncRecoveryCheckpointer.from_conn_string(conn) as acp:
        with pytest.raises(CorruptRecordError):
            await acp.aevents(broken)


# --- bad input ------------------------------------------------------------------------------


class _Opaque:
    """Not JSON."""


_OWN = object()  # stands for the test's own fresh thread id


BAD_APPENDS = [
    pytest.param(_OWN, "tool_exploded", {}, id="unknown-kind"),
    pytest.param(_OWN, "", {}, id="empty-kind"),
    pytest.param(_OWN, "step_completed", {"tags": {"a", "b"}}, id="payload-with-set"),
    pytest.param(_OWN, "step_completed", {"score": math.nan}, id="payload-with-nan"),
    pytest.param(_OWN, "step_completed", {"score": -math.inf}, id="payload-with-infinity"),
    pytest.param(_OWN, "step_completed", {"obj": _Opaque()}, id="payload-with-object"),
    pytest.param(
        _OWN, "step_completed", {"blob": "x" * MAX_PAYLOAD_BYTES}, id="payload-over-size-limit"
    ),
    pytest.param("", "step_completed", {}, id="empty-thread-id"),
    pytest.param(None, "step_completed", {}, id="none-thread-id"),
    # Values no backend (or not every backend) can store are refused up front.
    pytest.param(
        _OWN,
        "step_completed",
        {"text": "\ud800"},
        id="payload-with-lone-surrogate",
    ),
    pytest.param(
        _OWN,
        "step_completed",
        {"text": "a\x00b"},
        id="payload-with-nul",
    ),
    pytest.param(
        "t\x00x",
        "step_completed",
        {},
        id="thread-id-with-nul",
    ),
]


def _row_counts(conn_string: str) -> tuple[int, ...]:
    tables = ["taskpilots_events"]
    if _is_postgres(conn_string):
        tables.append("taskpilots_event_seq")  # a refused append must not consume a seq
    return tuple(int(_raw_sql(conn_string, f"SELECT COUNT(*) FROM {t}")[0][0]) for t in tables)


@pytest.mark.parametrize(("thread_id", "kind", "payload"), BAD_APPENDS)
async def test_bad_input_raises_configuration_error_and_writes_nothing(
    shared_backend: str, thread_id: Any, kind: str, payload: dict[str, Any]
) -> None:
    """Invalid appends raise ConfigurationError (sync and async) and leave no trace behind."""
    own = f"bad-input-{uuid.uuid4().hex}"
    thread_id = own if thread_id is _OWN else thread_id
    with RecoveryCheckpointer.from_conn_string(shared_backend) as cp:
        cp.setup()
        before = _row_counts(shared_backend)
        with pytest.raises(ConfigurationError):
            cp.append_event(thread_id, kind, payload)
        with pytest.raises(ConfigurationError):
            await cp.aappend_event(thread_id, kind, payload)
    async with AsyncRecoveryCheckpointer.from_conn_string(shared_backend) as acp:
        with pytest.raises(ConfigurationError):
            await acp.aappend_event(thread_id, kind, payload)

    assert _row_counts(shared_backend) == before
    with RecoveryCheckpointer.from_conn_string(shared_backend) as cp:
        assert cp.append_event(own, "step_completed", {"ok": True}).seq == 1


# --- setup ----------------------------------------------------------------------------------


async def test_setup_is_idempotent(backend: str) -> None:
    """Repeated setup() (sync and async, same and new instances) keeps data and versions once."""
    with RecoveryCheckpointer.from_conn_string(backend) as cp:
        cp.setup()
        cp.setup()
        cp.append_event("t", "agent_started")
    with RecoveryCheckpointer.from_conn_string(backend) as cp:
        cp.setup()
        assert [e.seq for e in cp.events("t")] == [1]
    async with AsyncRecoveryCheckpointer.from_conn_string(backend) as acp:
        await acp.setup()
        await acp.setup()
        assert (await acp.aappend_event("t", "agent_finished")).seq == 2

    assert _migration_counts(backend) == dict.fromkeys(range(1, SCHEMA_VERSION + 1), 1)


def test_concurrent_setup_on_a_fresh_database_succeeds_once(backend: str) -> None:
    """Two processes calling setup() at the same instant both succeed; each version lands once."""
    call = {"conn_string": backend}
    with _children(_event_writer.run_setup, call, call) as children:
        _release(children)
        for child in children:
            child.finish()  # raises ChildFailed with the child's traceback if setup() failed

    assert _migration_counts(backend) == dict.fromkeys(range(1, SCHEMA_VERSION + 1), 1)
    with RecoveryCheckpointer.from_conn_string(backend) as cp:
        assert cp.append_event("t", "agent_started").seq == 1
        assert _counter_graph(cp).invoke({"n": 0}, _config("t")) == {"n": 1}


# --- async / sync parity --------------------------------------------------------------------

SEQUENCE: list[tuple[str, dict[str, Any] | None, dict[str, str]]] = [
    ("agent_started", {"goal": "close tickets"}, {}),
    ("plan_created", {"steps": ["triage", "reply"], "n": 2}, {"checkpoint_id": "cp-1"}),
    (
        "tool_invoked",
        {"tool": "email", "args": {"to": "zoë@example.com", "cc": []}},
        {"checkpoint_id": "cp-2", "checkpoint_ns": "child:1"},
    ),
    ("tool_succeeded", {"ok": True, "cost": 1.5, "note": None}, {"checkpoint_id": "cp-2"}),
    ("agent_finished", None, {}),
]


async def test_async_api_matches_sync_api(backend: str) -> None:
    """AsyncRecoveryCheckpointer stores and reads a sequence exactly as RecoveryCheckpointer."""
    with RecoveryCheckpointer.from_conn_string(backend) as cp:
        cp.setup()
        sync_returned = [cp.append_event("sync", k, p, **kw) for k, p, kw in SEQUENCE]
        sync_read = cp.events("sync")
        sync_tail = cp.events("sync", after_seq=2)

    async with AsyncRecoveryCheckpointer.from_conn_string(backend) as acp:
        await acp.setup()
        async_returned = [await acp.aappend_event("async", k, p, **kw) for k, p, kw in SEQUENCE]
        async_read = await acp.aevents("async")
        async_tail = await acp.aevents("async", after_seq=2)
        async_reads_sync = await acp.aevents("sync")
        # The async checkpointer's sync face, used from another thread, agrees as well.
        from_worker_thread = await asyncio.to_thread(acp.events, "async")

    with RecoveryCheckpointer.from_conn_string(backend) as cp:
        sync_reads_async = cp.events("async")

    assert sync_returned == sync_read  # what append_event returns is what is stored
    assert async_returned == async_read
    assert _summary(async_read) == _summary(sync_read)
    assert [e.seq for e in sync_read] == [1, 2, 3, 4, 5]
    assert sync_tail == sync_read[2:]
    assert async_tail == async_read[2:]
    assert async_reads_sync == sync_read
    assert sync_reads_async == async_read == from_worker_thread
    assert all(e.ts.tzinfo is UTC for e in [*sync_read, *async_read])
