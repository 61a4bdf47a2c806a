"""SQL statements of the recovery store, per dialect (I/O free); the tables they use are
created by the numbered migrations of :mod:`._migrations`.

The sync and async drivers of each backend execute exactly these strings, so the two can
never drift apart.
"""

from __future__ import annotations

from functools import partial
from typing import Final, Literal

__all__ = [
    "APPEND_EVENT",
    "ARTIFACTS",
    "COMPACT_EVENT",
    "CREATE_MIGRATIONS_TABLE",
    "DELETE_LEDGER",
    "DELETE_THREAD",
    "INSERT_VERSION",
    "LEDGER",
    "LEDGER_FIELDS",
    "MESSAGES",
    "MIGRATIONS_TABLE",
    "PRUNE_CHECKPOINTS",
    "SELECT_EVENTS",
    "SELECT_VERSION",
    "SETUP_LOCK_KEY",
    "Dialect",
    "write_pg",
]

Dialect = Literal["sqlite", "postgres"]

MIGRATIONS_TABLE: Final = "taskpilots_migrations"

CREATE_MIGRATIONS_TABLE: Final[dict[Dialect, str]] = dict.fromkeys(
    ("sqlite", "postgres"), f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (v INTEGER PRIMARY KEY)"
)
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
# SQLite appends one event per statement; PostgreSQL a thread's events at once (write_pg).
APPEND_EVENT: Final[dict[Dialect, str]] = {
    "sqlite": """
        INSERT INTO taskpilots_events
            (thread_id, seq, kind, ts, checkpoint_ns, checkpoint_id, payload)
        SELECT ?, COALESCE(MAX(seq), 0) + 1, ?, ?, ?, ?, ?
        FROM taskpilots_events WHERE thread_id = ?
        RETURNING seq
    """,
}


def write_pg(ledger_statement: str | None) -> str:
    """One thread's events and decisions, after ``ledger_statement`` (a ledger insert or
    compare-and-set update) if given, as one PostgreSQL statement: one round trip and no
    BEGIN/COMMIT, atomic as every statement is. Nothing is written unless the entry is.
    Returns the number of entries written (1 without a ledger statement) and the events'
    seqs in order.

    Parameters besides the entry's: ``_t`` (the thread), ``_n`` and ``_events`` (a JSON
    array of ``[kind, ts, checkpoint_ns, checkpoint_id, payload]``), ``_decisions`` (a JSON
    array of ``[checkpoint_ns, input_digest, message, created_at]``).
    """
    entry = "SELECT 1" if ledger_statement is None else f"{ledger_statement} RETURNING 1"
    return f"""
    WITH w AS ({entry}),
    d AS (
        INSERT INTO taskpilots_decisions
            (thread_id, checkpoint_ns, input_digest, message, created_at)
        SELECT %(_t)s, d.v->>0, d.v->>1, d.v->>2, (d.v->>3)::float8
        FROM jsonb_array_elements(%(_decisions)s::jsonb) AS d(v)
        WHERE EXISTS (SELECT 1 FROM w)
        ON CONFLICT (thread_id, checkpoint_ns, input_digest) DO NOTHING
    ),
    next AS (
        INSERT INTO taskpilots_event_seq AS s (thread_id, last_seq)
        SELECT %(_t)s, %(_n)s WHERE %(_n)s > 0 AND EXISTS (SELECT 1 FROM w)
        ON CONFLICT (thread_id) DO UPDATE SET last_seq = s.last_seq + %(_n)s
        RETURNING last_seq
    ),
    ev AS (
        INSERT INTO taskpilots_events
            (thread_id, seq, kind, ts, checkpoint_ns, checkpoint_id, payload)
        SELECT %(_t)s, next.last_seq - %(_n)s + e.ord, e.v->>0, (e.v->>1)::float8,
               e.v->>2, e.v->>3, e.v->4
        FROM next, jsonb_array_elements(%(_events)s::jsonb) WITH ORDINALITY AS e(v, ord)
        RETURNING seq
    )
    SELECT (SELECT count(*) FROM w), ARRAY(SELECT seq FROM ev ORDER BY seq)
    """


SELECT_EVENTS: Final[dict[Dialect, str]] = {
    "sqlite": """
        SELECT thread_id, seq, kind, ts, checkpoint_ns, checkpoint_id, payload
        FROM taskpilots_events WHERE thread_id = ? AND seq > ? ORDER BY seq
    """,
    # payload::text: both dialects decode the same JSON text, so a JSONB string holding
    # object-shaped text is reported corrupt instead of being decoded twice.
    "postgres": """
        SELECT thread_id, seq, kind, ts, checkpoint_ns, checkpoint_id, payload::text
        FROM taskpilots_events WHERE thread_id = %s AND seq > %s ORDER BY seq
    """,
}

