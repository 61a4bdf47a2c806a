"""How stored state grows with the length of a run: plain LangGraph against our agent.

The workflow accumulates: a scripted model (no LLM, no latency) calls ``fetch_page(n)`` once
per step, each call returns a 1 KB observation, and the run ends with a final answer after
``steps`` steps. The model only reads the last observation (``{"n": ...}``), so it works the
same with every message kept (plain) or with a memory window (ours).

* plain: model node + ``ToolNode`` over ``MessagesState`` on LangGraph's ``SqliteSaver`` /
  ``PostgresSaver``: every checkpoint re-stores the whole conversation, so the bytes grow
  quadratically with the steps;
* ours: ``create_recovery_agent`` with its defaults (memory window, observation policy,
  ``every_step`` density) on ``RecoveryCheckpointer``: the state is bounded and the event log
  keeps the full trail once.

Each (backend, side, steps) runs once on a fresh database with ``durability="sync"``.
Reported: total stored bytes, all tables counted (SQLite: the database file after a WAL
checkpoint; PostgreSQL: ``pg_total_relation_size`` summed over every table of the database,
indexes and TOAST included), and the median time per step (between consecutive tool steps).

Targets: our stored bytes grow linearly (<= 25 MB at 1,600 steps) and our median step time
at 1,600 steps is <= 1.2x our time at 100 steps. A benchmark, not a test: it always exits 0.

    python benchmarks/state_growth.py [--steps 100 400 1600] [--postgres URL] [--no-postgres]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.sqlite import SqliteSaver

import taskpilots_graph as tp
from taskpilots_graph.demo.workflow import plain_react_graph

TARGET_BYTES_AT_1600 = 25 * 1024 * 1024
TARGET_TIME_RATIO = 1.2
OBSERVATION_BYTES = 1024
REPO_ROOT = Path(__file__).resolve().parent.parent


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10)))


_VOCABULARY = random.Random(0)
_WORDS = [_word(_VOCABULARY) for _ in range(4000)]


def fetch_page(n: int) -> str:
    """A 1 KB observation for step ``n``: JSON search hits of pseudo-random words.

    Varied text (a vocabulary of 4,000 made-up words drawn at random per step), so that the
    stored bytes are not flattered by compressing a repeated filler.
    """
    rng = random.Random(n)
    hits: list[dict[str, Any]] = []
    page = {"n": n, "hits": hits}
    while True:
        hit = {
            "id": f"doc-{rng.randrange(10**6)}",
            "score": round(rng.random(), 3),
            "snippet": " ".join(rng.choice(_WORDS) for _ in range(12)),
        }
        if len(json.dumps({**page, "hits": [*hits, hit]})) > OBSERVATION_BYTES:
            break
        hits.append(hit)
    text = json.dumps(page)
    return text + " " * (OBSERVATION_BYTES - len(text))


def make_tool() -> BaseTool:
    return StructuredTool.from_function(fetch_page)


class PagingModel(BaseChatModel):
    """Calls ``fetch_page`` for step after step, reading only the last observation."""

    @property
    def _llm_type(self) -> str:
        return "scripted-paging"

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
        last = next((m for m in reversed(messages) if isinstance(m, ToolMessage)), None)
        done = 0 if last is None else int(json.loads(str(last.content))["n"]) + 1
        if done >= steps:
            message = AIMessage(f"read {done} pages")
        else:
            call = {"name": "fetch_page", "args": {"n": done}, "id": f"call_{uuid.uuid4().hex}"}
            message = AIMessage("", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=message)])


def build_plain(saver: BaseCheckpointSaver[Any]) -> Any:
    """The same shape as the demo's plain graph: model node + ``ToolNode``."""
    return plain_react_graph(PagingModel(), [make_tool()], saver)


def build_ours(cp: tp.RecoveryCheckpointer) -> Any:
    return tp.create_recovery_agent(
        PagingModel(), [make_tool()], checkpointer=cp, max_steps=1_000_000
    )


def run(graph: Any, steps: int) -> float:
    """One run of ``steps`` steps on a fresh thread; the median seconds per step."""
    config = {
        "configurable": {"thread_id": f"growth-{uuid.uuid4().hex}"},
        "recursion_limit": 2 * steps + 10,
    }
    stamps: list[float] = []
    for update in graph.stream(
        {"messages": [HumanMessage(json.dumps({"steps": steps}))]},
        config,
        durability="sync",
        stream_mode="updates",
    ):
        if "tools" in update or "act" in update:
            stamps.append(time.perf_counter())
    final = graph.get_state(config).values["messages"][-1]
    if f"read {steps} pages" not in str(final.content) or len(stamps) != steps:
        raise RuntimeError(f"run ended after {len(stamps)} of {steps} steps: {final.content!r}")
    return statistics.median(b - a for a, b in itertools.pairwise(stamps))


# --- storage --------------------------------------------------------------------------------


