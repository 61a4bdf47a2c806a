"""What a fenced lease costs per acquire + release, next to the bare primitive it is built on.

Rows (each one acquire followed by one release of a fresh name, sync client, one process):

* ``redis lease``: ``RedisLeaseBackend`` (one Lua script each way: SET NX PX + INCR fencing,
  compare-and-delete), against ``redis bare``: ``SET key token NX PX ttl`` then ``DEL key``
  on the same server, the cheapest lock-shaped pair of round trips Redis offers (no fencing,
  no ownership check on release).
* ``postgres lease``: ``PostgresLeaseBackend`` (the fenced UPSERT with synchronous commit,
  then a compare-and-delete), against ``postgres bare``: ``INSERT ... ON CONFLICT DO NOTHING``
  then ``DELETE`` on a scratch table (no fencing, no synchronous-commit switch) through
  the same kind of pool.
* ``redis hold()``: the whole ``with hold(...)`` block (acquire, heartbeat thread start and
  stop, release), to show what the helper adds on top of the backend.
* ``sqlite lease`` (fewer iterations: each commit waits for fsync).

The two sides of a pair are interleaved per iteration, so drift hits both alike. Figures are
the median and p99 over ``--iterations`` after a warm-up. Without ``--redis`` / ``--postgres``
URLs throwaway servers are started with ``tests/_services.py``.

This is a benchmark, not a test: it always exits 0.

    python benchmarks/locks.py [--iterations 2000] [--redis URL] [--postgres URL]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taskpilots_graph.locks import (
    PostgresLeaseBackend,
    RedisLeaseBackend,
    SqliteLeaseBackend,
    hold,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
TTL_S = 30.0
WARMUP = 50

Op = Callable[[str], None]


@dataclass
class Row:
    label: str
    times: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times) * 1000

    @property
    def p99_ms(self) -> float:
        ordered = sorted(self.times)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1000


def measure(ops: dict[str, Op], iterations: int) -> list[Row]:
    """Time each op ``iterations`` times, interleaved (A B A B ...), after a warm-up."""
    for op in ops.values():
        for _ in range(WARMUP):
            op(f"warm-{uuid.uuid4().hex}")
    times: dict[str, list[float]] = {label: [] for label in ops}
    gc.collect()
    gc.disable()  # a collection landing in one sample but not another is noise
    try:
        for i in range(iterations):
            labels = list(ops) if i % 2 == 0 else list(reversed(ops))
            for label in labels:
                name = f"bench-{i}-{label}"
                start = time.perf_counter()
                ops[label](name)
                times[label].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return [Row(label, samples) for label, samples in times.items()]


# --- the operations -----------------------------------------------------------------------------


def lease_op(backend: Any) -> Op:
    def op(name: str) -> None:
        lease = backend.acquire(name, "bench", TTL_S)
        if lease is None or not backend.release(lease):
            raise RuntimeError(f"lease {name!r} was not acquired and released")

    return op


def hold_op(backend: Any) -> Op:
    def op(name: str) -> None:
        with hold(backend, name, ttl=TTL_S):
            pass

    return op


def redis_bare_op(url: str, stack: ExitStack) -> Op:
    import redis

    client = stack.enter_context(redis.Redis.from_url(url))
    ttl_ms = int(TTL_S * 1000)

    def op(name: str) -> None:
        key = f"bare:{name}"
        if not client.set(key, "token", nx=True, px=ttl_ms):
            raise RuntimeError(f"{key} was taken")
        client.delete(key)

    return op


def postgres_bare_op(url: str, stack: ExitStack) -> Op:
    from psycopg_pool import ConnectionPool

    from taskpilots_graph.checkpointers._pg_connect import CONNECTION_KWARGS

    pool: ConnectionPool[Any] = stack.enter_context(
        ConnectionPool(url, min_size=1, max_size=4, kwargs=dict(CONNECTION_KWARGS), open=True)
    )
    with pool.connection() as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_bare (name TEXT PRIMARY KEY, owner TEXT NOT NULL)"
        )

    def op(name: str) -> None:
        with pool.connection() as conn:
            inserted = conn.execute(
                "INSERT INTO bench_bare (name, owner) VALUES (%s, 'bench') "
                "ON CONFLICT (name) DO NOTHING",
                (name,),
            ).rowcount
            if inserted != 1:
                raise RuntimeError(f"{name} was taken")
            conn.execute("DELETE FROM bench_bare WHERE name = %s", (name,))

    return op


# --- servers -------------------------------------------------------------------------------------


def _services() -> Any:
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    import _services

    return _services


@contextmanager
def redis_url(given: str | None, tmpdir: Path) -> Iterator[str | None]:
    if given:
        yield given
        return
    try:
        server = _services().start_redis(tmpdir)
    except Exception as exc:
        print(f"note: Redis skipped: could not start a throwaway server: {exc}")
        yield None
        return
    try:
        print(f"note: started a throwaway Redis on port {server.port}")
        yield server.url
    finally:
        server.stop()


@contextmanager
def postgres_url(given: str | None, tmpdir: Path) -> Iterator[str | None]:
    if given:
        yield given
        return
    try:
        services = _services()
        server = services.start_postgres(tmpdir)
    except Exception as exc:
        print(f"note: PostgreSQL skipped: could not start a throwaway server: {exc}")
        yield None
        return
    try:
        print(f"note: started a throwaway PostgreSQL on port {server.port} (fsync on)")
        yield services.create_database(server.url, f"bench_{uuid.uuid4().hex}")
    finally:
        server.stop()


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000, help="samples per row")
    parser.add_argument("--sqlite-iterations", type=int, default=100, help="samples for SQLite")
    parser.add_argument("--redis", metavar="URL", help="Redis to use (default: a throwaway one)")
    parser.add_argument("--postgres", metavar="URL", help="PostgreSQL (default: a throwaway one)")
    args = parser.parse_args(argv)
    iterations = max(1, args.iterations)

    rows: list[Row] = []
    notes: list[str] = []

    def attempt(what: str, run: Callable[[], list[Row]]) -> None:
        try:
            rows.extend(run())
        except Exception:  # a benchmark reports, it does not fail
            notes.append(f"{what} failed:\n{traceback.format_exc()}")
            return
        print(f"  {what}: done", flush=True)

    print(f"lease acquire + release: {iterations} samples per row, ttl {TTL_S:g} s", flush=True)
    with ExitStack() as stack:
        tmpdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tp-bench-")))
        os.chmod(tmpdir, 0o755)  # the postgres OS user must be able to enter it

        url = stack.enter_context(redis_url(args.redis, tmpdir))
        if url:

            def redis_rows() -> list[Row]:
                backend = stack.enter_context(RedisLeaseBackend(url))
                ops = {
                    "redis lease": lease_op(backend),
                    "redis bare": redis_bare_op(url, stack),
                    "redis hold()": hold_op(backend),
                }
                return measure(ops, iterations)

            attempt("redis", redis_rows)

        pg = stack.enter_context(postgres_url(args.postgres, tmpdir))
        if pg:

            def postgres_rows() -> list[Row]:
                backend = stack.enter_context(PostgresLeaseBackend(pg))
                backend.setup()
                ops = {
                    "postgres lease": lease_op(backend),
                    "postgres bare": postgres_bare_op(pg, stack),
                }
                return measure(ops, iterations)

            attempt("postgres", postgres_rows)

        def sqlite_rows() -> list[Row]:
            backend = SqliteLeaseBackend(str(tmpdir / "leases.db"))
            return measure({"sqlite lease": lease_op(backend)}, max(1, args.sqlite_iterations))

        attempt("sqlite", sqlite_rows)

    for note in notes:
        print(f"note: {note}")
    by_label = {row.label: row for row in rows}
    print()
    print(f"{'operation':<16} {'median ms':>10} {'p99 ms':>9} {'samples':>8}")
    for row in rows:
        print(f"{row.label:<16} {row.median_ms:>10.3f} {row.p99_ms:>9.3f} {len(row.times):>8}")
    print()
    for lease, bare in (("redis lease", "redis bare"), ("postgres lease", "postgres bare")):
        if lease in by_label and bare in by_label:
            a, b = by_label[lease], by_label[bare]
            print(
                f"{lease} / {bare}: median {a.median_ms / b.median_ms:.2f}x, "
                f"p99 {a.p99_ms / b.p99_ms:.2f}x"
            )
    if "redis hold()" in by_label and "redis lease" in by_label:
        extra = by_label["redis hold()"].median_ms - by_label["redis lease"].median_ms
        print(f"hold() over the bare redis lease: +{extra:.3f} ms median (heartbeat thread)")


if __name__ == "__main__":
    try:
        main()
    except Exception:  # a benchmark reports, it does not fail the build
        traceback.print_exc()
    sys.exit(0)
