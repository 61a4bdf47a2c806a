"""RecoveryCheckpointer(inner) answers every saver call exactly as a bare twin saver does.

A Hypothesis state machine drives the same random sequence of ``put`` / ``put_writes`` /
``get_tuple`` / ``list`` / ``delete_thread`` calls into ``RecoveryCheckpointer(inner)`` and into
an identical, unwrapped saver of the same kind (each with a database of its own), interleaves
event-log traffic on the wrapped side only, and compares every result field by field.
"""

from __future__ import annotations

import copy
import itertools
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _services import create_database, drop_database
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    CheckpointTuple,
    create_checkpoint,
    empty_checkpoint,
)
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from psycopg import sql

from taskpilots_graph import EventKind, RecoveryCheckpointer

# A pair factory returns (wrapped, bare) and registers their cleanup on the ExitStack.
PairFactory = Callable[[ExitStack], tuple[RecoveryCheckpointer, BaseCheckpointSaver[Any]]]

SETTINGS = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

THREADS = ("t-1", "t-2", "t-3")
NAMESPACES = ("", "child:1")
CHANNELS = ("a", "b", "c")
WRITE_CHANNELS = (*CHANNELS, "__error__", "__interrupt__")
SOURCES = ("input", "loop", "update", "fork")
USERS = ("alice", "bob")

values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-1000, 1000),
    st.text(max_size=6),
    st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.sampled_from(("x", "y")), st.integers(0, 9), max_size=2),
)
metadata_st = st.fixed_dictionaries(
    {"source": st.sampled_from(SOURCES), "step": st.integers(-1, 4)},
    optional={"user": st.sampled_from(USERS)},
)
filters = st.one_of(
    st.none(),
    st.fixed_dictionaries({"source": st.sampled_from(SOURCES)}),
    st.fixed_dictionaries({"step": st.integers(-1, 4)}),
    st.fixed_dictionaries({"user": st.sampled_from(USERS)}),
    st.fixed_dictionaries({"source": st.sampled_from(SOURCES), "step": st.integers(-1, 4)}),
)
# An index into the ids stored for a (thread, ns); negative picks an id nobody stored.
picks = st.integers(-1, 8)


def _config(thread: str, ns: str | None = None, checkpoint_id: str | None = None) -> RunnableConfig:
    configurable: dict[str, Any] = {"thread_id": thread}
    if ns is not None:
        configurable["checkpoint_ns"] = ns
    if checkpoint_id is not None:
        configurable["checkpoint_id"] = checkpoint_id
    return {"configurable": configurable}


