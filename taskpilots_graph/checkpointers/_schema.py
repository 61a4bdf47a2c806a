"""SQL for the recovery store: numbered migrations and statements, per dialect (I/O free).

The sync and async drivers of each backend execute exactly these strings, so the two can
never drift apart. Migrations are append-only: a released migration is never edited, a change
is a new entry at the end.
"""

from __future__ import annotations

from typing import Final, Literal

Dialect = Literal["sqlite", "postgres"]

MIGRATIONS_TABLE: Final = "taskpilots_migrations"

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
    ),
}

SCHEMA_VERSION: Final = len(MIGRATIONS["sqlite"])
assert len(MIGRATIONS["postgres"]) == SCHEMA_VERSION, "dialects must have the same migrations"

CREATE_MIGRATIONS_TABLE: Final[dict[Dialect, str]] = {
    "sqlite": f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (v INTEGER PRIMARY KEY)",
    "postgres": f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (v INTEGER PRIMARY KEY)",
}
SELECT_VERSION: Final = f"SELECT COALESCE(MAX(v), 0) AS v FROM {MIGRATIONS_TABLE}"
INSERT_VERSION: Final[dict[Dialect, str]] = {
    "sqlite": f"INSERT INTO {MIGRATIONS_TABLE} (v) VALUES (?)",
    "postgres": f"INSERT INTO {MIGRATIONS_TABLE} (v) VALUES (%s)",
}

# A fixed key for pg_advisory_xact_lock so that concurrent setup() calls run one at a time.
SETUP_LOCK_KEY: Final = 0x7461736B70696C  # "taskpil"

# The per-thread sequence is assigned inside the insert itself. SQLite serialises writers on
# the database, so MAX()+1 in one statement is race-free; PostgreSQL does not, so a counter
# row per thread (locked by the upsert) hands out the numbers.
APPEND_EVENT: Final[dict[Dialect, str]] = {
    "sqlite": """
        INSERT INTO taskpilots_events
            (thread_id, seq, kind, ts, checkpoint_ns, checkpoint_id, payload)
        SELECT ?, COALESCE(MAX(seq), 0) + 1, ?, ?, ?, ?, ?
        FROM taskpilots_events WHERE thread_id = ?
        RETURNING seq
    """,
    "postgres": """
        WITH next AS (
            INSERT INTO taskpilots_event_seq AS s (thread_id, last_seq) VALUES (%(thread_id)s, 1)
            ON CONFLICT (thread_id) DO UPDATE SET last_seq = s.last_seq + 1
            RETURNING last_seq
        )
        INSERT INTO taskpilots_events
            (thread_id, seq, kind, ts, checkpoint_ns, checkpoint_id, payload)
        SELECT %(thread_id)s, last_seq, %(kind)s, %(ts)s, %(checkpoint_ns)s,
               %(checkpoint_id)s, %(payload)s::jsonb
        FROM next
        RETURNING seq
    """,
}

SELECT_EVENTS: Final[dict[Dialect, str]] = {
    "sqlite": """
        SELECT thread_id, seq, kind, ts, checkpoint_ns, checkpoint_id, payload
        FROM taskpilots_events WHERE thread_id = ? AND seq > ? ORDER BY seq
    """,
    "postgres": """
        SELECT thread_id, seq, kind, ts, checkpoint_ns, checkpoint_id, payload
        FROM taskpilots_events WHERE thread_id = %s AND seq > %s ORDER BY seq
    """,
}

# Statements that remove everything the recovery store holds for one thread.
DELETE_THREAD: Final[dict[Dialect, tuple[str, ...]]] = {
    "sqlite": ("DELETE FROM taskpilots_events WHERE thread_id = ?",),
    "postgres": (
        "DELETE FROM taskpilots_events WHERE thread_id = %s",
        "DELETE FROM taskpilots_event_seq WHERE thread_id = %s",
    ),
}
