"""What the side-effect ledger costs per side-effecting step, against plain LangGraph.

Both sides run the same ReAct loop for ``--steps`` steps: a scripted model (no LLM, no
latency) asks for one call of a side-effecting tool per step, the tool hits an in-memory
no-op service, and the run ends with a final answer. Only framework cost is measured.

* plain: the textbook LangGraph loop of ``taskpilots_graph.demo.workflow.build_plain_graph``
  (model node + ``ToolNode``), on LangGraph's ``SqliteSaver`` / ``PostgresSaver``;
* ours: ``create_recovery_agent`` with the tool declared ``side_effect(idempotent=True)``,
  on ``RecoveryCheckpointer`` (intent and commit in the ledger, events in the log; the
  commit of an idempotent tool rides the transaction of its task's ``put_writes``).

Every run uses ``durability="sync"`` (``--durability async`` for LangGraph's default: then a
side effect's intent carries the model's decision, since the step's checkpoint may not be on
disk before the call runs) and a fresh thread; runs are interleaved in ABBA order
after one warm-up each, and the figure is the median over ``--repeats`` of run time divided
by steps (so it includes the per-run start and final answer, amortised).

Durable writes are counted in separate, untimed runs:

* SQLite: ``COMMIT`` statements on the checkpointer's connection
  (``sqlite3.Connection.set_trace_callback``); each is a write transaction, fsynced (WAL,
  ``synchronous=FULL``). Each is also classified by the tables it wrote: LangGraph's
  ``checkpoints`` / ``writes`` and the recovery store's messages, ledger, events, leases.
* PostgreSQL: write transactions, i.e. transaction ids assigned during the run (the advance
  of ``pg_snapshot_xmax(pg_current_snapshot())``; read-only transactions get none), with
  autovacuum off for the benchmark's tables. Noise from other sessions on the server only
  adds, so the minimum of three runs is reported. The breakdown groups the thread's rows by
  the transaction id that last wrote them (``xmin``): a ledger entry's intent shows only
  through the events written with it, and transactions that left no row of the thread
  (leases) are not in it.

Per side-effecting step = (writes of a run of N steps) / N; "marginal" = (writes of a run of
2N steps - writes of a run of N steps) / N, which leaves out the per-run writes.

Without ``--postgres URL`` a throwaway server is started with ``tests/_services.py`` when
possible; otherwise PostgreSQL is skipped with a note. This is a benchmark, not a test: it
always exits 0. Targets: <= 1 extra durable write per side effect, <= 1.2x plain step time.

    python benchmarks/ledger_overhead.py [--steps 20] [--repeats 10] [--postgres URL]
        [--backend memory --backend sqlite --backend postgres]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sqlite3
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.sqlite import SqliteSaver

import taskpilots_graph as tp
from taskpilots_graph.demo.workflow import plain_react_graph
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.testing import answered_calls

TARGET_RATIO = 1.2
TARGET_EXTRA_WRITES = 1.0
REPO_ROOT = Path(__file__).resolve().parent.parent

# --- the workload ---------------------------------------------------------------------------


class NoopService:
    """An external service that does nothing but remember what it was asked (in memory)."""

    def __init__(self) -> None:
        self.calls = 0

    def record(self, n: int, request_key: str | None) -> str:
        self.calls += 1
        return f"rec-{n}-{request_key or 'nokey'}"[:40]


def make_tool(service: NoopService) -> BaseTool:
    def record_step(n: int) -> str:
        """Record step n in the external system (a side effect)."""
        try:
            key: str | None = tp.current_invocation().key
        except ConfigurationError:
            key = None  # plain LangGraph has no invocation key
        return service.record(n, key)

    return StructuredTool.from_function(record_step)


class StepModel(BaseChatModel):
    """Scripted model: one ``record_step`` call per step, then a final answer.

    Like a real model it gives each tool call a fresh random id. The number of steps is in
    the first human message (``{"steps": N}``), so the model is stateless.
    """

    @property
    def _llm_type(self) -> str:
        return "scripted-steps"

    def bind_tools(
        self, tools: Sequence[Any], **kwargs: Any
    ) -> Runnable[LanguageModelInput, AIMessage]:
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        first = next(m for m in messages if isinstance(m, HumanMessage))
        steps = int(json.loads(str(first.content))["steps"])
        done = answered_calls(messages)  # also counts the steps the memory window folded
        if done >= steps:
            message = AIMessage(f"recorded {done} steps")
        else:
            call = {"name": "record_step", "args": {"n": done}, "id": f"call_{uuid.uuid4().hex}"}
            message = AIMessage("", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=message)])


def build_plain(saver: BaseCheckpointSaver[Any]) -> Any:
    """The same shape as the demo's plain graph: model node + ``ToolNode``."""
    return plain_react_graph(StepModel(), [make_tool(NoopService())], saver)


