"""What wrapping a LangGraph saver in ``RecoveryCheckpointer`` costs per super-step.

For each backend (memory, a SQLite file, PostgreSQL) the same small graph, a counter node
that loops for ``--steps`` super-steps, runs with ``durability="sync"`` (every checkpoint is
written before the next step starts) once on the plain LangGraph saver and once on
``RecoveryCheckpointer`` wrapping the same kind of saver. Runs are interleaved in ABBA order
so that drift (caches warming, a noisy neighbour) hits both sides alike, every run uses a
fresh thread id, and the figure reported is the median over ``--repeats`` of total run time
divided by steps. No events are appended: this measures the checkpointer itself.

PostgreSQL: plain is ``PostgresSaver.from_conn_string`` (one connection), wrapped is
``RecoveryCheckpointer.from_conn_string`` (a connection pool, the product's configuration).
Without ``--postgres URL`` a throwaway server is started with ``tests/_services.py`` when
that is importable; otherwise PostgreSQL is skipped with a note.

This is a benchmark, not a test: it always exits 0. Target: ratio <= 1.10.

    python benchmarks/checkpointer_overhead.py [--steps 50] [--repeats 20] [--postgres URL]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph

from taskpilots_graph import RecoveryCheckpointer

TARGET_RATIO = 1.10
REPO_ROOT = Path(__file__).resolve().parent.parent

SaverFactory = Callable[[], AbstractContextManager[BaseCheckpointSaver[Any]]]


class Counter(TypedDict):
    n: int
    limit: int


def _step(state: Counter) -> dict[str, int]:
    return {"n": state["n"] + 1}


def _next(state: Counter) -> str:
    return "step" if state["n"] < state["limit"] else END


def build_graph(checkpointer: BaseCheckpointSaver[Any]) -> Any:
    """One node looping on itself: one super-step (and one checkpoint) per increment."""
    builder = StateGraph(Counter)
    builder.add_node("step", _step)
    builder.add_edge(START, "step")
    builder.add_conditional_edges("step", _next, ["step", END])
    return builder.compile(checkpointer=checkpointer)


def run_once(graph: Any, steps: int) -> float:
    """Seconds per super-step of one full run on a fresh thread."""
    config = {
        "configurable": {"thread_id": f"bench-{uuid.uuid4().hex}"},
        "recursion_limit": steps + 10,
    }
    gc.collect()
    gc.disable()  # as timeit does: a collection landing in one run but not another is noise
    try:
        start = time.perf_counter()
        result = graph.invoke({"n": 0, "limit": steps}, config, durability="sync")
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    if result["n"] != steps:
        raise RuntimeError(f"graph stopped at n={result['n']}, expected {steps}")
    return elapsed / steps


@dataclass
class Result:
    backend: str
    plain_ms: float
    wrapped_ms: float

    @property
    def ratio(self) -> float:
        return self.wrapped_ms / self.plain_ms


def measure(
    backend: str,
    plain: SaverFactory,
    wrapped: SaverFactory,
    args: argparse.Namespace,
) -> Result:
    """Median seconds per step of each side, runs interleaved ABBA after one warm-up each."""
    with plain() as plain_saver, wrapped() as wrapped_saver:
        for saver in (plain_saver, wrapped_saver):
            if hasattr(saver, "setup"):
                saver.setup()
        graphs = {"plain": build_graph(plain_saver), "wrapped": build_graph(wrapped_saver)}
        for graph in graphs.values():
            run_once(graph, args.steps)  # warm-up: imports, statement caches, table pages
        times: dict[str, list[float]] = {"plain": [], "wrapped": []}
        for repeat in range(args.repeats):
            order = ("plain", "wrapped") if repeat % 2 == 0 else ("wrapped", "plain")
            for side in order:
                times[side].append(run_once(graphs[side], args.steps))
    return Result(
        backend,
        plain_ms=statistics.median(times["plain"]) * 1000,
        wrapped_ms=statistics.median(times["wrapped"]) * 1000,
    )


# --- backends -------------------------------------------------------------------------------


def memory_factories() -> tuple[SaverFactory, SaverFactory]:
    @contextmanager
    def plain() -> Iterator[BaseCheckpointSaver[Any]]:
        yield InMemorySaver()

    return plain, lambda: RecoveryCheckpointer.from_conn_string(":memory:")


def sqlite_factories(tmpdir: Path) -> tuple[SaverFactory, SaverFactory]:
    # Separate files, so neither side reads the other's pages; both in WAL mode (SqliteSaver).
    plain_path, wrapped_path = tmpdir / "plain.db", tmpdir / "wrapped.db"
    return (
        lambda: SqliteSaver.from_conn_string(str(plain_path)),
        lambda: RecoveryCheckpointer.from_conn_string(f"sqlite:///{wrapped_path}"),
    )


def postgres_factories(url: str) -> tuple[SaverFactory, SaverFactory]:
    from langgraph.checkpoint.postgres import PostgresSaver

    return (
        lambda: PostgresSaver.from_conn_string(url),
        lambda: RecoveryCheckpointer.from_conn_string(url),
    )


@contextmanager
def throwaway_postgres() -> Iterator[str | None]:
    """A private server from tests/_services.py, or None (with a printed note) if unavailable."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    try:
        from _services import ServiceError, create_database, start_postgres
    except ImportError as exc:
        print(
            f"note: PostgreSQL skipped: tests/_services.py is not importable ({exc}); "
            "pass --postgres URL"
        )
        yield None
        return
    try:
        server = start_postgres()
    except ServiceError as exc:
        print(f"note: PostgreSQL skipped: could not start a throwaway server: {exc}")
        yield None
        return
    try:
        print(f"note: started a throwaway PostgreSQL on port {server.port} (fsync on)")
        yield create_database(server.url, f"bench_{uuid.uuid4().hex}")
    finally:
        server.stop()


