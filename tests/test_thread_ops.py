"""``copy_thread``, ``delete_for_runs`` and ``prune(strategy=...)`` on every backend.

A scripted model drives the recovery agent against memory, a real SQLite file or a real
PostgreSQL database; an in-process service records every effect, so an effect performed
twice shows up. The copies and deletions must carry the recovery records (events, ledger,
decisions, artifacts) as their docstrings say, and never make a thread repeat an effect.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from _slow_puts import slow_puts
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.base import CheckpointTuple, empty_checkpoint
from langgraph.checkpoint.memory import InMemorySaver

from taskpilots_graph import (
    AsyncRecoveryCheckpointer,
    ConfigurationError,
    EventKind,
    LedgerEntry,
    LedgerStatus,
    NotDone,
    RecoveryCheckpointer,
    aresume,
    create_recovery_agent,
    resume,
    side_effect,
)
from taskpilots_graph.checkpointers._optional import COPIED_FROM, copied_entry
from taskpilots_graph.errors import ThreadNotFound
from taskpilots_graph.ledger import PAUSED, PrecheckOutcome, args_digest, default_key

GOAL = "export order o-1 and tell the team"
EXPORT = ("export", {"order": "o-1"})
NOTIFY = ("notify", {"order": "o-1"})


class SimulatedCrash(BaseException):
    """Stands in for the process dying: no ``except Exception`` on the way catches it."""


class ScriptedModel(BaseChatModel):
    """Runs ``script`` (one list of tool calls per step), then answers; a fresh random
    tool-call id per decision, like a real model."""

    script: list[list[tuple[str, dict[str, Any]]]]

    @property
    def _llm_type(self) -> str:
        return "scripted-thread-ops-test"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        step = sum(1 for m in messages if isinstance(m, AIMessage) and m.tool_calls)
        if step < len(self.script):
            calls = [
                {"name": name, "args": dict(args), "id": f"call_{uuid.uuid4().hex[:12]}"}
                for name, args in self.script[step]
            ]
            message = AIMessage("", tool_calls=calls)
        else:
            message = AIMessage(f"finished after {step} steps")
        return ChatResult(generations=[ChatGeneration(message=message)])


@dataclass
class Archive:
    """In-process archive service; ``exports`` lists every export performed.

    ``crash_in_notify`` kills the run after the export committed, before the step's
    checkpoint; ``crash_in_export`` kills it inside the export, after the effect and before
    its commit (the intent stays without an outcome).
    """

    exports: list[str] = field(default_factory=list)
    crash_in_notify: bool = False
    crash_in_export: bool = False

    def tools(self) -> list[BaseTool]:
        @side_effect(precheck=self.find)
        @tool
        def export(order: str) -> str:
            """Export an order report to the archive."""
            self.exports.append(order)
            if self.crash_in_export:
                self.crash_in_export = False
                raise SimulatedCrash("killed inside the export")
            return f"archived-{order}"

        @tool
        def notify(order: str) -> str:
            """Tell the team."""
            if self.crash_in_notify:
                self.crash_in_notify = False
                raise SimulatedCrash("killed after the export, before the checkpoint")
            return "notified"

        return [export, notify]

    def find(self, key: str, args: dict[str, Any]) -> PrecheckOutcome:
        # The archive cannot tell (no lookup by key): the ledger decides alone.
        return NotDone()


def config(thread_id: str, run_id: str | None = None) -> Any:
    # A run id in ``configurable`` lands in each checkpoint's metadata (LangGraph's server
    # passes it this way): what delete_for_runs selects by.
    configurable = {"thread_id": thread_id}
    if run_id is not None:
        configurable["run_id"] = run_id
    return {"configurable": configurable}


def goal() -> dict[str, Any]:
    return {"messages": [HumanMessage(GOAL)]}


def history(cp: Any, thread_id: str) -> list[CheckpointTuple]:
    return sorted(
        cp.list(config(thread_id)),
        key=lambda t: (t.config["configurable"]["checkpoint_ns"], t.checkpoint["id"]),
    )


def view(tuples: Sequence[CheckpointTuple]) -> list[tuple[Any, ...]]:
    """What a copy must keep of each checkpoint: everything but the thread id."""
    return [
        (
            t.config["configurable"]["checkpoint_ns"],
            t.checkpoint["id"],
            t.parent_config["configurable"]["checkpoint_id"] if t.parent_config else None,
            t.checkpoint["channel_values"],
            t.checkpoint["channel_versions"],
            t.metadata,
            t.pending_writes,
        )
        for t in tuples
    ]


# --- backends ---------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_conn(request: pytest.FixtureRequest) -> str:
    """Connection string of an empty database of each backend (memory included)."""
    if request.param == "memory":
        return ":memory:"
    if request.param == "sqlite":
        return f"sqlite:///{request.getfixturevalue('sqlite_path')}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def tcp(any_conn: str) -> Iterator[RecoveryCheckpointer]:
    with RecoveryCheckpointer.from_conn_string(any_conn) as saver:
        saver.setup()
        yield saver


@pytest.fixture
async def atcp(any_conn: str) -> AsyncIterator[AsyncRecoveryCheckpointer]:
    async with AsyncRecoveryCheckpointer.from_conn_string(any_conn) as saver:
        await saver.setup()
        yield saver


def crashed_after_commit(cp: Any, archive: Archive, thread_id: str = "src") -> Any:
    """A thread whose export committed in the ledger but not in a checkpoint."""
    archive.crash_in_notify = True
    graph = create_recovery_agent(
        ScriptedModel(script=[[EXPORT, NOTIFY]]), archive.tools(), checkpointer=cp
    )
    with pytest.raises(SimulatedCrash):
        graph.invoke(goal(), config(thread_id))
    (entry,) = cp.ledger(thread_id)
    assert entry.status is LedgerStatus.COMMITTED
    assert archive.exports == ["o-1"]
    return graph


# --- copy_thread ------------------------------------------------------------------------------


def test_copy_thread_copies_checkpoints_and_recovery_records(
    tcp: RecoveryCheckpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy has the source's checkpoints, writes, events, decisions, artifacts and ledger."""
    slow_puts(monkeypatch, tcp)  # the step's checkpoint late: its decision is recorded
    archive = Archive()
    crashed_after_commit(tcp, archive)
    ref = tcp.put_artifact("src", b"the exported report")
    (source_entry,) = tcp.ledger("src")
    source_events = tcp.events("src")
    digests = tcp._call("decision_digests", "src", "")
    assert digests  # the model's decision was recorded with the intent

    tcp.copy_thread("src", "dst")

    assert view(history(tcp, "dst")) == view(history(tcp, "src"))
    (entry,) = tcp.ledger("dst")
    assert entry.key == default_key(
        thread_id="dst",
        checkpoint_ns=source_entry.checkpoint_ns,
        tool_call_id=source_entry.tool_call_id,
        tool="export",
        args={"order": "o-1"},
    )
    assert (entry.status, entry.result, entry.created_at) == (
        LedgerStatus.COMMITTED,
        source_entry.result,
        source_entry.created_at,
    )
    assert entry.extra[COPIED_FROM] == {
        "thread_id": "src",
        "key": source_entry.key,
        "status": "committed",
    }
    copied = tcp.events("dst")
    assert [(e.seq, e.kind, e.ts, e.checkpoint_id) for e in copied] == [
        (e.seq, e.kind, e.ts, e.checkpoint_id) for e in source_events
    ]
    # The copy's log names the copy's entry, never the source's.
    exported = {e.payload["key"] for e in copied if e.payload.get("tool") == "export"}
    assert exported == {entry.key}
    assert not [e for e in copied if source_entry.key in e.payload.values()]
    for digest in digests:
        assert tcp.decision("dst", "", digest) == tcp.decision("src", "", digest)
    # The source's rows are untouched, and the copy keeps its artifact when it goes.
    assert tcp.ledger("src") == [source_entry]
    tcp.delete_thread("src")
    assert tcp.artifact(ref.id) == b"the exported report"
    assert tcp.ledger("dst") == [entry]