def sqlite_bytes(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_count = conn.execute("PRAGMA page_count").fetchone()[0]
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    return int(page_count * page_size)


def postgres_bytes(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relkind IN ('r', 'p', 'm') "
            "AND n.nspname NOT IN ('pg_catalog', 'information_schema')"
        ).fetchone()
    return int(row[0]) if row else 0


@dataclass
class Point:
    backend: str
    side: str
    steps: int
    stored: int
    step_ms: float


@dataclass
class Backend:
    name: str
    open_plain: Callable[[], AbstractContextManager[Any]]
    open_ours: Callable[[], AbstractContextManager[tp.RecoveryCheckpointer]]
    stored: Callable[[], int]


def sqlite_backend(path: Path) -> Backend:
    def open_plain() -> AbstractContextManager[Any]:
        return SqliteSaver.from_conn_string(str(path))

    def open_ours() -> AbstractContextManager[tp.RecoveryCheckpointer]:
        return tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{path}")

    return Backend("sqlite", open_plain, open_ours, lambda: sqlite_bytes(path))


def postgres_backend(url: str) -> Backend:
    from langgraph.checkpoint.postgres import PostgresSaver

    def open_plain() -> AbstractContextManager[Any]:
        return PostgresSaver.from_conn_string(url)

    def open_ours() -> AbstractContextManager[tp.RecoveryCheckpointer]:
        return tp.RecoveryCheckpointer.from_conn_string(url)

    return Backend("postgres", open_plain, open_ours, lambda: postgres_bytes(url))


def measure(backend: Backend, side: str, steps: int) -> Point:
    opener = backend.open_plain if side == "plain" else backend.open_ours
    with opener() as saver:
        saver.setup()
        graph = build_plain(saver) if side == "plain" else build_ours(saver)
        step = run(graph, steps)
    return Point(backend.name, side, steps, backend.stored(), step * 1000)


@contextmanager
def postgres_databases(url: str | None, notes: list[str]) -> Iterator[Callable[[], str] | None]:
    """A factory of fresh databases on ``url`` or on a throwaway server, or None."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from _services import ServiceError, create_database, start_postgres

    server = None
    if url is None:
        try:
            server = start_postgres()
        except ServiceError as exc:
            notes.append(f"PostgreSQL skipped: could not start a throwaway server: {exc}")
            yield None
            return
        url = server.url
        print(f"started a throwaway PostgreSQL on port {server.port} (fsync on)", flush=True)
    admin = url
    try:
        yield lambda: create_database(admin, f"growth_{uuid.uuid4().hex[:12]}")
    finally:
        if server is not None:
            server.stop()


def _mb(n: int) -> str:
    return f"{n / 1024 / 1024:8.2f} MB"


def report(points: list[Point], notes: list[str]) -> None:
    print()
    print(f"{'backend':9} {'side':6} {'steps':>6} {'stored':>12} {'median step':>12}")
    for p in points:
        print(f"{p.backend:9} {p.side:6} {p.steps:>6} {_mb(p.stored)} {p.step_ms:9.2f} ms")
    print()
    for backend in sorted({p.backend for p in points}):
        ours = sorted(
            (p for p in points if p.backend == backend and p.side == "ours"), key=lambda p: p.steps
        )
        plain = {p.steps: p for p in points if p.backend == backend and p.side == "plain"}
        if len(ours) < 2:
            continue
        small, big = ours[0], ours[-1]
        growth = (big.stored - small.stored) / (big.steps - small.steps)
        ratio = big.step_ms / small.step_ms
        bytes_ok = big.steps != 1600 or big.stored <= TARGET_BYTES_AT_1600
        print(
            f"{backend}: ours {_mb(big.stored).strip()} at {big.steps} steps "
            f"({growth / 1024:.1f} KB per added step; target <= "
            f"{_mb(TARGET_BYTES_AT_1600).strip()} at 1600: {'met' if bytes_ok else 'MISSED'}); "
            f"step time {big.steps} vs {small.steps} steps: {ratio:.2f}x "
            f"(target <= {TARGET_TIME_RATIO}: {'met' if ratio <= TARGET_TIME_RATIO else 'MISSED'})"
        )
        if big.steps in plain:
            p = plain[big.steps]
            print(
                f"{backend}: at {big.steps} steps plain stores {p.stored / big.stored:.1f}x our "
                f"bytes; plain step time {p.step_ms / plain[small.steps].step_ms:.2f}x its "
                f"{small.steps}-step time"
                if small.steps in plain
                else ""
            )
    for note in notes:
        print(f"note: {note}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 400, 1600])
    parser.add_argument("--postgres", help="PostgreSQL admin URL (default: a throwaway server)")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--sides", nargs="+", default=["plain", "ours"])
    args = parser.parse_args(argv)
    notes: list[str] = []
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="state-growth-") as tmp:
        for steps in args.steps:
            for side in args.sides:
                path = Path(tmp) / f"{side}-{steps}.db"
                points.append(measure(sqlite_backend(path), side, steps))
                print(points[-1], flush=True)
                path.unlink()
        if not args.no_postgres:
            with postgres_databases(args.postgres, notes) as new_database:
                if new_database is not None:
                    for steps in args.steps:
                        for side in args.sides:
                            points.append(measure(postgres_backend(new_database()), side, steps))
                            print(points[-1], flush=True)
    report(points, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