_LEDGER_COLUMNS = (
    "key, thread_id, checkpoint_ns, tool, tool_call_id, status, attempt, args, args_digest, "
    "result, proof, error, lock, extra, created_at, updated_at"
)
LEDGER_FIELDS: Final = tuple(c.strip() for c in _LEDGER_COLUMNS.split(","))


def _param(dialect: Dialect, name: str) -> str:
    return f":{name}" if dialect == "sqlite" else f"%({name})s"


def _placeholders(dialect: Dialect, names: tuple[str, ...]) -> str:
    return ", ".join(_param(dialect, n) for n in names)


def _ledger_sql(dialect: Dialect) -> dict[str, str]:
    p = partial(_param, dialect)
    mutable = ("status", "attempt", "result", "proof", "error", "lock", "extra", "updated_at")
    return {
        # Insert only if no entry holds the key: the "intend" of a first execution.
        "insert": f"INSERT INTO taskpilots_ledger ({_LEDGER_COLUMNS}) "
        f"VALUES ({_placeholders(dialect, LEDGER_FIELDS)}) ON CONFLICT (key) DO NOTHING",
        # Compare-and-set on (status, attempt): two runs can never both move one entry on.
        "update": "UPDATE taskpilots_ledger SET "
        + ", ".join(f"{c} = {p(c)}" for c in mutable)
        + f" WHERE key = {p('key')} AND status = {p('expect_status')}"
        f" AND attempt = {p('expect_attempt')}",
        "get": f"SELECT {_LEDGER_COLUMNS} FROM taskpilots_ledger WHERE key = {p('key')}",
        "by_thread": f"SELECT {_LEDGER_COLUMNS} FROM taskpilots_ledger "
        f"WHERE thread_id = {p('thread_id')} ORDER BY created_at, key",
        "all": f"SELECT {_LEDGER_COLUMNS} FROM taskpilots_ledger ORDER BY created_at, key",
        # The repeat guard: the thread's earliest committed effect of one tool with the same
        # canonical arguments, and its position among the thread's effects ("step N"). The
        # position is counted only on a hit, which is rare.
        "repeat": f"SELECT {_LEDGER_COLUMNS}, (SELECT count(*) FROM taskpilots_ledger o "
        "WHERE o.thread_id = l.thread_id AND (o.created_at < l.created_at "
        "OR (o.created_at = l.created_at AND o.key <= l.key))) "
        f"FROM taskpilots_ledger l WHERE l.thread_id = {p('thread_id')} "
        f"AND l.tool = {p('tool')} AND l.args_digest = {p('args_digest')} "
        "AND l.status = 'committed' ORDER BY l.created_at, l.key LIMIT 1",
        # What the repeat guard learns once per lease tenure: the thread's committed
        # (tool, arguments digest) pairs; a fresh call then needs no lookup at all.
        "committed_digests": "SELECT DISTINCT tool, args_digest FROM taskpilots_ledger "
        f"WHERE thread_id = {p('thread_id')} AND status = 'committed'",
        "decision_get": "SELECT message FROM taskpilots_decisions WHERE "
        f"thread_id = {p('thread_id')} AND checkpoint_ns = {p('checkpoint_ns')} "
        f"AND input_digest = {p('input_digest')}",
        "decision_digests": "SELECT input_digest FROM taskpilots_decisions WHERE "
        f"thread_id = {p('thread_id')} AND checkpoint_ns = {p('checkpoint_ns')}",
        "decision_put": "INSERT INTO taskpilots_decisions "
        "(thread_id, checkpoint_ns, input_digest, message, created_at) VALUES ("
        + _placeholders(
            dialect, ("thread_id", "checkpoint_ns", "input_digest", "message", "created_at")
        )
        + ") ON CONFLICT (thread_id, checkpoint_ns, input_digest) DO NOTHING",
        # A rewind forgets the decisions taken after its target, so the model decides anew.
        "decision_forget": "DELETE FROM taskpilots_decisions WHERE "
        f"thread_id = {p('thread_id')} AND created_at > {p('since')}",
    }


LEDGER: Final[dict[Dialect, dict[str, str]]] = {d: _ledger_sql(d) for d in ("sqlite", "postgres")}