def _outcome(call: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """The value a call returned, or what it raised."""
    try:
        return call(), None
    except Exception as exc:
        return None, exc


def _tuple_fields(tup: CheckpointTuple | None) -> dict[str, Any] | None:
    if tup is None:
        return None
    return {
        "config": tup.config,
        "checkpoint": tup.checkpoint,
        "metadata": tup.metadata,
        "parent_config": tup.parent_config,
        "pending_writes": tup.pending_writes,
    }


def _assert_tuples_equal(wrapped: Any, bare: Any, what: str) -> None:
    """Compare two (lists of) CheckpointTuples field by field, naming the first difference."""
    if isinstance(bare, list) and isinstance(wrapped, list):
        assert len(wrapped) == len(bare), f"{what}: {len(wrapped)} tuples != {len(bare)}"
        for i, (w, b) in enumerate(zip(wrapped, bare, strict=True)):
            _assert_tuples_equal(w, b, f"{what}[{i}]")
        return
    w_fields, b_fields = _tuple_fields(wrapped), _tuple_fields(bare)
    if w_fields is None or b_fields is None:
        assert w_fields == b_fields, f"{what}: {wrapped!r} != {bare!r}"
        return
    for name, b_value in b_fields.items():
        assert w_fields[name] == b_value, f"{what}.{name}: {w_fields[name]!r} != {b_value!r}"


class TwinSavers(RuleBasedStateMachine):
    """Model: for each (thread, ns), the checkpoint ids stored and the channels' state."""

    make_pair: PairFactory

    def __init__(self) -> None:
        super().__init__()
        self.stack = ExitStack()
        self.wrapped, self.bare = self.make_pair(self.stack)
        self.ids: dict[tuple[str, str], list[str]] = {}
        self.versions: dict[tuple[str, str], dict[str, Any]] = {}
        self.channel_values: dict[tuple[str, str], dict[str, Any]] = {}
        self.event_counts: dict[str, int] = {}
        self.steps = itertools.count()

    def teardown(self) -> None:
        self.stack.close()

    # -- helpers ---------------------------------------------------------------------------

    def _new_id(self) -> str:
        # uuid6 timestamps strictly increase, so ids sort in the order they were created.
        return str(uuid6(clock_seq=next(self.steps)))

    def _pick(self, thread: str, ns: str, pick: int) -> str:
        ids = self.ids.get((thread, ns), [])
        if pick < 0 or not ids:
            return self._new_id()  # an id that is stored nowhere
        return ids[pick % len(ids)]

    def _pick_any(self, pick: int) -> str:
        """Any stored id (the ids sort in creation order), or an id newer than all."""
        ids = sorted(itertools.chain.from_iterable(self.ids.values()))
        if pick < 0 or not ids:
            return self._new_id()
        return ids[pick % len(ids)]

    def _both(self, call: Callable[[BaseCheckpointSaver[Any]], Any]) -> tuple[Any, Any] | None:
        """Results of ``call`` on (wrapped, bare); None if both raised the same error type.

        Both may legitimately fail, e.g. PostgreSQL cannot store a NUL character in text.
        """
        wrapped, wrapped_error = _outcome(lambda: call(self.wrapped))
        bare, bare_error = _outcome(lambda: call(self.bare))
        assert type(wrapped_error) is type(bare_error), (
            f"wrapped raised {wrapped_error!r}, bare raised {bare_error!r}"
        )
        return None if bare_error is not None else (wrapped, bare)

    # -- rules -----------------------------------------------------------------------------

    @initialize(
        puts=st.lists(
            st.tuples(st.sampled_from(THREADS), st.sampled_from(NAMESPACES), picks, metadata_st),
            min_size=1,
            max_size=8,
        ),
        writes=st.lists(st.tuples(st.sampled_from(THREADS), picks, values), max_size=4),
    )
    def seed(
        self,
        puts: list[tuple[str, str, int, dict[str, Any]]],
        writes: list[tuple[str, int, Any]],
    ) -> None:
        """Start every example with some checkpoints and writes to query and delete."""
        for i, (thread, ns, parent, metadata) in enumerate(puts):
            self.put(
                thread=thread, ns=ns, parent=parent, updates={CHANNELS[i % 3]: i}, metadata=metadata
            )
        for thread, at, value in writes:
            self.put_writes(
                thread=thread, ns="", at=at, writes=[("a", value)], task_id="task-a", task_path=""
            )

    @rule(
        thread=st.sampled_from(THREADS),
        ns=st.sampled_from(NAMESPACES),
        parent=picks,
        updates=st.dictionaries(st.sampled_from(CHANNELS), values, max_size=3),
        metadata=metadata_st,
    )
    def put(
        self,
        thread: str,
        ns: str,
        parent: int,
        updates: dict[str, Any],
        metadata: dict[str, Any],
    ) -> None:
        key = (thread, ns)
        versions = dict(self.versions.get(key, {}))
        new_versions = {ch: self.bare.get_next_version(versions.get(ch), None) for ch in updates}
        versions.update(new_versions)
        channel_values = {**self.channel_values.get(key, {}), **updates}
        base = empty_checkpoint()
        base["channel_versions"] = versions
        base["channel_values"] = channel_values
        base["versions_seen"] = {"node": dict(new_versions)}
        checkpoint = create_checkpoint(base, None, metadata["step"], id=self._new_id())
        parent_id = self._pick(thread, ns, parent) if parent >= 0 and key in self.ids else None
        config = _config(thread, ns, parent_id)
        full_metadata: dict[str, Any] = {**metadata, "parents": {}}

        results = self._both(
            lambda s: s.put(
                copy.deepcopy(config),
                copy.deepcopy(checkpoint),
                copy.deepcopy(full_metadata),
                dict(new_versions),
            )
        )
        if results is None:
            return  # both refused the checkpoint: nothing was stored
        w, b = results
        assert w == b
        assert w["configurable"]["checkpoint_id"] == checkpoint["id"]
        self.ids.setdefault(key, []).append(checkpoint["id"])
        self.versions[key] = versions
        self.channel_values[key] = channel_values

    @rule(
        thread=st.sampled_from(THREADS),
        ns=st.sampled_from(NAMESPACES),
        at=picks,
        writes=st.lists(st.tuples(st.sampled_from(WRITE_CHANNELS), values), max_size=3),
        task_id=st.sampled_from(("task-a", "task-b")),
        task_path=st.sampled_from(("", "~__pregel_pull, node")),
    )
    def put_writes(
        self,
        thread: str,
        ns: str,
        at: int,
        writes: list[tuple[str, Any]],
        task_id: str,
        task_path: str,
    ) -> None:
        config = _config(thread, ns, self._pick(thread, ns, at))
        results = self._both(
            lambda s: s.put_writes(copy.deepcopy(config), copy.deepcopy(writes), task_id, task_path)
        )
        assert results in (None, (None, None))

    @rule(
        thread=st.sampled_from(THREADS),
        ns=st.sampled_from(NAMESPACES),
        at=st.one_of(st.none(), picks),
    )
    def get_tuple(self, thread: str, ns: str, at: int | None) -> None:
        checkpoint_id = None if at is None else self._pick(thread, ns, at)
        config = _config(thread, ns, checkpoint_id)
        if results := self._both(lambda s: s.get_tuple(copy.deepcopy(config))):
            _assert_tuples_equal(*results, f"get_tuple({config})")

    @rule(
        scope=st.sampled_from(("all", "thread", "thread+ns", "checkpoint")),
        thread=st.sampled_from(THREADS),
        ns=st.sampled_from(NAMESPACES),
        at=picks,
        filter=filters,
        before=st.one_of(st.none(), picks),
        limit=st.one_of(st.none(), st.integers(0, 4)),
    )
    def list_checkpoints(
        self,
        scope: str,
        thread: str,
        ns: str,
        at: int,
        filter: dict[str, Any] | None,
        before: int | None,
        limit: int | None,
    ) -> None:
        config: RunnableConfig | None = {
            "all": None,
            "thread": _config(thread),
            "thread+ns": _config(thread, ns),
            "checkpoint": _config(thread, ns, self._pick(thread, ns, at)),
        }[scope]
        before_config = None if before is None else _config(thread, ns, self._pick_any(before))
        results = self._both(
            lambda s: list(
                s.list(
                    copy.deepcopy(config),
                    filter=copy.deepcopy(filter),
                    before=copy.deepcopy(before_config),
                    limit=limit,
                )
            )
        )
        what = f"list({config}, {filter=}, before={before_config}, {limit=})"
        if results:
            _assert_tuples_equal(*results, what)

    @rule(thread=st.sampled_from(THREADS))
    def delete_thread(self, thread: str) -> None:
        self._both(lambda s: s.delete_thread(thread))
        for key in [k for k in self.ids if k[0] == thread]:
            del self.ids[key]
            self.versions.pop(key, None)
            self.channel_values.pop(key, None)
        self.event_counts.pop(thread, None)
        assert self.wrapped.events(thread) == []

    @rule(
        thread=st.sampled_from(THREADS),
        kind=st.sampled_from(list(EventKind)),
        payload=st.dictionaries(st.sampled_from(("k", "n")), st.integers(0, 9), max_size=2),
    )
    def append_event(self, thread: str, kind: EventKind, payload: dict[str, int]) -> None:
        """Recovery traffic on the wrapped side only: must not change what the saver returns."""
        event = self.wrapped.append_event(thread, kind, payload)
        self.event_counts[thread] = self.event_counts.get(thread, 0) + 1
        assert event.seq == self.event_counts[thread]

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def full_listing_matches(self) -> None:
        results = self._both(lambda s: list(s.list(None)))
        assert results is not None, "listing every checkpoint failed on both savers"
        _assert_tuples_equal(*results, "list(None)")


# -- backends ------------------------------------------------------------------------------


def _memory_pairs(request: pytest.FixtureRequest) -> Iterator[PairFactory]:
    def make(stack: ExitStack) -> tuple[RecoveryCheckpointer, BaseCheckpointSaver[Any]]:
        return RecoveryCheckpointer(InMemorySaver()), InMemorySaver()

    yield make


def _sqlite_pairs(request: pytest.FixtureRequest) -> Iterator[PairFactory]:
    tmp_path: Path = request.getfixturevalue("tmp_path")
    examples = itertools.count()

    def connect(path: Path, stack: ExitStack) -> sqlite3.Connection:
        return stack.enter_context(closing(sqlite3.connect(path, check_same_thread=False)))

    def make(stack: ExitStack) -> tuple[RecoveryCheckpointer, BaseCheckpointSaver[Any]]:
        n = next(examples)  # fresh files for every example: no state leaks between them
        wrapped = RecoveryCheckpointer(SqliteSaver(connect(tmp_path / f"wrapped-{n}.db", stack)))
        wrapped.setup()
        bare = SqliteSaver(connect(tmp_path / f"bare-{n}.db", stack))
        bare.setup()
        return wrapped, bare

    yield make


def _postgres_pairs(request: pytest.FixtureRequest) -> Iterator[PairFactory]:
    from langgraph.checkpoint.postgres import PostgresSaver

    admin_url: str = request.getfixturevalue("postgres_admin_url")
    wrapped_url: str = request.getfixturevalue("postgres_url")
    bare_name = f"t_{uuid.uuid4().hex}"
    bare_url = create_database(admin_url, bare_name)
    try:
        with (
            PostgresSaver.from_conn_string(wrapped_url) as inner,
            PostgresSaver.from_conn_string(bare_url) as bare,
        ):
            wrapped = RecoveryCheckpointer(inner)
            wrapped.setup()
            bare.setup()

            def make(stack: ExitStack) -> tuple[RecoveryCheckpointer, BaseCheckpointSaver[Any]]:
                for url in (wrapped_url, bare_url):
                    _truncate_data_tables(url)
                return wrapped, bare

            yield make
    finally:
        drop_database(admin_url, bare_name)


def _truncate_data_tables(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                "AND tablename NOT LIKE '%migrations'"
            )
        ]
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(map(sql.Identifier, tables))))


@pytest.fixture(
    params=[
        "memory",
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def make_pair(request: pytest.FixtureRequest) -> Iterator[PairFactory]:
    """Opens a fresh (RecoveryCheckpointer(inner), bare twin) pair of one backend."""
    build = {"memory": _memory_pairs, "sqlite": _sqlite_pairs, "postgres": _postgres_pairs}
    yield from build[request.param](request)


# A failure is shrunk for up to 5 minutes (Hypothesis's own cap): leave it time to finish.
@pytest.mark.timeout(600)
def test_wrapper_matches_bare_twin(make_pair: PairFactory) -> None:
    """Random saver call sequences give field-for-field equal results wrapped and bare."""
    machine = type("TwinSaversForBackend", (TwinSavers,), {"make_pair": staticmethod(make_pair)})
    run_state_machine_as_test(machine, settings=SETTINGS)