def build_ours(cp: tp.RecoveryCheckpointer) -> Any:
    tool = tp.side_effect(make_tool(NoopService()), idempotent=True)
    return tp.create_recovery_agent(StepModel(), [tool], checkpointer=cp)


DURABILITY: Literal["sync", "async"] = "sync"  # set from --durability


def run_once(graph: Any, steps: int, thread_id: str | None = None) -> float:
    """Seconds of one full run of ``steps`` side-effecting steps on a fresh thread."""
    config = {
        "configurable": {"thread_id": thread_id or f"bench-{uuid.uuid4().hex}"},
        "recursion_limit": 2 * steps + 10,
    }
    gc.collect()
    start = time.perf_counter()
    result = graph.invoke(
        {"messages": [HumanMessage(json.dumps({"steps": steps}))]}, config, durability=DURABILITY
    )
    elapsed = time.perf_counter() - start
    answer = str(result["messages"][-1].content)
    if answer != f"recorded {steps} steps":
        raise RuntimeError(f"run ended without its {steps} steps: {answer!r}")
    return elapsed


# --- write counting -------------------------------------------------------------------------

_WRITE_TARGET = re.compile(
    r"^\s*(?:INSERT(?:\s+OR\s+\w+)?\s+INTO|UPDATE|DELETE\s+FROM|REPLACE\s+INTO)\s+\"?(\w+)",
    re.IGNORECASE,
)


def _source(table: str) -> str:
    """What wrote a table: LangGraph's checkpoint tables, or a part of the recovery store."""
    if not table.startswith("taskpilots"):
        return table  # checkpoints, writes
    for part in ("message", "ledger", "event", "decision", "lease", "lock"):
        if part in table:
            return f"{part}s"
    return table.removeprefix("taskpilots_")


class CommitCounter:
    """Counts COMMITs on a sqlite3 connection, by the sources of the tables each wrote."""

    def __init__(self) -> None:
        self.by_kind: dict[str, int] = {}
        self._tables: set[str] = set()

    def __call__(self, statement: str) -> None:
        if match := _WRITE_TARGET.match(statement):
            self._tables.add(match.group(1).lower())
        elif statement.strip().upper().startswith(("COMMIT", "END")):
            kind = "+".join(sorted({_source(t) for t in self._tables})) or "no rows"
            self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
            self._tables = set()

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


@dataclass
class WriteCount:
    total: float
    breakdown: dict[str, float] = field(default_factory=dict)


def count_sqlite(graph: Any, conn: sqlite3.Connection, steps: int) -> WriteCount:
    counter = CommitCounter()
    conn.set_trace_callback(counter)
    try:
        run_once(graph, steps)
    finally:
        conn.set_trace_callback(None)
    return WriteCount(counter.total, dict(counter.by_kind))


def _xmax(url: str) -> int:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text").fetchone()
    assert row is not None
    return int(row[0])


# The tables holding a thread's rows, by source. A row carries the id of the transaction
# that last wrote it (xmin): rows sharing one were committed together. A ledger entry is
# written twice (intent, commit) and keeps the second id only; the events written with the
# intent still carry the first.
_PG_TABLES = {
    "checkpoints": "checkpoints",
    "checkpoint_blobs": "checkpoints",
    "checkpoint_writes": "writes",
    "taskpilots_messages": "messages",
    "taskpilots_message_seqs": "messages",
    "taskpilots_message_refs": "messages",
    "taskpilots_ledger": "ledgers",
    "taskpilots_events": "events",
    "taskpilots_decisions": "decisions",
}


def pg_breakdown(url: str, thread_id: str) -> dict[str, int]:
    """The thread's write transactions by the sources of the rows each left behind."""
    import psycopg

    sources: dict[str, set[str]] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        for table, source in _PG_TABLES.items():
            if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone() == (None,):
                continue
            rows = conn.execute(
                f"SELECT DISTINCT xmin::text FROM {table} WHERE thread_id = %s", (thread_id,)
            )
            for (xid,) in rows:
                sources.setdefault(xid, set()).add(source)
    kinds: dict[str, int] = {}
    for found in sources.values():
        kind = "+".join(sorted(found))
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def count_postgres(graph: Any, url: str, steps: int) -> WriteCount:
    samples = []
    for _ in range(3):
        before = _xmax(url)
        thread_id = f"bench-{uuid.uuid4().hex}"
        run_once(graph, steps, thread_id)
        samples.append(_xmax(url) - before)
    return WriteCount(min(samples), {k: float(n) for k, n in pg_breakdown(url, thread_id).items()})