def _delete_thread(param: str, *tables: str) -> tuple[str, ...]:
    return tuple(f"DELETE FROM taskpilots_{table} WHERE thread_id = {param}" for table in tables)


# Statements that remove what the recovery store holds for one thread (PostgreSQL's event
# counter included) but its ledger: ``DELETE_LEDGER`` removes the entries it may forget.
_THREAD_TABLES = ("decisions", "artifacts", "message_refs", "message_seqs", "messages")
DELETE_THREAD: Final[dict[Dialect, tuple[str, ...]]] = {
    "sqlite": _delete_thread("?", "events", *_THREAD_TABLES),
    "postgres": _delete_thread("%s", "events", "event_seq", *_THREAD_TABLES),
}
DELETE_LEDGER: Final[dict[Dialect, str]] = {
    "sqlite": "DELETE FROM taskpilots_ledger WHERE key = ?",
    "postgres": "DELETE FROM taskpilots_ledger WHERE key = %s",
}

# Event compaction rewrites the payload of an existing event in place; seq, kind, ts and the
# checkpoint columns are never touched, so the log keeps its order and its gapless numbering.
COMPACT_EVENT: Final[dict[Dialect, str]] = {
    "sqlite": "UPDATE taskpilots_events SET payload = ? WHERE thread_id = ? AND seq = ?",
    "postgres": "UPDATE taskpilots_events SET payload = %s::jsonb "
    "WHERE thread_id = %s AND seq = %s",
}


def _artifact_sql(dialect: Dialect) -> dict[str, str]:
    p = partial(_param, dialect)
    # Bytes go over the wire in binary (%b) on PostgreSQL: the default text format would
    # send a 10 MB payload as 20 MB of hex.
    payload = ":payload" if dialect == "sqlite" else "%(payload)b"
    return {
        # Checked first so that storing a payload the thread already has does not send its
        # bytes again; the insert still tolerates a concurrent writer of the same artifact.
        "exists": "SELECT 1 FROM taskpilots_artifacts "
        f"WHERE id = {p('id')} AND thread_id = {p('thread_id')}",
        "put": "INSERT INTO taskpilots_artifacts "
        "(id, thread_id, media_type, size, created_at, payload) VALUES ("
        + _placeholders(dialect, ("id", "thread_id", "media_type", "size", "created_at"))
        + f", {payload}) ON CONFLICT (id, thread_id) DO NOTHING",
        # Any thread's copy will do: the same id always names the same bytes.
        "get": f"SELECT payload FROM taskpilots_artifacts WHERE id = {p('id')} LIMIT 1",
        "delete": f"DELETE FROM taskpilots_artifacts WHERE thread_id = {p('thread_id')}",
    }


ARTIFACTS: Final[dict[Dialect, dict[str, str]]] = {
    d: _artifact_sql(d) for d in ("sqlite", "postgres")
}


# Retention: delete a thread's checkpoints older than the latest of their namespace, except
# those kept (milestones), then the writes and (PostgreSQL) blobs no kept checkpoint needs.
# The latest is chosen inside the statement, so a checkpoint written meanwhile is never
# deleted. Parameters: (thread_id, kept ids) for the first statement, (thread_id,) after.
PRUNE_CHECKPOINTS: Final[dict[Dialect, tuple[str, ...]]] = {
    "sqlite": (
        """
        DELETE FROM checkpoints
        WHERE thread_id = ?
          AND checkpoint_id NOT IN (SELECT value FROM json_each(?))
          AND checkpoint_id < (
            SELECT max(c.checkpoint_id) FROM checkpoints c
            WHERE c.thread_id = checkpoints.thread_id
              AND c.checkpoint_ns = checkpoints.checkpoint_ns)
        """,
        """
        DELETE FROM writes
        WHERE thread_id = ?
          AND NOT EXISTS (
            SELECT 1 FROM checkpoints c
            WHERE c.thread_id = writes.thread_id AND c.checkpoint_ns = writes.checkpoint_ns
              AND c.checkpoint_id = writes.checkpoint_id)
        """,
    ),
    "postgres": (
        """
        DELETE FROM checkpoints d
        WHERE d.thread_id = %s
          AND d.checkpoint_id <> ALL(%s)
          AND d.checkpoint_id < (
            SELECT max(c.checkpoint_id) FROM checkpoints c
            WHERE c.thread_id = d.thread_id AND c.checkpoint_ns = d.checkpoint_ns)
        """,
        """
        DELETE FROM checkpoint_writes w
        WHERE w.thread_id = %s
          AND NOT EXISTS (
            SELECT 1 FROM checkpoints c
            WHERE c.thread_id = w.thread_id AND c.checkpoint_ns = w.checkpoint_ns
              AND c.checkpoint_id = w.checkpoint_id)
        """,
        """
        DELETE FROM checkpoint_blobs b
        WHERE b.thread_id = %s
          AND NOT EXISTS (
            SELECT 1 FROM checkpoints c
            WHERE c.thread_id = b.thread_id AND c.checkpoint_ns = b.checkpoint_ns
              AND c.checkpoint -> 'channel_versions' ->> b.channel = b.version)
        """,
    ),
}


