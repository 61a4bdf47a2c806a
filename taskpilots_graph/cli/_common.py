"""What every command shares: the storage options, the error line, JSON output.

Storage comes from ``--db`` (a SQLite path, ``sqlite:///…`` or ``postgresql://…``), else
from the environment (``TASKPILOTS_DB``, then ``TASKPILOTS_POSTGRES_URL``), else the
embedded default ``.taskpilots/runs.db``. A user mistake (unknown thread, bad JSON, an
unreachable database, a bad ``module:attr``) prints one red line on stderr and exits with
:data:`EXIT_ERROR`; it never shows a traceback. Heavy modules are imported inside the
functions so that ``taskpilots --help`` stays light.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from datetime import date, datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from taskpilots_graph.checkpointers import RecoveryCheckpointer

__all__ = [
    "DB_ENV",
    "DEFAULT_DB",
    "EXIT_ERROR",
    "DbOption",
    "JsonOption",
    "checked_db",
    "emit_json",
    "fail",
    "guarded",
    "open_store",
    "parse_json_option",
    "redact",
    "resolve_db",
    "say",
    "say_block",
    "stderr",
    "stdout",
    "to_jsonable",
    "warn",
    "warn_corrupt",
]

DB_ENV = ("TASKPILOTS_DB", "TASKPILOTS_POSTGRES_URL")
"""Environment variables read, in this order, when ``--db`` is not given."""

DEFAULT_DB = ".taskpilots/runs.db"
"""The embedded default database (the same default as the library's documentation)."""

EXIT_ERROR = 1
"""Exit code of a command stopped by a user mistake or an unreachable database."""

PG_CONNECT_TIMEOUT_S = 5
"""How long a PostgreSQL URL may take to answer before the command gives up (the pool's
own wait is 30 s, far too long for a person at a terminal)."""

DbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        metavar="URL",
        help="SQLite path, sqlite:///PATH or postgresql://URL "
        f"(default: ${DB_ENV[0]}, else ${DB_ENV[1]}, else {DEFAULT_DB}).",
        show_default=False,
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def stdout() -> Console:
    """The console of normal output (plain text when not a terminal)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def stderr() -> Console:
    """The console of error lines and progress bars."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def say(text: str, *, indent: int = 0) -> None:
    """Print a sentence on stdout, wrapped between words (never inside one) at the edge."""
    from rich.padding import Padding
    from rich.text import Text

    stdout().print(Padding(Text(text), (0, 0, 0, indent), expand=False), soft_wrap=False)


def say_block(text: str) -> None:
    """:func:`say` each line of ``text``, continued under the line's own indentation."""
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        say(stripped, indent=len(line) - len(stripped))


def fail(message: str) -> NoReturn:
    """Print ``error: message`` in red on one line of stderr and exit non-zero."""
    from rich.text import Text

    line = " ".join(str(message).split())  # one line, whatever the exception said
    stderr().print(Text.assemble(("error: ", "bold red"), (line, "red")))
    raise typer.Exit(EXIT_ERROR)


def warn(message: str) -> None:
    """Print ``warning: message`` in yellow on one line of stderr (the command goes on)."""
    from rich.text import Text

    line = " ".join(str(message).split())
    stderr().print(Text.assemble(("warning: ", "bold yellow"), (line, "yellow")))


def warn_corrupt(keys: Sequence[str]) -> None:
    """Report event rows a listing skipped because they cannot be decoded."""
    if keys:
        shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        warn(
            f"skipped {len(keys)} corrupt event row(s) that cannot be decoded ({shown}); "
            "everything else is shown"
        )


@contextmanager
def guarded() -> Iterator[None]:
    """Turn the errors a user can cause into one line on stderr and a non-zero exit.

    Library errors (:class:`~taskpilots_graph.errors.TaskPilotsError`) are user-facing by
    design; SQLite errors mean a wrong or damaged file. Anything else is a bug and keeps
    its traceback.
    """
    from taskpilots_graph.errors import TaskPilotsError

    try:
        yield
    except typer.Exit:
        raise
    except TaskPilotsError as exc:
        fail(str(exc))
    except sqlite3.Error as exc:
        fail(f"database error: {exc}")


def resolve_db(db: str | None) -> str:
    """``--db``, else the first of :data:`DB_ENV` that is set, else :data:`DEFAULT_DB`."""
    if db:
        return db
    for name in DB_ENV:
        if value := os.environ.get(name, "").strip():
            return value
    return DEFAULT_DB


def redact(url: str) -> str:
    """The URL without its password, fit for an error message; never raises.

    Plain string work, not ``urlsplit``: the URL may be exactly what is wrong (an unclosed
    ``[`` of an IPv6 host, several ``host:port`` pairs), and the message must still come out.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    userinfo, at, hosts = rest[:end].rpartition("@")
    if at and ":" in userinfo:
        rest = f"{userinfo.partition(':')[0]}:***@{hosts}{rest[end:]}"
    return _PASSWORD_PARAM.sub(r"\1***", f"{scheme}://{rest}")


_PASSWORD_PARAM = re.compile(r"((?:^|[?&])password=)[^&#]*", re.IGNORECASE)


def _probe_postgres(url: str) -> None:
    from taskpilots_graph.errors import StorageError

    try:
        import psycopg
    except ImportError as exc:
        raise StorageError(
            "PostgreSQL support is not installed; pip install 'taskpilots-graph[postgres]'"
        ) from exc
    try:
        psycopg.connect(url, connect_timeout=PG_CONNECT_TIMEOUT_S).close()
    except psycopg.Error as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StorageError(f"cannot reach database {redact(url)}: {reason}") from exc


def _check_store(path: str) -> None:
    """Refuse a SQLite file that is some other program's database.

    Opening it would add the store's tables to it (``setup``) and then report "no
    threads", hiding the mistake. A new, empty file and a plain LangGraph store (a
    ``checkpoints`` table, which the recovery store extends) are accepted.
    """
    from contextlib import closing

    from taskpilots_graph.errors import StorageError

    uri = f"{Path(path).resolve().as_uri()}?mode=ro"  # read without writing anything
    try:
        with closing(sqlite3.connect(uri, uri=True, timeout=5)) as conn:
            rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    except sqlite3.DatabaseError as exc:
        raise StorageError(f"{path!r} is not a usable SQLite database: {exc}") from exc
    tables = sorted(str(name) for (name,) in rows)
    ours = [t for t in tables if t == "checkpoints" or t.startswith("taskpilots_")]
    if tables and not ours:
        shown = ", ".join(tables[:5]) + (f" and {len(tables) - 5} more" if len(tables) > 5 else "")
        raise StorageError(
            f"{path!r} is a SQLite database but not a taskpilots store (its tables: {shown}); "
            "pass the runs database with --db"
        )


def checked_db(db: str | None, *, create: bool = False) -> str:
    """The connection string the options point at, checked before anything is opened.

    Args:
        db: The ``--db`` value (``None``: environment, then the default).
        create: Accept a missing SQLite file (otherwise a missing file is an error: a typo
            must not silently show an empty store).

    Raises:
        ConfigurationError: A malformed connection string, or ``:memory:``.
        StorageError: A missing SQLite file, a SQLite file that is not a taskpilots store,
            or an unreachable PostgreSQL server.
    """
    from taskpilots_graph.checkpointers._conn_string import parse_conn_string
    from taskpilots_graph.errors import ConfigurationError, StorageError

    conn = resolve_db(db)
    target = parse_conn_string(conn)
    if target.backend == "memory" or target.address == ":memory:":
        raise ConfigurationError(
            "an in-memory database keeps no runs between commands; "
            "pass a SQLite file or a PostgreSQL URL with --db"
        )
    if target.backend == "sqlite" and not create and not Path(target.address).is_file():
        raise StorageError(
            f"no database at {target.address!r}; pass --db or set {DB_ENV[0]} "
            f"(a SQLite path or a PostgreSQL URL)"
        )
    if target.backend == "sqlite" and Path(target.address).is_file():
        _check_store(target.address)
    if target.backend == "postgres":
        _probe_postgres(conn)
    return conn


@contextmanager
def open_store(db: str | None, *, create: bool = False) -> Iterator[RecoveryCheckpointer]:
    """Open (and set up) the recovery checkpointer the options point at.

    Raises:
        ConfigurationError, StorageError: See :func:`checked_db`; also for a file that is
            not a SQLite database.
    """
    from taskpilots_graph.checkpointers import RecoveryCheckpointer
    from taskpilots_graph.errors import StorageError

    conn = checked_db(db, create=create)
    try:
        with RecoveryCheckpointer.from_conn_string(conn) as cp:
            cp.setup()
            yield cp
    except sqlite3.DatabaseError as exc:
        raise StorageError(f"{conn!r} is not a usable SQLite database: {exc}") from exc


def parse_json_option(name: str, text: str | None) -> Any:
    """The JSON value of option ``name`` (``None`` when the option was not given).

    Raises:
        ConfigurationError: If ``text`` is not valid JSON, with the position of the problem.
    """
    from taskpilots_graph.errors import ConfigurationError

    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(
            f"{name} is not valid JSON ({exc.msg} at column {exc.colno}); "
            "quote strings, e.g. --result '\"T-42\"'"
        ) from exc


def to_jsonable(value: Any) -> Any:
    """Plain JSON data for dataclasses, pydantic models, enums, dates and mappings."""
    if hasattr(value, "model_dump") and callable(value.model_dump):
        return to_jsonable(value.model_dump(mode="json"))
    if hasattr(value, "as_dict") and callable(value.as_dict):
        return to_jsonable(value.as_dict())
    if is_dataclass(value) and not isinstance(value, type):
        # Field by field, not ``asdict``: it cannot deep-copy read-only mappings.
        return to_jsonable({f.name: getattr(value, f.name) for f in fields(value)})
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def emit_json(value: Any) -> None:
    """Print ``value`` as indented JSON on stdout (no colours, no wrapping)."""
    typer.echo(json.dumps(to_jsonable(value), indent=2, ensure_ascii=False))
