"""How stored state and step time grow with a run's length: plain LangGraph against ours.

The workflow accumulates: a scripted model (no LLM, no latency) calls ``fetch_page(n)`` once
per step, each call returns 1 KB of varied JSON (search hits drawn from a vocabulary of 4,000
made-up words, so compression is not flattered), and the run ends with a final answer after
``steps`` steps. The model reads only the last observation, so it behaves the same whatever
part of the conversation it is shown.

Configurations (``--configs``), each on SQLite and on PostgreSQL:

* ``plain``: LangGraph's prebuilt agent (``langchain.agents.create_agent``, where
  ``create_react_agent`` moved in LangGraph 1.0) on LangGraph's ``SqliteSaver`` /
  ``PostgresSaver``;
* ``defaults``: ``create_recovery_agent`` with its default settings on ``RecoveryCheckpointer``;
* ``window-off``: the same with ``memory_window=None`` (the model sees every message; since
  the context budget became opt-in this is the default too, measured as a separate run);
* ``budget`` (not run unless named): the same with ``memory_window=MemoryWindow(max_tokens=
  --budget)``, what folding the model's view costs per step.

Each (backend, configuration, steps) runs once, in one process, on a fresh database with
``durability="sync"``. Reported: total stored bytes, all tables counted (SQLite: the
database file after a WAL checkpoint; PostgreSQL: ``pg_total_relation_size`` summed over
every table of the database, indexes and TOAST included); the median time per step (between
consecutive tool steps) over the run and over its last 100 steps, and the same medians of
the process's CPU time per step (informative only: the targets are on wall time); the run's
wall time; and the same medians of the time inside the model's ``invoke`` and of langchain's
part of it (``BaseChatModel.invoke`` converts, normalises and formats the whole conversation
at every call, in any agent), with how much of the step time's growth they account for.

Targets, marked met / NOT MET for our configurations: <= 25 MB stored at 1,600 steps, and
step time at the longest run <= 1.2x the step time of the 100-step run. A benchmark, not a
test: it always exits 0. Without ``--postgres URL`` a throwaway server is started with
``tests/_services.py`` when possible (otherwise PostgreSQL is skipped with a note).

    python benchmarks/state_growth.py [--steps 100 400 1600] [--postgres URL] [--no-postgres]
        [--configs plain defaults window-off budget] [--budget 8000]
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from langchain.agents import create_agent
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.sqlite import SqliteSaver

import taskpilots_graph as tp
from taskpilots_graph.window import MemoryWindow

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


MODEL_CALLS: list[tuple[float, float]] = []
"""``(seconds in the model's invoke, seconds of them in the scripted _generate)`` per model
call of the current run. The difference is langchain's ``BaseChatModel.invoke`` around a
model that reads only the last messages: it converts, normalises and formats the whole
conversation for tracing at every call, so it grows with the conversation in every agent."""

_GENERATED: list[float] = []
"""Seconds of each scripted ``_generate`` (read back by ``PagingModel.invoke``)."""


class PagingModel(BaseChatModel):
    """Calls ``fetch_page`` for step after step, reading only the last observation."""

    def invoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        started = time.perf_counter()
        before = len(_GENERATED)
        message = super().invoke(input, config, stop=stop, **kwargs)
        own = sum(_GENERATED[before:])
        MODEL_CALLS.append((time.perf_counter() - started, own))
        return message

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
        started = time.perf_counter()
        result = self._decide(messages)
        _GENERATED.append(time.perf_counter() - started)
        return result

    def _decide(self, messages: list[BaseMessage]) -> ChatResult:
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
    """LangGraph's prebuilt agent (``create_react_agent``, moved to
    ``langchain.agents.create_agent`` in LangGraph 1.0), with no middleware."""
    return create_agent(PagingModel(), [make_tool()], checkpointer=saver)


def build_ours(cp: tp.RecoveryCheckpointer, **options: Any) -> Any:
    return tp.create_recovery_agent(
        PagingModel(), [make_tool()], checkpointer=cp, max_steps=1_000_000, **options
    )


@dataclass(frozen=True)
class Config:
    """One agent set-up measured: a name, how to build it, and whether the targets apply."""

    name: str
    plain: bool
    options: dict[str, Any]
    description: str


def configs(budget: int) -> dict[str, Config]:
    return {
        "plain": Config("plain", True, {}, "langchain create_agent on LangGraph's own saver"),
        "defaults": Config("defaults", False, {}, "create_recovery_agent, default settings"),
        "window-off": Config(
            "window-off",
            False,
            {"memory_window": None},
            "create_recovery_agent(memory_window=None)",
        ),
        "budget": Config(
            "budget",
            False,
            {"memory_window": MemoryWindow(max_tokens=budget)},
            f"create_recovery_agent(memory_window=MemoryWindow(max_tokens={budget}))",
        ),
    }


@dataclass(frozen=True)
class Timing:
    """Seconds per step of one run: the median over the run and over its last steps; the
    same medians of the process's CPU time (all threads: less disturbed than the wall time
    when other work shares the machine, but blind to waits such as fsync), of the time inside
    the model's ``invoke`` (one call per step), and of that time less the scripted
    ``_generate`` (langchain's own handling of the input)."""

    median: float
    tail: float
    cpu: float
    cpu_tail: float
    model: float
    model_tail: float
    langchain: float
    langchain_tail: float


TAIL_STEPS = 100


def run(graph: Any, steps: int) -> Timing:
    """One run of ``steps`` steps on a fresh thread."""
    config = {
        "configurable": {"thread_id": f"growth-{uuid.uuid4().hex}"},
        "recursion_limit": 2 * steps + 10,
    }
    stamps: list[float] = []
    cpu: list[float] = []
    MODEL_CALLS.clear()
    _GENERATED.clear()
    for update in graph.stream(
        {"messages": [HumanMessage(json.dumps({"steps": steps}))]},
        config,
        durability="sync",
        stream_mode="updates",
    ):
        if "tools" in update or "act" in update:
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
    final = graph.get_state(config).values["messages"][-1]
    if f"read {steps} pages" not in str(final.content) or len(stamps) != steps:
        raise RuntimeError(f"run ended after {len(stamps)} of {steps} steps: {final.content!r}")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    cpu_gaps = [b - a for a, b in itertools.pairwise(cpu)]
    calls = [total for total, _ in MODEL_CALLS]
    langchain = [total - own for total, own in MODEL_CALLS]
    return Timing(
        statistics.median(gaps),
        statistics.median(gaps[-TAIL_STEPS:]),
        statistics.median(cpu_gaps),
        statistics.median(cpu_gaps[-TAIL_STEPS:]),
        statistics.median(calls),
        statistics.median(calls[-TAIL_STEPS:]),
        statistics.median(langchain),
        statistics.median(langchain[-TAIL_STEPS:]),
    )


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
    config: str
    steps: int
    stored: int
    timing: Timing
    seconds: float


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


def measure(backend: Backend, config: Config, steps: int) -> Point:
    started = time.perf_counter()
    opener = backend.open_plain if config.plain else backend.open_ours
    with opener() as saver:
        saver.setup()
        graph = build_plain(saver) if config.plain else build_ours(saver, **config.options)
        timing = run(graph, steps)
    seconds = time.perf_counter() - started
    return Point(backend.name, config.name, steps, backend.stored(), timing, seconds)


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


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _mb(n: int) -> str:
    return f"{n / 1024 / 1024:.2f} MB"


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def report(points: list[Point], chosen: Sequence[Config], notes: list[str]) -> None:
    print()
    print(
        f"{'backend':9} {'config':11} {'steps':>6} {'stored':>12} {'median step':>12} "
        f"{'last-100 step':>14} {'cpu/step':>9} {'cpu last-100':>12} {'run':>9}"
    )
    for p in points:
        print(
            f"{p.backend:9} {p.config:11} {p.steps:>6} {_mb(p.stored):>12} "
            f"{p.timing.median * 1000:9.2f} ms {p.timing.tail * 1000:11.2f} ms "
            f"{p.timing.cpu * 1000:6.2f} ms {p.timing.cpu_tail * 1000:9.2f} ms {p.seconds:8.1f}s"
        )
    print()
    print(
        f"Targets (our configurations): <= {_mb(TARGET_BYTES_AT_1600)} stored at 1600 steps; "
        f"step time at the longest run <= {TARGET_TIME_RATIO}x the 100-step run's "
        "(median over the run, and over its last 100 steps)."
    )
    for backend in dict.fromkeys(p.backend for p in points):
        for config in chosen:
            runs = sorted(
                (p for p in points if p.backend == backend and p.config == config.name),
                key=lambda p: p.steps,
            )
            if not runs:
                continue
            small, big = runs[0], runs[-1]
            head = f"{backend:9} {config.name:11}"
            parts = [f"{_mb(big.stored)} at {big.steps} steps"]
            if len(runs) > 1:
                growth = (big.stored - small.stored) / (big.steps - small.steps)
                parts.append(f"{growth / 1024:.1f} KB per added step")
            if not config.plain:
                parts.append(
                    "storage target "
                    + (
                        _verdict(big.stored <= TARGET_BYTES_AT_1600)
                        if big.steps == 1600
                        else "not checked (no 1600-step run)"
                    )
                )
            if len(runs) > 1:
                median = big.timing.median / small.timing.median
                tail = big.timing.tail / small.timing.tail
                timing = (
                    f"step time {big.steps} vs {small.steps} steps: {median:.2f}x median, "
                    f"{tail:.2f}x last-100 (CPU time: {big.timing.cpu / small.timing.cpu:.2f}x, "
                    f"{big.timing.cpu_tail / small.timing.cpu_tail:.2f}x)"
                )
                if not config.plain:
                    timing += (
                        f" (time target: median {_verdict(median <= TARGET_TIME_RATIO)}, "
                        f"last-100 {_verdict(tail <= TARGET_TIME_RATIO)})"
                    )
                parts.append(timing)
            print(f"{head} " + "; ".join(parts))
        plain = {p.steps: p for p in points if p.backend == backend and p.config == "plain"}
        for p in points:
            if p.backend == backend and p.config != "plain" and p.steps == max(plain, default=0):
                print(
                    f"{backend:9} {p.config:11} at {p.steps} steps plain stores "
                    f"{plain[p.steps].stored / p.stored:.1f}x these bytes, its steps take "
                    f"{plain[p.steps].timing.median / p.timing.median:.2f}x the time"
                )
    print()
    print(
        "Inside the model's invoke (one call per step; the scripted _generate reads only the "
        "last messages, the rest is langchain's BaseChatModel.invoke handling the whole input):"
    )
    for backend in dict.fromkeys(p.backend for p in points):
        for config in chosen:
            runs = sorted(
                (p for p in points if p.backend == backend and p.config == config.name),
                key=lambda p: p.steps,
            )
            if not runs:
                continue
            small, big = runs[0], runs[-1]
            s, b = small.timing, big.timing
            line = (
                f"{backend:9} {config.name:11} model call median {_ms(s.model)} -> "
                f"{_ms(b.model)} (langchain {_ms(s.langchain)} -> {_ms(b.langchain)}), "
                f"last-100 {_ms(s.model_tail)} -> {_ms(b.model_tail)}"
            )
            if len(runs) > 1:
                growth = (
                    ("median", b.median - s.median, b.model - s.model),
                    ("last-100", b.tail - s.tail, b.model_tail - s.model_tail),
                )
                for label, step, model in growth:
                    line += (
                        f"; {label} step {step * 1000:+.2f} ms, of which the model call "
                        f"{model * 1000:+.2f} ms and the rest {(step - model) * 1000:+.2f} ms"
                    )
                without = (b.median - (b.model - s.model)) / s.median
                line += f"; median ratio without the model call's growth {without:.2f}x"
            print(line)
    for note in notes:
        print(f"note: {note}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 400, 1600])
    parser.add_argument("--postgres", help="PostgreSQL admin URL (default: a throwaway server)")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["plain", "defaults", "window-off"],
        choices=list(configs(1)),
        help="what to measure (budget: an opt-in context budget, see --budget)",
    )
    parser.add_argument("--budget", type=int, default=8000, help="max_tokens of 'budget'")
    args = parser.parse_args(argv)
    chosen = [configs(args.budget)[name] for name in args.configs]
    notes: list[str] = []
    points: list[Point] = []
    started = datetime.now(UTC)
    print(f"started {started:%Y-%m-%d %H:%M:%S} UTC; steps {args.steps}", flush=True)
    for config in chosen:
        print(f"  {config.name}: {config.description}", flush=True)
    with tempfile.TemporaryDirectory(prefix="state-growth-") as tmp:
        for steps in args.steps:
            for config in chosen:
                path = Path(tmp) / f"{config.name}-{steps}.db"
                points.append(measure(sqlite_backend(path), config, steps))
                print(points[-1], flush=True)
                path.unlink()
        if not args.no_postgres:
            with postgres_databases(args.postgres, notes) as new_database:
                if new_database is not None:
                    for steps in args.steps:
                        for config in chosen:
                            point = measure(postgres_backend(new_database()), config, steps)
                            points.append(point)
                            print(point, flush=True)
    report(points, chosen, notes)
    print(f"finished {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
