"""Fixtures giving tests real PostgreSQL and Redis servers (see `_services` for why real).

One server of each kind per session keeps the suite fast; isolation comes from a fresh
database per test (PostgreSQL) and FLUSHALL before each test (Redis). Server URLs are also
exported through the environment so that crash-drill subprocesses can reach the same servers.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import redis
from _services import (
    RedisServer,
    ServiceUnavailable,
    create_database,
    drop_database,
    skip_or_fail,
    start_postgres,
    start_redis,
)
from psycopg import sql

POSTGRES_URL_ENV = "TASKPILOTS_TEST_POSTGRES_URL"
REDIS_URL_ENV = "TASKPILOTS_TEST_REDIS_URL"

_T = TypeVar("_T")


def _start(start: Callable[[], _T]) -> _T:
    """Start a server; a machine without it skips the test, or fails it in CI."""
    try:
        return start()
    except ServiceUnavailable as exc:
        skip_or_fail(str(exc))


@pytest.fixture(scope="session")
def postgres_admin_url() -> Iterator[str]:
    """URL of the session's PostgreSQL superuser database (or the one given in the env)."""
    if existing := os.environ.get(POSTGRES_URL_ENV):
        yield existing
        return
    # Default tmpdir, not tmp_path_factory: as root the server runs as `postgres`, which
    # cannot enter pytest's private /tmp/pytest-of-root. stop() removes the directory.
    server = _start(start_postgres)
    os.environ[POSTGRES_URL_ENV] = server.url
    try:
        yield server.url
    finally:
        os.environ.pop(POSTGRES_URL_ENV, None)
        server.stop()


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """URL of a new, empty database of its own for this test; dropped afterwards."""
    name = f"t_{uuid.uuid4().hex}"
    url = create_database(postgres_admin_url, name)
    yield url
    drop_database(postgres_admin_url, name)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The session's Redis; tests may not stop it (start a dedicated one for outage tests)."""
    server = _start(lambda: start_redis(tmp_path_factory.mktemp("redis")))
    os.environ[REDIS_URL_ENV] = server.url
    try:
        yield server
    finally:
        os.environ.pop(REDIS_URL_ENV, None)
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session's Redis, emptied so no test sees another's keys."""
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    return redis_server.url


@pytest.fixture
def sqlite_path(tmp_path: Path) -> str:
    """Path (not yet created) for a per-test SQLite database file."""
    return str(tmp_path / "runs.db")


# --- a backend switch for tests of the recovery agent ---------------------------------------


@pytest.fixture(scope="module")
def postgres_db(postgres_admin_url: str) -> Iterator[str]:
    """One set-up PostgreSQL database per test module (a new one per test costs ~1 s)."""
    from taskpilots_graph import RecoveryCheckpointer

    name = f"t_{uuid.uuid4().hex}"
    url = create_database(postgres_admin_url, name)
    with RecoveryCheckpointer.from_conn_string(url) as saver:
        saver.setup()
    yield url
    drop_database(postgres_admin_url, name)


def _emptied(url: str) -> str:
    """Delete every row except the schema versions: the database is as good as new."""
    with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
        tables = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
            "AND tablename NOT LIKE '%migrations'"
        ).fetchall()
        for (table,) in tables:
            conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(table)))
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def conn_string(request: pytest.FixtureRequest) -> str:
    """Connection string of an empty, set-up database: a SQLite file or a PostgreSQL DB."""
    if request.param == "sqlite":
        return f"sqlite:///{request.getfixturevalue('sqlite_path')}"
    return _emptied(request.getfixturevalue("postgres_db"))


@pytest.fixture
def cp(conn_string: str) -> Iterator[Any]:
    """A set-up ``RecoveryCheckpointer`` on the test's database."""
    from taskpilots_graph import RecoveryCheckpointer

    with RecoveryCheckpointer.from_conn_string(conn_string) as saver:
        saver.setup()
        yield saver


@pytest.fixture
async def acp(conn_string: str) -> AsyncIterator[Any]:
    """A set-up ``AsyncRecoveryCheckpointer`` on the test's database."""
    from taskpilots_graph import AsyncRecoveryCheckpointer

    async with AsyncRecoveryCheckpointer.from_conn_string(conn_string) as saver:
        await saver.setup()
        yield saver
