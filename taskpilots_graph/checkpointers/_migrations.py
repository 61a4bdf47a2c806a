"""The recovery store's tables: numbered migrations per dialect (I/O free); the statements
recording which ran are in :mod:`._schema`.

Migrations are append-only: a released migration is never edited, a change is a new entry at
the end.
"""

from __future__ import annotations

from typing import Final

from taskpilots_graph.checkpointers._schema import Dialect

__all__ = ["MIGRATIONS", "SCHEMA_VERSION"]

# Migrations whose SQL differs between the dialects only in column types (and SQLite's
# WITHOUT ROWID), written once: ``format(**_SQLITE)`` / ``format(**_PG)`` give exactly the
# released text of each dialect.
_SQLITE: Final = {
    "real": "REAL",
    "blob": "BLOB",
    "bigint": "INTEGER",
    "without_rowid": " WITHOUT ROWID",
}
_PG: Final = {"real": "DOUBLE PRECISION", "blob": "BYTEA", "bigint": "BIGINT", "without_rowid": ""}

_LEDGER_TABLES: Final = """
        CREATE TABLE IF NOT EXISTS taskpilots_ledger (
            key TEXT PRIMARY KEY,
            thread_id TEXT NOT NULL,
            checkpoint_ns TEXT NOT NULL DEFAULT '',
            tool TEXT NOT NULL,
            tool_call_id TEXT,
            status TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            args TEXT NOT NULL,
            args_digest TEXT NOT NULL,
            result TEXT,
            proof TEXT,
            error TEXT,
            lock TEXT,
            extra TEXT NOT NULL DEFAULT '{{}}',
            created_at {real} NOT NULL,
            updated_at {real} NOT NULL
        );
        CREATE INDEX IF NOT EXISTS taskpilots_ledger_thread ON taskpilots_ledger (thread_id);
        CREATE TABLE IF NOT EXISTS taskpilots_decisions (
            thread_id TEXT NOT NULL,
            checkpoint_ns TEXT NOT NULL,
            input_digest TEXT NOT NULL,
            message TEXT NOT NULL,
            created_at {real} NOT NULL,
            PRIMARY KEY (thread_id, checkpoint_ns, input_digest)
        ){without_rowid};
        """

_ARTIFACT_TABLE: Final = """
        CREATE TABLE IF NOT EXISTS taskpilots_artifacts (
            id TEXT NOT NULL,
            thread_id TEXT NOT NULL,
            media_type TEXT NOT NULL,
            size {bigint} NOT NULL,
            created_at {real} NOT NULL,
            payload {blob} NOT NULL,
            PRIMARY KEY (id, thread_id)
        );
        CREATE INDEX IF NOT EXISTS taskpilots_artifacts_thread
            ON taskpilots_artifacts (thread_id);
        """

_EFFECT_INDEX: Final = """
        CREATE INDEX IF NOT EXISTS taskpilots_ledger_thread_effect
            ON taskpilots_ledger (thread_id, tool, args_digest);
        DROP INDEX IF EXISTS taskpilots_ledger_thread;
        """

_MESSAGE_TABLES: Final = """
        CREATE TABLE IF NOT EXISTS taskpilots_messages (
            thread_id TEXT NOT NULL,
            key {blob} NOT NULL,
            message_id TEXT NOT NULL,
            type TEXT NOT NULL,
            payload {blob} NOT NULL,
            PRIMARY KEY (thread_id, key)
        );
        CREATE TABLE IF NOT EXISTS taskpilots_message_seqs (
            thread_id TEXT NOT NULL,
            seq {bigint} NOT NULL,
            checkpoint_ns TEXT NOT NULL,
            channel TEXT NOT NULL,
            parent_seq {bigint},
            parent_len INTEGER NOT NULL,
            PRIMARY KEY (thread_id, seq)
        ){without_rowid};
        CREATE TABLE IF NOT EXISTS taskpilots_message_refs (
            thread_id TEXT NOT NULL,
            seq {bigint} NOT NULL,
            position INTEGER NOT NULL,
            key {blob} NOT NULL,
            PRIMARY KEY (thread_id, seq, position)
        ){without_rowid};
        """

