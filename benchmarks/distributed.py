"""Many workers on PostgreSQL and Redis: throughput, lock latency, and one process's async fan-out.

1. **Threads per second with 1, 2 and 4 worker processes** on one PostgreSQL database,
   plain LangGraph against our agent, in the same run. Every thread is the same ReAct loop:
   a scripted model (no LLM latency) asks for ``--steps`` calls of a no-op side-effecting
   tool, then answers. Plain: a model node + ``ToolNode`` on ``PostgresSaver``. Ours:
   ``create_recovery_agent`` on ``RecoveryCheckpointer`` with the tool declared
   ``side_effect(idempotent=True)`` (ledger intent + commit per call, events), each run
   under its thread lease in Redis (``tp.run``). Ours runs twice: with the default
   ``checkpoint_density="every_step"`` and with ``"milestones"``. Workers take thread ids
   from one shared queue; the clock runs from the moment every worker is ready until the
   last thread ends.
2. **Lock acquire + release latency** of our Redis lease against a bare ``SET NX PX`` +
   ``DEL`` round trip pair (the rows of ``benchmarks/locks.py``, reused).
3. **One process, 16 concurrent async threads, one checkpointer** (LangGraph #7259:
   ``AsyncPostgresSaver`` funnels every call through one per-instance ``asyncio.Lock``,
   even over a pool). Raw checkpoint writes (``aput``) per second, and graph threads per
   second, for: LangGraph's saver shared by all 16 tasks; one LangGraph saver per task (the
   reference without the funnel); our ``AsyncRecoveryCheckpointer`` shared, as
   ``from_conn_string`` builds it (its saver skips the lock when it draws from a pool); and
   ours over LangGraph's saver, lock included, for contrast.

Servers come from ``tests/_services.py`` unless ``--postgres`` / ``--redis`` URLs are given.
The machine has few cores: worker counts above the core count measure contention, which is
printed with the figures. This is a benchmark, not a test: it always exits 0.
Targets (issue 7): ours >= 1.0x plain at 1, 2 and 4 workers; >= 1.5x plain at 16 async
threads in one process.

    python benchmarks/distributed.py [--threads 48] [--steps 4] [--async-writes 200]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import multiprocessing
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from types import ModuleType
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import StructuredTool

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_COUNTS = (1, 2, 4)
ASYNC_TASKS = 16
# Our agent as built by default, and with the sparsest checkpoint density.
DENSITY = {"ours": "every_step", "ours/milestones": "milestones"}


# --- the workload ---------------------------------------------------------------------------


class StepsModel(BaseChatModel):
    """Calls ``record`` until ``steps`` answers follow the last user message, then answers."""

    steps: int = 4

    @property
    def _llm_type(self) -> str:
        return "bench-steps"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> StepsModel:  # type: ignore[override]
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        last = max(i for i, m in enumerate(messages) if isinstance(m, HumanMessage))
        done = sum(isinstance(m, ToolMessage) for m in messages[last:])
        if done >= self.steps:
            message = AIMessage("done")
        else:
            call = {"name": "record", "args": {"n": done}, "id": f"call_{uuid.uuid4().hex[:12]}"}
            message = AIMessage("", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=message)])


def record(n: int) -> str:
    """A no-op side effect (the service is free, so only framework cost is measured)."""
    return f"recorded {n}"


def _tool() -> StructuredTool:
    return StructuredTool.from_function(record, name="record", description="record a step")


def plain_graph(checkpointer: Any, steps: int) -> Any:
    """The textbook LangGraph ReAct loop."""
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    model = StepsModel(steps=steps)

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    async def aagent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    from langgraph._internal._runnable import RunnableCallable

    builder = StateGraph(MessagesState)
    builder.add_node("agent", RunnableCallable(agent, aagent, name="agent"))
    builder.add_node("tools", ToolNode([_tool()]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer)


def our_agent(checkpointer: Any, leases: Any, steps: int, density: str = "every_step") -> Any:
    """The same loop on the recovery agent (whole conversation kept, as plain does).

    ``density`` is the agent's ``checkpoint_density``: ``every_step`` (the default) stores
    every checkpoint as plain LangGraph does; ``milestones`` stores the input, milestones and
    stops, and relies on the ledger and the recorded decisions for the steps between.
    """
    import taskpilots_graph as tp

    options: dict[str, Any] = {}
    parameters = inspect.signature(tp.create_recovery_agent).parameters
    if "memory_window" in parameters:
        options["memory_window"] = None  # same state as plain: the model counts answers
    if density != "every_step":
        options["checkpoint_density"] = density
    return tp.create_recovery_agent(
        StepsModel(steps=steps),
        [tp.side_effect(_tool(), idempotent=True)],
        checkpointer=checkpointer,
        leases=leases,
        **options,
    )


def _go() -> dict[str, Any]:
    return {"messages": [HumanMessage("go")]}


# --- 1. worker processes ----------------------------------------------------------------------


def _worker(
    mode: str, db: str, redis_url: str, steps: int, barrier: Any, work: Any, results: Any
) -> None:
    """One worker process: set up, wait for the start, run thread ids until none are left."""
    try:
        with ExitStack() as stack:
            if mode == "plain":
                from langgraph.checkpoint.postgres import PostgresSaver

                from taskpilots_graph.checkpointers._pg_connect import open_pool

                pool = stack.enter_context(open_pool(db, 4))
                graph = plain_graph(PostgresSaver(pool), steps)

                def run(tid: str) -> None:
                    graph.invoke(_go(), {"configurable": {"thread_id": tid}})

            else:
                import taskpilots_graph as tp
                from taskpilots_graph.locks import RedisLeaseBackend

                cp = stack.enter_context(tp.RecoveryCheckpointer.from_conn_string(db, pool_size=4))
                leases = stack.enter_context(RedisLeaseBackend(redis_url))
                agent = our_agent(cp, leases, steps, DENSITY[mode])

                def run(tid: str) -> None:
                    tp.run(agent, tid, _go())

            run(f"warm-{mode}-{os.getpid()}")  # imports, prepared statements, pool
            barrier.wait()
            done = 0
            while True:
                try:
                    tid = work.get_nowait()
                except queue.Empty:
                    break
                run(tid)
                done += 1
            results.put(("ok", done))
    except BaseException:
        barrier.abort()
        results.put(("error", traceback.format_exc()))


def processes_run(
    mode: str, workers: int, db: str, redis_url: str, threads: int, steps: int
) -> float:
    """Threads per second of ``workers`` processes of ``mode`` over ``threads`` threads."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(workers + 1, timeout=300)
    work = context.Queue()
    for i in range(threads):
        work.put(f"{mode}-{workers}-{uuid.uuid4().hex[:8]}-{i}")
    results = context.Queue()
    procs = [
        context.Process(target=_worker, args=(mode, db, redis_url, steps, barrier, work, results))
        for _ in range(workers)
    ]
    for proc in procs:
        proc.start()
    try:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            status, body = results.get(timeout=60)  # the worker that broke it says why
            raise RuntimeError(f"a {mode} worker failed to start ({status}):\n{body}") from None
        started = time.perf_counter()
        reports = [results.get(timeout=600) for _ in procs]
        elapsed = time.perf_counter() - started
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = [body for status, body in reports if status == "error"]
    if errors:
        raise RuntimeError(errors[0])
    assert sum(body for _, body in reports) == threads
    return threads / elapsed