# --- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="super-steps per run (default 50)")
    parser.add_argument("--repeats", type=int, default=20, help="runs per side (default 20)")
    parser.add_argument(
        "--postgres", metavar="URL", help="PostgreSQL to use (default: a throwaway server)"
    )
    args = parser.parse_args(argv)
    args.steps = max(1, args.steps)
    args.repeats = max(1, args.repeats)

    results: list[Result] = []
    notes: list[str] = []

    def attempt(backend: str, factories: Callable[[], tuple[SaverFactory, SaverFactory]]) -> None:
        try:
            plain, wrapped = factories()
            result = measure(backend, plain, wrapped, args)
        except Exception:  # a benchmark reports, it does not fail
            notes.append(f"{backend} failed:\n{traceback.format_exc()}")
            return
        results.append(result)
        print(f"  {backend}: done", flush=True)

    print(
        f"checkpointer overhead: {args.steps} super-steps per run, {args.repeats} runs per "
        f'side, durability="sync"',
        flush=True,
    )
    with ExitStack() as stack:
        tmpdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tp-bench-")))
        attempt("memory", memory_factories)
        attempt("sqlite", lambda: sqlite_factories(tmpdir))
        url = args.postgres or stack.enter_context(throwaway_postgres())
        if url:
            attempt("postgres", lambda: postgres_factories(url))

    for note in notes:
        print(f"note: {note}")
    print()
    print(f"{'backend':<10} {'plain ms/step':>14} {'wrapped ms/step':>16} {'ratio':>7}")
    for r in results:
        flag = "" if r.ratio <= TARGET_RATIO else f"  (over the {TARGET_RATIO:.2f} target)"
        print(f"{r.backend:<10} {r.plain_ms:>14.3f} {r.wrapped_ms:>16.3f} {r.ratio:>6.2f}x{flag}")
    print()
    print("overhead: " + ", ".join(f"{r.backend} {r.ratio:.2f}x" for r in results))


if __name__ == "__main__":
    try:
        main()
    except Exception:  # a benchmark reports, it does not fail the build
        traceback.print_exc()
    sys.exit(0)