# Each tuple entry is one migration; its version is its 1-based position.
MIGRATIONS: Final[dict[Dialect, tuple[str, ...]]] = {
    "sqlite": (
        """
        CREATE TABLE IF NOT EXISTS taskpilots_events (
            thread_id TEXT NOT NULL,
            seq INTEGER NOT NULL,
            kind TEXT NOT NULL,
            ts REAL NOT NULL,
            checkpoint_ns TEXT NOT NULL DEFAULT '',
            checkpoint_id TEXT,
            payload TEXT NOT NULL,
            PRIMARY KEY (thread_id, seq)
        ) WITHOUT ROWID;
        """,
        _LEDGER_TABLES.format(**_SQLITE),
        # 3: artifacts. A rowid table, not WITHOUT ROWID: payloads are large, and SQLite
        # keeps large rows out of the b-tree pages only in rowid tables. One copy per
        # (content hash, thread): deleting a thread never takes another thread's copy.
        _ARTIFACT_TABLE.format(**_SQLITE),
        # 4: leases (taskpilots_graph.locks): one row per held name, expiry on the library
        # clock; the fencing counter is a row of its own because released leases are
        # deleted and tokens must keep rising past them.
        """
        CREATE TABLE IF NOT EXISTS taskpilots_leases (
            name TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            fencing INTEGER NOT NULL,
            expires_at REAL NOT NULL
        ) WITHOUT ROWID;
        CREATE TABLE IF NOT EXISTS taskpilots_lease_fencing (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            last INTEGER NOT NULL
        );
        """,
        # 5: the repeat guard looks up a thread's effects by (tool, canonical arguments).
        # The new index replaces the thread index (its first column serves the same
        # lookups), so an intent still maintains one secondary index.
        _EFFECT_INDEX,
        # 6: messages stored once per thread, checkpoints refer to them
        # (checkpointers/messages.py). Messages in a rowid table (payloads are large);
        # sequences and their positions WITHOUT ROWID (small rows, read by key range).
        _MESSAGE_TABLES.format(**_SQLITE),
    ),
    "postgres": (
        """
        CREATE TABLE IF NOT EXISTS taskpilots_event_seq (
            thread_id TEXT PRIMARY KEY,
            last_seq BIGINT NOT NULL
        );
        CREATE TABLE IF NOT EXISTS taskpilots_events (
            thread_id TEXT NOT NULL,
            seq BIGINT NOT NULL,
            kind TEXT NOT NULL,
            ts DOUBLE PRECISION NOT NULL,
            checkpoint_ns TEXT NOT NULL DEFAULT '',
            checkpoint_id TEXT,
            payload JSONB NOT NULL,
            PRIMARY KEY (thread_id, seq)
        );
        """,
        _LEDGER_TABLES.format(**_PG),
        # 3: artifacts (see the SQLite twin). BYTEA values over ~2 KB are TOASTed, so
        # large payloads do not slow down scans of the other columns.
        _ARTIFACT_TABLE.format(**_PG),
        # 4: leases (taskpilots_graph.locks): expiry on the database clock (now()); fencing
        # tokens from a sequence, so they keep rising past deleted (released) rows.
        """
        CREATE SEQUENCE IF NOT EXISTS taskpilots_lease_fencing AS BIGINT;
        CREATE TABLE IF NOT EXISTS taskpilots_leases (
            name TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            fencing BIGINT NOT NULL,
            expires_at TIMESTAMPTZ NOT NULL
        );
        """,
        # 5: the repeat guard's lookup (see the SQLite twin).
        _EFFECT_INDEX,
        # 6: messages stored once per thread (see the SQLite twin).
        _MESSAGE_TABLES.format(**_PG),
    ),
}

SCHEMA_VERSION: Final = len(MIGRATIONS["sqlite"])
assert len(MIGRATIONS["postgres"]) == SCHEMA_VERSION, "dialects must have the same migrations"