# --- 3. one process, 16 async threads -------------------------------------------------------------


def _ours(pool: Any, *, lock_free: bool = True) -> Any:
    """``AsyncRecoveryCheckpointer`` as ``from_conn_string`` builds it (a pooled saver without
    LangGraph's per-instance lock), or over LangGraph's own saver (with the lock)."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    import taskpilots_graph as tp
    from taskpilots_graph.checkpointers._pg_savers import PooledAsyncPostgresSaver
    from taskpilots_graph.checkpointers.serde import compressed_serde

    saver = PooledAsyncPostgresSaver if lock_free else AsyncPostgresSaver
    return tp.AsyncRecoveryCheckpointer(saver(pool, serde=compressed_serde()))


async def _write_checkpoints(saver: Any, thread_id: str, writes: int) -> None:
    from langgraph.checkpoint.base import empty_checkpoint

    config: dict[str, Any] = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
    for i in range(writes):
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"step": i}
        checkpoint["channel_versions"] = {"step": i + 1}
        config = await saver.aput(
            config, checkpoint, {"source": "loop", "step": i}, {"step": i + 1}
        )


async def async_writes(db: str, variant: str, writes: int) -> float:
    """``aput`` calls per second of 16 tasks on their own threads."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    from taskpilots_graph.checkpointers._pg_connect import open_async_pool

    async with open_async_pool(db, ASYNC_TASKS + 2) as pool:
        if variant == "langgraph shared":
            savers: list[Any] = [AsyncPostgresSaver(pool)] * ASYNC_TASKS
        elif variant == "langgraph per task":
            savers = [AsyncPostgresSaver(pool) for _ in range(ASYNC_TASKS)]
        elif variant == "ours shared":
            savers = [_ours(pool)] * ASYNC_TASKS
        else:  # ours over LangGraph's saver, with its per-instance lock
            savers = [_ours(pool, lock_free=False)] * ASYNC_TASKS
        tag = uuid.uuid4().hex[:8]
        await asyncio.gather(
            *(_write_checkpoints(s, f"warm-{tag}-{i}", 5) for i, s in enumerate(savers))
        )
        started = time.perf_counter()
        await asyncio.gather(
            *(_write_checkpoints(s, f"w-{tag}-{i}", writes) for i, s in enumerate(savers))
        )
        return ASYNC_TASKS * writes / (time.perf_counter() - started)