def disable_autovacuum(url: str) -> None:
    """Autoanalyze writes pg_statistic in transactions of its own: keep it out of the counts."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            ).fetchall()
        ]
        for table in tables:
            conn.execute(
                f'ALTER TABLE "{table}" SET (autovacuum_enabled = false, '
                "toast.autovacuum_enabled = false)"
            )


# --- one backend ----------------------------------------------------------------------------


@dataclass
class Result:
    backend: str
    steps: int
    plain_ms: float
    ours_ms: float
    plain_writes: WriteCount
    ours_writes: WriteCount
    plain_marginal: float
    ours_marginal: float
    what: str

    @property
    def ratio(self) -> float:
        return self.ours_ms / self.plain_ms

    @property
    def extra_writes(self) -> float:
        return (self.ours_writes.total - self.plain_writes.total) / self.steps

    @property
    def extra_marginal(self) -> float:
        return self.ours_marginal - self.plain_marginal


Opener = Callable[[], AbstractContextManager[Any]]


def measure(
    backend: str,
    open_plain: Opener,
    open_ours: Opener,
    count: Callable[[Any, Any, int], WriteCount] | None,
    handle: Callable[[Any], Any],
    what: str,
    args: argparse.Namespace,
    after_setup: Callable[[], None] | None = None,
) -> Result:
    steps = args.steps
    with open_plain() as plain_saver, open_ours() as cp:
        if hasattr(plain_saver, "setup"):
            plain_saver.setup()
        cp.setup()
        graphs = {"plain": build_plain(plain_saver), "ours": build_ours(cp)}
        for graph in graphs.values():
            run_once(graph, steps)  # warm-up: imports, statement caches, table pages
        if after_setup is not None:
            after_setup()
        times: dict[str, list[float]] = {"plain": [], "ours": []}
        for repeat in range(args.repeats):
            order = ("plain", "ours") if repeat % 2 == 0 else ("ours", "plain")
            for side in order:
                times[side].append(run_once(graphs[side], steps) / steps)
        nothing = (WriteCount(float("nan")), WriteCount(float("nan")))
        counts = {
            side: (
                count(graphs[side], handle(saver), steps),
                count(graphs[side], handle(saver), 2 * steps),
            )
            if count is not None
            else nothing
            for side, saver in (("plain", plain_saver), ("ours", cp))
        }
    return Result(
        backend,
        steps,
        plain_ms=statistics.median(times["plain"]) * 1000,
        ours_ms=statistics.median(times["ours"]) * 1000,
        plain_writes=counts["plain"][0],
        ours_writes=counts["ours"][0],
        plain_marginal=(counts["plain"][1].total - counts["plain"][0].total) / steps,
        ours_marginal=(counts["ours"][1].total - counts["ours"][0].total) / steps,
        what=what,
    )


def memory_backend(args: argparse.Namespace) -> Result:
    """No durable writes at all: what the ledger protocol costs in CPU alone."""
    from langgraph.checkpoint.memory import InMemorySaver

    @contextmanager
    def open_plain() -> Iterator[InMemorySaver]:
        yield InMemorySaver()

    return measure(
        "memory",
        open_plain,
        lambda: tp.RecoveryCheckpointer.from_conn_string(":memory:"),
        None,
        lambda saver: saver,
        "-",
        args,
    )


def sqlite_backend(tmpdir: Path, args: argparse.Namespace) -> Result:
    # Separate files, so neither side reads the other's pages; both WAL, synchronous=FULL.
    plain_path, ours_path = tmpdir / "plain.db", tmpdir / "ours.db"

    @contextmanager
    def open_plain() -> Iterator[SqliteSaver]:
        with SqliteSaver.from_conn_string(str(plain_path)) as saver:
            yield saver

    def conn_of(saver: Any) -> sqlite3.Connection:
        inner = saver.inner if isinstance(saver, tp.RecoveryCheckpointer) else saver
        conn: sqlite3.Connection = inner.conn
        return conn

    return measure(
        "sqlite",
        open_plain,
        lambda: tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{ours_path}"),
        count_sqlite,
        conn_of,
        "COMMITs",
        args,
    )


def postgres_backend(url: str, args: argparse.Namespace) -> Result:
    from langgraph.checkpoint.postgres import PostgresSaver

    return measure(
        "postgres",
        lambda: PostgresSaver.from_conn_string(url),
        lambda: tp.RecoveryCheckpointer.from_conn_string(url),
        count_postgres,
        lambda _saver: url,
        "write xacts",
        args,
        after_setup=lambda: disable_autovacuum(url),
    )


@contextmanager
def throwaway_postgres(notes: list[str]) -> Iterator[str | None]:
    """A private server from tests/_services.py, or None (with a note) if unavailable."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    try:
        from _services import ServiceError, create_database, start_postgres
    except ImportError as exc:
        notes.append(f"PostgreSQL skipped: tests/_services.py is not importable ({exc})")
        yield None
        return
    try:
        server = start_postgres()
    except ServiceError as exc:
        notes.append(f"PostgreSQL skipped: could not start a throwaway server: {exc}")
        yield None
        return
    try:
        print(f"started a throwaway PostgreSQL on port {server.port} (fsync on)", flush=True)
        yield create_database(server.url, f"bench_{uuid.uuid4().hex}")
    finally:
        server.stop()