def test_copied_thread_never_repeats_an_effect_the_source_committed(
    tcp: RecoveryCheckpointer,
) -> None:
    """Resuming the copy returns the recorded export (tool_skipped): the archive saw one."""
    archive = Archive()
    graph = crashed_after_commit(tcp, archive)
    tcp.copy_thread("src", "dst")

    final = resume(graph, "dst")

    assert archive.exports == ["o-1"]
    assert final["messages"][-1].content == "finished after 1 steps"
    (entry,) = tcp.ledger("dst")
    skipped = [e for e in tcp.events("dst") if e.kind is EventKind.TOOL_SKIPPED]
    assert [e.payload["key"] for e in skipped] == [entry.key]
    # The source resumes on its own ledger, independently: still one export.
    resume(graph, "src")
    assert archive.exports == ["o-1"]


def test_copy_asked_for_the_effect_again_gets_the_recorded_result(
    tcp: RecoveryCheckpointer,
) -> None:
    """A new run of the copy deciding the same export anew is caught by the repeat guard."""
    archive = Archive()
    graph = create_recovery_agent(
        ScriptedModel(script=[[EXPORT]]), archive.tools(), checkpointer=tcp
    )
    graph.invoke(goal(), config("src"))
    tcp.copy_thread("src", "dst")
    # The model's next decision, in the copy, is the same export (under a new call id).
    again = create_recovery_agent(
        ScriptedModel(script=[[EXPORT], [EXPORT]]), archive.tools(), checkpointer=tcp
    )

    again.invoke({"messages": [HumanMessage("export it again")]}, config("dst"))

    assert archive.exports == ["o-1"]
    caught = [e for e in tcp.events("dst") if e.kind is EventKind.REPEAT_CAUGHT]
    assert len(caught) == 1
    assert caught[0].payload["earlier_key"] == tcp.ledger("dst")[0].key