async def async_graphs(db: str, redis_url: str, variant: str, threads: int, steps: int) -> float:
    """Graph threads per second, 16 at a time, on one checkpointer."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    import taskpilots_graph as tp
    from taskpilots_graph.checkpointers._pg_connect import open_async_pool
    from taskpilots_graph.locks import RedisLeaseBackend

    async with open_async_pool(db, ASYNC_TASKS + 2) as pool:
        leases = RedisLeaseBackend(redis_url)
        try:
            if variant == "plain langgraph":
                graph = plain_graph(AsyncPostgresSaver(pool), steps)

                async def run(tid: str) -> None:
                    await graph.ainvoke(_go(), {"configurable": {"thread_id": tid}})

            else:
                cp = _ours(pool, lock_free=not variant.endswith("LangGraph's saver"))
                agent = our_agent(cp, leases, steps, DENSITY.get(variant, "every_step"))

                async def run(tid: str) -> None:
                    await tp.arun(agent, tid, _go())

            tag = uuid.uuid4().hex[:8]
            await asyncio.gather(*(run(f"warm-{tag}-{i}") for i in range(ASYNC_TASKS)))
            ids = asyncio.Queue[str]()
            for i in range(threads):
                ids.put_nowait(f"g-{tag}-{i}")

            async def task() -> None:
                while not ids.empty():
                    await run(ids.get_nowait())

            started = time.perf_counter()
            await asyncio.gather(*(task() for _ in range(ASYNC_TASKS)))
            return threads / (time.perf_counter() - started)
        finally:
            await leases.aclose()


# --- 2. lock latency ------------------------------------------------------------------------------


def _bench_locks() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_locks", REPO_ROOT / "benchmarks" / "locks.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


# --- main -------------------------------------------------------------------------------------


def _median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=48, help="threads per worker-count run")
    parser.add_argument("--steps", type=int, default=4, help="side-effecting steps per thread")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    parser.add_argument("--async-writes", type=int, default=200, help="aput calls per task")
    parser.add_argument("--async-threads", type=int, default=64, help="graph threads (async)")
    parser.add_argument("--lock-iterations", type=int, default=2000, help="lock samples")
    parser.add_argument("--postgres", metavar="URL", help="PostgreSQL (default: throwaway)")
    parser.add_argument("--redis", metavar="URL", help="Redis (default: throwaway)")
    parser.add_argument("--skip-processes", action="store_true", help="skip part 1")
    args = parser.parse_args(argv)
    locks = _bench_locks()
    notes: list[str] = []
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}", flush=True)

    with ExitStack() as stack:
        tmpdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tp-dist-")))
        os.chmod(tmpdir, 0o755)  # the postgres OS user must be able to enter it
        redis_url = stack.enter_context(locks.redis_url(args.redis, tmpdir))
        db = stack.enter_context(locks.postgres_url(args.postgres, tmpdir))
        if not redis_url or not db:
            print("note: PostgreSQL and Redis are both needed; nothing measured")
            return
        import taskpilots_graph as tp

        with tp.RecoveryCheckpointer.from_conn_string(db) as cp:
            cp.setup()

        # 1. worker processes
        rates: dict[tuple[str, int], list[float]] = {}
        if not args.skip_processes:
            print(f"\n1. {args.threads} threads x {args.steps} steps, worker processes", flush=True)
            for workers in WORKER_COUNTS:
                for _ in range(args.repeats):
                    modes = ("plain", *DENSITY)
                    for mode in modes if workers % 2 else modes[::-1]:
                        try:
                            rate = processes_run(
                                mode, workers, db, redis_url, args.threads, args.steps
                            )
                        except Exception:
                            notes.append(f"{mode} x{workers} failed:\n{traceback.format_exc()}")
                            continue
                        rates.setdefault((mode, workers), []).append(rate)
                        line = f"  {mode:<15} {workers} worker(s): {rate:7.1f} threads/s"
                        print(line, flush=True)

        # 2. lock latency
        print(f"\n2. lock acquire + release, {args.lock_iterations} samples", flush=True)
        lock_rows: list[Any] = []
        try:
            backend = stack.enter_context(locks.RedisLeaseBackend(redis_url))
            lock_rows = locks.measure(
                {
                    "redis lease": locks.lease_op(backend),
                    "redis bare": locks.redis_bare_op(redis_url, stack),
                    "redis hold()": locks.hold_op(backend),
                },
                args.lock_iterations,
            )
        except Exception:
            notes.append(f"lock latency failed:\n{traceback.format_exc()}")

        # 3. one process, 16 async threads
        print(
            f"\n3. one process, {ASYNC_TASKS} concurrent async tasks, one checkpointer", flush=True
        )
        writes: dict[str, float] = {}
        for variant in (
            "langgraph shared",
            "langgraph per task",
            "ours shared",
            "ours over LangGraph's saver",
        ):
            try:
                writes[variant] = asyncio.run(async_writes(db, variant, args.async_writes))
                print(f"  aput/s {variant:<30} {writes[variant]:8.0f}", flush=True)
            except Exception:
                notes.append(f"async writes {variant} failed:\n{traceback.format_exc()}")
        graphs: dict[str, float] = {}
        for variant in ("plain langgraph", *DENSITY, "ours over LangGraph's saver"):
            try:
                graphs[variant] = asyncio.run(
                    async_graphs(db, redis_url, variant, args.async_threads, args.steps)
                )
                print(f"  threads/s {variant:<27} {graphs[variant]:8.1f}", flush=True)
            except Exception:
                notes.append(f"async graphs {variant} failed:\n{traceback.format_exc()}")

    for note in notes:
        print(f"note: {note}")
    print("\n=== summary ===")
    if rates:
        print(f"{'workers':>7} {'plain thr/s':>12}" + "".join(f" {m:>22}" for m in DENSITY))
        for workers in WORKER_COUNTS:
            plain = _median(rates.get(("plain", workers), []))
            cells = []
            for mode in DENSITY:
                ours = _median(rates.get((mode, workers), []))
                cells.append(f"{ours:>8.1f} thr/s {ours / plain:>6.2f}x")
            print(f"{workers:>7} {plain:>12.1f}" + "".join(f" {c:>22}" for c in cells))
        print("  (target: ours >= 1.0x plain at every worker count; medians of --repeats runs)")
    if lock_rows:
        by = {row.label: row for row in lock_rows}
        for row in lock_rows:
            print(f"{row.label:<13} median {row.median_ms:6.3f} ms  p99 {row.p99_ms:6.3f} ms")
        if "redis lease" in by and "redis bare" in by:
            ratio = by["redis lease"].median_ms / by["redis bare"].median_ms
            print(f"  redis lease / bare SET NX PX + DEL: {ratio:.2f}x median")
    if writes:
        base = writes.get("langgraph shared")
        for variant, rate in writes.items():
            ratio = f"{rate / base:.2f}x" if base else "n/a"
            print(f"aput/s  {variant:<30} {rate:8.0f}  ({ratio} of langgraph shared)")
    if graphs:
        base = graphs.get("plain langgraph")
        for variant, rate in graphs.items():
            ratio = f"{rate / base:.2f}x" if base else "n/a"
            print(f"thr/s   {variant:<30} {rate:8.1f}  ({ratio} of plain langgraph)")
        print("  (target: ours >= 1.5x plain at 16 concurrent threads in one process)")


if __name__ == "__main__":
    try:
        main()
    except Exception:  # a benchmark reports, it does not fail the build
        traceback.print_exc()
    sys.exit(0)
