"""The test servers really work, so later failures point at the library, not the harness."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
import redis
from _services import ServiceUnavailable, skip_or_fail, start_redis

_databases_seen: set[str] = set()


@pytest.mark.postgres
def test_postgres_answers_queries_with_fsync_on(postgres_url: str) -> None:
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
        # Durability tests are meaningless on a server that skips fsync.
        assert conn.execute("show fsync").fetchone() == ("on",)


@pytest.mark.postgres
@pytest.mark.parametrize("attempt", [1, 2])
def test_each_test_gets_its_own_empty_database(postgres_url: str, attempt: int) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        row = conn.execute("select current_database()").fetchone()
        assert row is not None
        name = row[0]
        assert name not in _databases_seen, f"database {name} reused (attempt {attempt})"
        _databases_seen.add(name)
        tables = conn.execute(
            "select count(*) from information_schema.tables where table_schema = 'public'"
        ).fetchone()
        assert tables == (0,)
        conn.execute("create table marker (id int)")


@pytest.mark.redis
def test_redis_set_get(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as client:
        assert client.dbsize() == 0
        client.set("greeting", "hello")
        assert client.get("greeting") == b"hello"


@pytest.mark.redis
def test_redis_comes_back_on_the_same_port(tmp_path: Path) -> None:
    # Dedicated server: stopping the shared one would break every other Redis test.
    try:
        server = start_redis(tmp_path)
    except ServiceUnavailable as exc:
        skip_or_fail(str(exc))
    try:
        url = server.url
        with redis.Redis.from_url(url, socket_connect_timeout=1) as client:
            client.set("k", "v")
            server.stop()
            with pytest.raises(redis.ConnectionError):
                client.ping()
            server.start()
            assert server.url == url
            assert client.get("k") is None  # nothing is persisted across a restart
            client.set("k", "v2")
            assert client.get("k") == b"v2"
    finally:
        server.stop()