def test_copy_of_an_effect_without_outcome_is_uncertain_not_repeated(
    tcp: RecoveryCheckpointer,
) -> None:
    """An intent the source left open becomes uncertain in the copy: a person decides."""
    archive = Archive(crash_in_export=True)
    graph = create_recovery_agent(
        ScriptedModel(script=[[EXPORT]]), archive.tools(), checkpointer=tcp
    )
    with pytest.raises(SimulatedCrash):
        graph.invoke(goal(), config("src"))
    (source_entry,) = tcp.ledger("src")
    assert source_entry.status is LedgerStatus.INTENDED

    tcp.copy_thread("src", "dst")

    (entry,) = tcp.ledger("dst")
    assert entry.status is LedgerStatus.UNCERTAIN
    assert entry.extra[COPIED_FROM]["status"] == "intended"
    final = resume(graph, "dst")

    assert final["flow"]["stage"] == "awaiting_human"  # a takeover: a person decides
    assert "__interrupt__" in final
    assert archive.exports == ["o-1"]
    assert tcp.ledger("dst")[0].status is LedgerStatus.UNCERTAIN


def test_copy_thread_refuses_an_unknown_source_and_a_used_target(
    tcp: RecoveryCheckpointer,
) -> None:
    """No source checkpoint: ThreadNotFound; a target with data: ConfigurationError, untouched."""
    archive = Archive()
    crashed_after_commit(tcp, archive)
    tcp.append_event("used", "agent_started", {"goal": "something else"})

    with pytest.raises(ThreadNotFound):
        tcp.copy_thread("nobody", "dst")
    with pytest.raises(ConfigurationError, match="already has"):
        tcp.copy_thread("src", "used")
    with pytest.raises(ConfigurationError, match="same thread"):
        tcp.copy_thread("src", "src")

    assert list(tcp.list(config("used"))) == []
    assert [e.kind for e in tcp.events("used")] == [EventKind.AGENT_STARTED]
    assert tcp.ledger("used") == []


async def test_acopy_thread_copies_and_never_repeats(atcp: AsyncRecoveryCheckpointer) -> None:
    """The async copy carries the same records, and resuming it repeats nothing."""
    archive = Archive(crash_in_notify=True)
    graph = create_recovery_agent(
        ScriptedModel(script=[[EXPORT, NOTIFY]]), archive.tools(), checkpointer=atcp
    )
    with pytest.raises(SimulatedCrash):
        await graph.ainvoke(goal(), config("src"))
    source = [t async for t in atcp.alist(config("src"))]

    await atcp.acopy_thread("src", "dst")

    copied = [t async for t in atcp.alist(config("dst"))]
    assert view(copied) == view(source)
    assert [e.kind for e in await atcp.aevents("dst")] == [
        e.kind for e in await atcp.aevents("src")
    ]
    await aresume(graph, "dst")
    assert archive.exports == ["o-1"]
    (entry,) = await atcp.aledger("dst")
    assert entry.status is LedgerStatus.COMMITTED


def _entry(status: LedgerStatus, *, thread_id: str = "src", **extra: Any) -> LedgerEntry:
    now = datetime.now(UTC)
    args = {"order": "o-1"}
    key = default_key(
        thread_id=thread_id, checkpoint_ns="", tool_call_id="call_1", tool="export", args=args
    )
    return LedgerEntry(
        key=extra.pop("key", key),
        thread_id=thread_id,
        tool="export",
        status=status,
        args=args,
        args_digest=args_digest(args),
        attempt=1,
        created_at=now,
        updated_at=now,
        tool_call_id="call_1",
        error=extra.pop("error", None),
        extra=extra,
    )


