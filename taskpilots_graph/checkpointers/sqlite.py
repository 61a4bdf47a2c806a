"""Recovery store in the same SQLite file as LangGraph's ``SqliteSaver`` / ``AsyncSqliteSaver``.

The store borrows the saver's connection and lock instead of opening its own: SQLite allows one
writer per file, and a second connection in the same process would only wait on the first.
Tables are created lazily on first use, as ``SqliteSaver`` does, and migrated inside
``BEGIN IMMEDIATE`` so that two processes opening one file at once apply each migration once.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

from taskpilots_graph.checkpointers import _schema as sql
from taskpilots_graph.checkpointers.base import EventRecord, rows_to_events
from taskpilots_graph.errors import MigrationError
from taskpilots_graph.events import Event

__all__ = ["AsyncSqliteStore", "SqliteStore"]

_D: Final = "sqlite"


def _statements(script: str) -> list[str]:
    # Migrations hold plain DDL (no triggers, no string literals with ';'), so a split is
    # exact; executescript() is avoided because it commits the surrounding transaction.
    return [s.strip() for s in script.split(";") if s.strip()]


def _pending(current: int) -> list[tuple[int, str]]:
    if current > sql.SCHEMA_VERSION:
        raise MigrationError(
            f"the database schema is at version {current}, newer than this library's "
            f"{sql.SCHEMA_VERSION}; upgrade taskpilots-graph"
        )
    return [(v, sql.MIGRATIONS[_D][v - 1]) for v in range(current + 1, sql.SCHEMA_VERSION + 1)]


def _append_params(record: EventRecord) -> tuple[Any, ...]:
    return (
        record.thread_id,
        record.kind.value,
        record.ts,
        record.checkpoint_ns,
        record.checkpoint_id,
        record.payload,
        record.thread_id,
    )


class SqliteStore:
    """Synchronous recovery store sharing a ``SqliteSaver``'s connection and lock."""

    def __init__(self, conn: sqlite3.Connection, lock: threading.Lock) -> None:
        self.conn = conn
        self.lock = lock
        self.is_setup = False

    @contextmanager
    def _cursor(self) -> Iterator[sqlite3.Cursor]:
        with self.lock:
            if not self.is_setup:
                self._migrate()
            cur = self.conn.cursor()
            try:
                yield cur
                self.conn.commit()
            except BaseException:
                self.conn.rollback()
                raise
            finally:
                cur.close()

    def _migrate(self) -> None:
        conn = self.conn
        conn.execute(sql.CREATE_MIGRATIONS_TABLE[_D])
        conn.commit()
        conn.execute("BEGIN IMMEDIATE")
        try:
            for version, script in _pending(conn.execute(sql.SELECT_VERSION).fetchone()[0]):
                for statement in _statements(script):
                    conn.execute(statement)
                conn.execute(sql.INSERT_VERSION[_D], (version,))
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        self.is_setup = True

    def setup(self, inner_setup: Callable[[], None] | None = None) -> None:
        """Run ``inner_setup`` under the shared lock, then migrate the store's tables."""
        if inner_setup is not None:
            with self.lock:
                inner_setup()
        with self._cursor():
            pass

    def append_event(self, record: EventRecord) -> Event:
        with self._cursor() as cur:
            (seq,) = cur.execute(sql.APPEND_EVENT[_D], _append_params(record)).fetchone()
        return record.to_event(seq)

    def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        with self._cursor() as cur:
            rows = cur.execute(sql.SELECT_EVENTS[_D], (thread_id, after_seq)).fetchall()
        return rows_to_events(rows)

    def delete_thread(self, thread_id: str) -> None:
        with self._cursor() as cur:
            for statement in sql.DELETE_THREAD[_D]:
                cur.execute(statement, (thread_id,))


class AsyncSqliteStore:
    """Asynchronous recovery store sharing an ``AsyncSqliteSaver``'s connection and lock."""

    def __init__(self, conn: Any, lock: asyncio.Lock) -> None:
        self.conn = conn  # aiosqlite.Connection (untyped library)
        self.lock = lock
        self.is_setup = False

    async def _migrate(self) -> None:
        conn = self.conn
        await conn.execute(sql.CREATE_MIGRATIONS_TABLE[_D])
        await conn.commit()
        await conn.execute("BEGIN IMMEDIATE")
        try:
            async with conn.execute(sql.SELECT_VERSION) as cur:
                (current,) = await cur.fetchone()
            for version, script in _pending(current):
                for statement in _statements(script):
                    await conn.execute(statement)
                await conn.execute(sql.INSERT_VERSION[_D], (version,))
            await conn.commit()
        except BaseException:
            await conn.rollback()
            raise
        self.is_setup = True

    async def _ready(self) -> None:
        if not self.is_setup:
            await self._migrate()

    async def setup(self, inner_setup: Callable[[], Awaitable[None]] | None = None) -> None:
        """Await ``inner_setup`` (it takes the shared lock itself), then migrate."""
        if inner_setup is not None:
            await inner_setup()
        async with self.lock:
            await self._ready()

    async def append_event(self, record: EventRecord) -> Event:
        async with self.lock:
            await self._ready()
            try:
                async with self.conn.execute(sql.APPEND_EVENT[_D], _append_params(record)) as cur:
                    (seq,) = await cur.fetchone()
                await self.conn.commit()
            except BaseException:
                await self.conn.rollback()
                raise
        return record.to_event(seq)

    async def events(self, thread_id: str, *, after_seq: int = 0) -> list[Event]:
        async with self.lock:
            await self._ready()
            async with self.conn.execute(sql.SELECT_EVENTS[_D], (thread_id, after_seq)) as cur:
                rows = await cur.fetchall()
        return rows_to_events(rows)

    async def delete_thread(self, thread_id: str) -> None:
        async with self.lock:
            await self._ready()
            try:
                for statement in sql.DELETE_THREAD[_D]:
                    await self.conn.execute(statement, (thread_id,))
                await self.conn.commit()
            except BaseException:
                await self.conn.rollback()
                raise