# --- main -----------------------------------------------------------------------------------


def _report(results: list[Result], notes: list[str]) -> None:
    for note in notes:
        print(f"note: {note}")
    print()
    head = (
        f"{'backend':<9} {'plain ms/step':>13} {'ours ms/step':>12} {'ratio':>6}  "
        f"{'unit':<11} {'plain w/step':>12} {'ours w/step':>11} {'extra':>6} "
        f"{'marginal extra':>14}"
    )
    print(head)
    for r in results:
        if r.what == "-":
            writes = f"{'-':<11} {'-':>12} {'-':>11} {'-':>6} {'-':>14}"
        else:
            writes = (
                f"{r.what:<11} {r.plain_writes.total / r.steps:>12.2f} "
                f"{r.ours_writes.total / r.steps:>11.2f} {r.extra_writes:>6.2f} "
                f"{r.extra_marginal:>14.2f}"
            )
        print(f"{r.backend:<9} {r.plain_ms:>13.3f} {r.ours_ms:>12.3f} {r.ratio:>5.2f}x  {writes}")
    for r in results:
        if r.ours_writes.breakdown:
            parts = ", ".join(
                f"{kind} {n / r.steps:.2f}" for kind, n in sorted(r.ours_writes.breakdown.items())
            )
            plain = ", ".join(
                f"{kind} {n / r.steps:.2f}" for kind, n in sorted(r.plain_writes.breakdown.items())
            )
            unit = "COMMITs" if r.backend == "sqlite" else "write xacts (last run; by rows left)"
            print(f"{r.backend} {unit} per step by tables written: ours: {parts}; plain: {plain}")
    print()
    for r in results:
        if r.what == "-":
            print(f"{r.backend}: ratio: {r.ratio:.2f} (CPU only, no durable writes)")
            continue
        time_flag = "ok" if r.ratio <= TARGET_RATIO else f"over the {TARGET_RATIO}x target"
        write_flag = (
            "ok"
            if r.extra_writes <= TARGET_EXTRA_WRITES
            else f"over the {TARGET_EXTRA_WRITES:g} target"
        )
        print(
            f"{r.backend}: extra durable writes per side effect: {r.extra_writes:.2f} "
            f"({write_flag}; marginal {r.extra_marginal:.2f})"
        )
        print(f"{r.backend}: ratio: {r.ratio:.2f} ({time_flag})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="side-effecting steps per run")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per side")
    parser.add_argument("--postgres", metavar="URL", help="PostgreSQL (default: throwaway)")
    parser.add_argument(
        "--backend",
        action="append",
        choices=("memory", "sqlite", "postgres"),
        help="measure only these backends (repeatable; default: all three)",
    )
    parser.add_argument("--durability", choices=("sync", "async"), default="sync")
    args = parser.parse_args(argv)
    global DURABILITY
    DURABILITY = args.durability
    args.steps = max(1, args.steps)
    args.repeats = max(1, args.repeats)
    backends = set(args.backend or ("memory", "sqlite", "postgres"))

    results: list[Result] = []
    notes: list[str] = []

    def attempt(backend: str, run: Callable[[], Result]) -> None:
        try:
            results.append(run())
        except Exception:  # a benchmark reports, it does not fail
            notes.append(f"{backend} failed:\n{traceback.format_exc()}")
            return
        print(f"  {backend}: done", flush=True)

    print(
        f"ledger overhead: {args.steps} side-effecting steps per run, {args.repeats} runs per "
        f'side, durability="{DURABILITY}"',
        flush=True,
    )
    with ExitStack() as stack:
        tmpdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tp-ledger-")))
        if "memory" in backends:
            attempt("memory", lambda: memory_backend(args))
        if "sqlite" in backends:
            attempt("sqlite", lambda: sqlite_backend(tmpdir, args))
        if "postgres" not in backends:
            url = None
        else:
            url = args.postgres or stack.enter_context(throwaway_postgres(notes))
        if url:
            if args.postgres:
                notes.append(
                    "write counts on --postgres count every write transaction of the server "
                    "during a run; other sessions inflate them (min of 3 runs reported)"
                )
            attempt("postgres", lambda: postgres_backend(url, args))
    _report(results, notes)


if __name__ == "__main__":
    try:
        main()
    except Exception:  # a benchmark reports, it does not fail the build
        traceback.print_exc()
    sys.exit(0)
