"""Connection strings: which backend a checkpointer, a lease backend or the CLI opens.

I/O free: a string is resolved to a backend and its native address; nothing is opened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from taskpilots_graph.errors import ConfigurationError

__all__ = ["DEFAULT_POOL_SIZE", "ConnTarget", "parse_conn_string"]

Backend = Literal["memory", "sqlite", "postgres"]

DEFAULT_POOL_SIZE = 8
"""Connections in the PostgreSQL pool that the saver and the recovery store share."""


@dataclass(frozen=True, slots=True)
class ConnTarget:
    """Where a connection string points: the backend and its native address."""

    backend: Backend
    address: str


def parse_conn_string(conn_string: str) -> ConnTarget:
    """Resolve a connection string to a backend.

    Accepted forms: ``":memory:"`` (LangGraph's in-memory saver), ``"sqlite:///path.db"``,
    ``"sqlite:///:memory:"``, a plain file path with no ``:`` before its first ``/``, and
    ``"postgresql://..."`` / ``"postgres://..."``.

    Raises:
        ConfigurationError: For an empty string, an unknown URL scheme, a scheme typo
            (``postgresql:/db``, ``sqlite:/runs.db``) or a malformed PostgreSQL URL; nothing
            is opened or created.
    """
    if not isinstance(conn_string, str) or not conn_string.strip():
        raise ConfigurationError(
            "connection string is empty; use ':memory:', 'sqlite:///path/runs.db' "
            "or 'postgresql://user@host/db'"
        )
    if conn_string == ":memory:":
        return ConnTarget("memory", conn_string)
    if conn_string.startswith(("postgresql://", "postgres://")):
        try:
            urlsplit(conn_string)  # brackets, IPv6 literals: what every URL reader needs
        except ValueError as exc:
            raise ConfigurationError(
                f"malformed PostgreSQL URL ({exc}); use 'postgresql://user@host:port/db'"
            ) from exc
        return ConnTarget("postgres", conn_string)
    if conn_string.startswith("sqlite://"):
        path = conn_string.removeprefix("sqlite://")
        # sqlite:///rel.db -> "rel.db", sqlite:////abs.db -> "/abs.db" (SQLAlchemy's rule).
        path = path.removeprefix("/")
        if not path:
            raise ConfigurationError(
                f"{conn_string!r} names no file; use 'sqlite:///runs.db' or 'sqlite:///:memory:'"
            )
        return ConnTarget("sqlite", path)
    scheme, sep, _ = conn_string.partition("://")
    if sep:
        raise ConfigurationError(
            f"unsupported connection string scheme {scheme!r}; use ':memory:', "
            "'sqlite:///path' or 'postgresql://...'"
        )
    if ":" in conn_string.partition("/")[0]:
        # 'postgresql:/db', 'sqlite:/runs.db': a scheme typo must never become a local file
        # (workers sharing the typo would each keep a private ledger).
        raise ConfigurationError(
            f"{conn_string!r} looks like a URL with a malformed scheme (a scheme is followed "
            "by '://'); use 'sqlite:///path/runs.db' or 'postgresql://user@host/db', or "
            f"'./{conn_string}' for a file whose name contains ':'"
        )
    return ConnTarget("sqlite", conn_string)