# Messages stored once per thread (checkpointers/messages.py). A reference (seq, n) is read
# by walking the sequence's ancestors: each takes the positions below the limit its child
# leaves it (its parent_len), so every position comes from exactly one sequence.
_READ_MESSAGES = """
    WITH RECURSIVE chain(seq, upto) AS (
        SELECT {p_seq}, {p_len}
        UNION ALL
        SELECT s.parent_seq, {least}(c.upto, s.parent_len)
        FROM chain c JOIN taskpilots_message_seqs s
            ON s.thread_id = {p_thread} AND s.seq = c.seq
        WHERE s.parent_seq IS NOT NULL AND s.parent_len > 0
    )
    SELECT r.position, r.key, m.type, m.payload
    FROM chain c
    JOIN taskpilots_message_refs r
        ON r.thread_id = {p_thread} AND r.seq = c.seq AND r.position < c.upto
    JOIN taskpilots_messages m ON m.thread_id = {p_thread} AND m.key = r.key
    ORDER BY r.position
"""

MESSAGES: Final[dict[Dialect, dict[str, str]]] = {
    "sqlite": {
        "message": "INSERT INTO taskpilots_messages (thread_id, key, message_id, type, payload) "
        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (thread_id, key) DO NOTHING",
        "sequence": "INSERT INTO taskpilots_message_seqs "
        "(thread_id, seq, checkpoint_ns, channel, parent_seq, parent_len) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        "ref": "INSERT INTO taskpilots_message_refs (thread_id, seq, position, key) "
        "VALUES (?, ?, ?, ?)",
        "read": _READ_MESSAGES.format(
            p_seq=":seq", p_len=":len", p_thread=":thread_id", least="MIN"
        ),
    },
    # One statement per checkpoint: no BEGIN/COMMIT round trips, atomic as every statement.
    # Arrays are sent in binary (%b): bytea in text format would travel as hex. Every insert
    # ignores rows already there: the saver retries a put whose COMMIT was lost (it may have
    # committed), and the rows ride in that put's transaction.
    "postgres": {
        "write": """
            WITH s AS (
                INSERT INTO taskpilots_message_seqs
                    (thread_id, seq, checkpoint_ns, channel, parent_seq, parent_len)
                SELECT %(thread_id)s, x.seq, x.ns, x.channel, x.parent, x.parent_len
                FROM unnest(%(s_seq)b::bigint[], %(s_ns)b::text[], %(s_channel)b::text[],
                            %(s_parent)b::bigint[], %(s_parent_len)b::int[])
                    AS x(seq, ns, channel, parent, parent_len)
                ON CONFLICT (thread_id, seq) DO NOTHING
            ),
            m AS (
                INSERT INTO taskpilots_messages (thread_id, key, message_id, type, payload)
                SELECT %(thread_id)s, x.key, x.message_id, x.type, x.payload
                FROM unnest(%(m_key)b::bytea[], %(m_id)b::text[], %(m_type)b::text[],
                            %(m_payload)b::bytea[]) AS x(key, message_id, type, payload)
                ON CONFLICT (thread_id, key) DO NOTHING
            )
            INSERT INTO taskpilots_message_refs (thread_id, seq, position, key)
            SELECT %(thread_id)s, x.seq, x.position, x.key
            FROM unnest(%(r_seq)b::bigint[], %(r_position)b::int[], %(r_key)b::bytea[])
                AS x(seq, position, key)
            ON CONFLICT (thread_id, seq, position) DO NOTHING
        """,
        "read": _READ_MESSAGES.format(
            p_seq="%(seq)s::bigint",
            p_len="%(len)s::int",
            p_thread="%(thread_id)s",
            least="LEAST",
        ),
    },
}