@pytest.mark.parametrize(
    ("entry", "status"),
    [
        (_entry(LedgerStatus.COMMITTED), LedgerStatus.COMMITTED),
        (_entry(LedgerStatus.COMPENSATED), LedgerStatus.COMPENSATED),
        (_entry(LedgerStatus.FAILED, error={"maybe_sent": False}), LedgerStatus.FAILED),
        (_entry(LedgerStatus.INTENDED, **{PAUSED: True}), LedgerStatus.INTENDED),
        (_entry(LedgerStatus.INTENDED), LedgerStatus.UNCERTAIN),
        (_entry(LedgerStatus.FAILED, error={"maybe_sent": True}), LedgerStatus.UNCERTAIN),
        (_entry(LedgerStatus.UNCERTAIN), LedgerStatus.UNCERTAIN),
    ],
)
def test_copied_entry_keeps_settled_outcomes_and_doubts_the_rest(
    entry: LedgerEntry, status: LedgerStatus
) -> None:
    """Settled outcomes (and paused intents) keep their status; the others become uncertain."""
    copy = copied_entry(entry, "src", "dst")
    assert copy is not None
    assert (copy.thread_id, copy.status) == ("dst", status)
    assert copy.key != entry.key
    assert copy.key.startswith("export:")


def test_copied_entry_leaves_business_keys_and_other_threads_shared() -> None:
    """An entry under a business key, or written by another thread, is not copied."""
    assert copied_entry(_entry(LedgerStatus.COMMITTED, key="refund:o-1"), "src", "dst") is None
    assert copied_entry(_entry(LedgerStatus.COMMITTED, thread_id="other"), "src", "dst") is None


def test_copied_entry_moves_an_undo_with_its_effect() -> None:
    """The undo of a copied effect becomes the undo of the copy's effect; others stay."""
    effect = _entry(LedgerStatus.COMPENSATED)
    copy = copied_entry(effect, "src", "dst")
    assert copy is not None
    undo = _entry(LedgerStatus.COMMITTED, key=f"undo:{effect.key}")

    moved = copied_entry(undo, "src", "dst", {effect.key: copy.key})

    assert moved is not None
    assert (moved.key, moved.status) == (f"undo:{copy.key}", LedgerStatus.COMMITTED)
    assert copied_entry(undo, "src", "dst") is None  # its effect was not copied


# --- delete_for_runs --------------------------------------------------------------------------


def test_delete_for_runs_deletes_checkpoints_and_keeps_what_the_run_did(
    tcp: RecoveryCheckpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's checkpoints go; its events and ledger stay, so a rerun repeats no effect."""
    slow_puts(monkeypatch, tcp)  # the step's checkpoint late: its decision is recorded
    archive = Archive()
    graph = create_recovery_agent(
        ScriptedModel(script=[[EXPORT]]), archive.tools(), checkpointer=tcp
    )
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    graph.invoke(goal(), config("t", first))
    graph.invoke(goal(), config("other", second))
    ledger, events = tcp.ledger("t"), tcp.events("t")
    kept = view(history(tcp, "other"))
    assert {t.metadata.get("run_id") for t in history(tcp, "t")} == {first}

    tcp.delete_for_runs([first, str(uuid.uuid4())])

    assert history(tcp, "t") == []
    assert view(history(tcp, "other")) == kept
    assert tcp.ledger("t") == ledger
    assert tcp.events("t") == events
    graph.invoke(goal(), config("t"))  # the same work again, on the same thread
    assert archive.exports == ["o-1", "o-1"]  # one per thread: "t" did not export twice
    # The recorded decision is replayed, so the same call comes round: its recorded result.
    assert [e.kind for e in tcp.events("t")].count(EventKind.TOOL_SKIPPED) == 1


async def test_adelete_for_runs_leaves_other_runs_loadable(
    atcp: AsyncRecoveryCheckpointer,
) -> None:
    """Deleting one of a thread's runs leaves the other run's checkpoints whole."""
    archive = Archive()
    graph = create_recovery_agent(
        ScriptedModel(script=[[EXPORT]]), archive.tools(), checkpointer=atcp
    )
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    await graph.ainvoke(goal(), config("t", first))
    await graph.ainvoke({"messages": [HumanMessage("again")]}, config("t", second))
    before = [t async for t in atcp.alist(config("t"))]
    survivors = [t for t in before if t.metadata.get("run_id") == second]
    assert survivors
    assert len(survivors) < len(before)

    await atcp.adelete_for_runs([first])

    after = [t async for t in atcp.alist(config("t"))]
    assert view(after) == view(survivors)
    state = await graph.aget_state(config("t"))
    assert state.values["messages"][-1].content == "finished after 1 steps"
    assert len(await atcp.aledger("t")) == 1


def test_delete_for_runs_in_memory_frees_unreferenced_values() -> None:
    """In memory, values only the deleted checkpoints referred to are freed too."""
    cp = RecoveryCheckpointer(InMemorySaver())
    graph = create_recovery_agent(
        ScriptedModel(script=[[EXPORT]]), Archive().tools(), checkpointer=cp
    )
    run = str(uuid.uuid4())
    graph.invoke(goal(), config("t", run))
    assert isinstance(cp.inner, InMemorySaver)
    assert cp.inner.blobs
    assert cp.inner.writes

    cp.delete_for_runs([run])

    assert not [k for k in cp.inner.blobs if k[0] == "t"]
    assert not [k for k in cp.inner.writes if k[0] == "t"]


# --- prune(strategy=...) ----------------------------------------------------------------------


def test_prune_keep_latest_keeps_the_state_and_every_recovery_record(
    tcp: RecoveryCheckpointer,
) -> None:
    """keep_latest leaves one checkpoint per namespace, the same state, all records."""
    archive = Archive()
    graph = create_recovery_agent(
        ScriptedModel(script=[[EXPORT]]), archive.tools(), checkpointer=tcp
    )
    graph.invoke(goal(), config("t"))
    state = graph.get_state(config("t"))
    ledger, events = tcp.ledger("t"), tcp.events("t")
    assert len(history(tcp, "t")) > 1

    report = tcp.prune(["t", "no-such-thread"], strategy="keep_latest")

    assert report.pruned == ("t", "no-such-thread")
    (latest,) = history(tcp, "t")
    assert latest.checkpoint["id"] == state.config["configurable"]["checkpoint_id"]
    assert graph.get_state(config("t")).values == state.values
    assert (tcp.ledger("t"), tcp.events("t")) == (ledger, events)
    if isinstance(tcp.inner, InMemorySaver):  # only the kept checkpoint's values remain
        versions = latest.checkpoint["channel_versions"]
        assert {(k[2], k[3]) for k in tcp.inner.blobs if k[0] == "t"} == set(versions.items())
    graph.invoke(goal(), config("t"))
    assert archive.exports == ["o-1"]  # the ledger caught the repeat


async def test_aprune_delete_deletes_threads_whole(atcp: AsyncRecoveryCheckpointer) -> None:
    """strategy="delete" deletes checkpoints and recovery records of the named threads only."""
    graph = create_recovery_agent(
        ScriptedModel(script=[[EXPORT]]), Archive().tools(), checkpointer=atcp
    )
    for thread_id in ("gone", "kept"):
        await graph.ainvoke(goal(), config(thread_id))
    kept = [t async for t in atcp.alist(config("kept"))]

    report = await atcp.aprune(["gone"], strategy="delete")

    assert report.deleted == ("gone",)
    assert [t async for t in atcp.alist(config("gone"))] == []
    assert (await atcp.aevents("gone"), await atcp.aledger("gone")) == ([], [])
    assert view([t async for t in atcp.alist(config("kept"))]) == view(kept)
    assert len(await atcp.aledger("kept")) == 1


def test_prune_strategy_refuses_unknown_strategies_and_delta_threads(
    tcp: RecoveryCheckpointer,
) -> None:
    """A bad strategy, or keep_latest on a thread that uses a DeltaChannel, raises a typed
    error before anything is pruned."""
    stored = tcp.put(
        {"configurable": {"thread_id": "t", "checkpoint_ns": ""}},
        empty_checkpoint(),
        {"source": "input", "step": -1, "counters_since_delta_snapshot": {}},  # type: ignore[typeddict-unknown-key]
        {},
    )
    tcp.put(stored, empty_checkpoint(), {"source": "loop", "step": 0}, {})

    with pytest.raises(ConfigurationError, match="strategy"):
        tcp.prune(["t"], strategy="everything")
    with pytest.raises(ConfigurationError, match="DeltaChannel"):
        tcp.prune(["t"], strategy="keep_latest")
    assert len(history(tcp, "t")) == 2


def test_copy_keeps_the_order_of_pending_writes_by_task_path(tcp: RecoveryCheckpointer) -> None:
    """Pending writes keep their task paths, so the copy lists them in the source's order."""
    stored = tcp.put(
        {"configurable": {"thread_id": "src", "checkpoint_ns": ""}},
        empty_checkpoint(),
        {"source": "loop", "step": 0},
        {},
    )
    # Task "b" ran first (path 0) though its id sorts after "a" (path 1).
    tcp.put_writes(stored, [("ch", "from b")], "b", "~0")
    tcp.put_writes(stored, [("ch", "from a"), ("ch", "again a")], "a", "~1")

    tcp.copy_thread("src", "dst")

    source, copied = history(tcp, "src"), history(tcp, "dst")
    assert copied[0].pending_writes == source[0].pending_writes
    assert [w[0] for w in copied[0].pending_writes or ()] == ["b", "a", "a"]


async def test_sync_checkpointer_async_forms_work_on_every_backend(
    tcp: RecoveryCheckpointer,
) -> None:
    """The sync checkpointer's acopy_thread / adelete_for_runs / aprune work even where its
    saver has no async methods (they run the sync forms on a worker thread)."""
    first = tcp.put(
        {"configurable": {"thread_id": "src", "checkpoint_ns": ""}},
        empty_checkpoint(),
        {"source": "input", "step": -1, "run_id": "r-1"},  # type: ignore[typeddict-unknown-key]
        {},
    )
    tcp.put(first, empty_checkpoint(), {"source": "loop", "step": 0, "run_id": "r-2"}, {})  # type: ignore[typeddict-unknown-key]

    await tcp.acopy_thread("src", "dst")
    assert len(history(tcp, "dst")) == 2
    await tcp.adelete_for_runs(["r-1"])
    assert [t.metadata["run_id"] for t in history(tcp, "dst")] == ["r-2"]  # type: ignore[typeddict-item]
    await tcp.aprune(["src"], strategy="keep_latest")
    assert len(history(tcp, "src")) == 1
    await tcp.aprune(["src", "dst"], strategy="delete")
    assert (history(tcp, "src"), history(tcp, "dst")) == ([], [])


@pytest.mark.postgres
def test_delete_for_runs_on_postgres_frees_unreferenced_blobs(postgres_url: str) -> None:
    """On PostgreSQL the deleted checkpoints' writes and the blobs only they used go too,
    while another thread's rows stay."""
    import psycopg

    def rows(thread_id: str) -> tuple[int, int]:
        with psycopg.connect(postgres_url) as conn:
            blobs = conn.execute(
                "SELECT count(*) FROM checkpoint_blobs WHERE thread_id = %s", (thread_id,)
            ).fetchone()
            writes = conn.execute(
                "SELECT count(*) FROM checkpoint_writes WHERE thread_id = %s", (thread_id,)
            ).fetchone()
        assert blobs is not None
        assert writes is not None
        return int(blobs[0]), int(writes[0])

    with RecoveryCheckpointer.from_conn_string(postgres_url) as cp:
        cp.setup()
        graph = create_recovery_agent(
            ScriptedModel(script=[[EXPORT]]), Archive().tools(), checkpointer=cp
        )
        run = str(uuid.uuid4())
        graph.invoke(goal(), config("t", run))
        graph.invoke(goal(), config("other"))
        assert rows("t")[0] > 0
        kept = rows("other")

        cp.delete_for_runs([run])

        assert rows("t") == (0, 0)
        assert rows("other") == kept
        assert graph.get_state(config("other")).values["messages"]


def test_a_deleted_thread_forgets_its_decisions_for_good(tcp: RecoveryCheckpointer) -> None:
    """After ``delete_thread`` the thread's recorded model decisions are gone, and forgetting
    them again (a rewind of a new run under the same id) finds nothing, on every store."""
    thread_id = f"del-{uuid.uuid4().hex[:8]}"
    tcp.record_decision(thread_id, "", "digest-1", "{}")
    assert tcp.decision(thread_id, "", "digest-1") is not None
    tcp.delete_thread(thread_id)
    assert tcp.decision(thread_id, "", "digest-1") is None
    assert tcp.forget_decisions(thread_id, since=0.0) == 0
