"""Configuration by connection strings and environment, and loading a graph by reference.

* ``TASKPILOTS_POSTGRES_URL``: where runs are stored (checkpoints, events, ledger) and where
  the queue of :mod:`taskpilots_graph.workers` lives.
* ``TASKPILOTS_REDIS_URL``: where thread leases and business locks live.

Neither is needed for the embedded default: one SQLite file (``.taskpilots/runs.db``) holds
the runs *and* the leases. Without Redis, leases go to the runs database (PostgreSQL rows,
or the SQLite file). Explicit arguments (CLI options) win over the environment.

A graph is named by reference, ``"package.module:attribute"``. The attribute is either a
compiled graph, or a factory ``build(*, checkpointer, leases) -> graph`` that the command
line tools call with the checkpointer and lease backend they opened from the URLs above
(a factory taking only ``checkpointer`` gets no leases; the supervisor then refuses it).
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from langgraph.pregel import Pregel

from taskpilots_graph.checkpointers import AsyncRecoveryCheckpointer, RecoveryCheckpointer
from taskpilots_graph.checkpointers._conn_string import parse_conn_string
from taskpilots_graph.checkpointers._sqlite_connect import sqlite_path
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.locks import LeaseBackend, lease_backend_from_url

__all__ = [
    "DEFAULT_DB_URL",
    "POSTGRES_URL_ENV",
    "REDIS_URL_ENV",
    "GraphRef",
    "StorageSettings",
    "aopen_graph",
    "load_graph",
    "load_graph_factory",
    "open_graph",
]

POSTGRES_URL_ENV: Final = "TASKPILOTS_POSTGRES_URL"
REDIS_URL_ENV: Final = "TASKPILOTS_REDIS_URL"
DEFAULT_DB_URL: Final = "sqlite:///.taskpilots/runs.db"


@dataclass(frozen=True, slots=True)
class StorageSettings:
    """Where runs and leases live.

    Attributes:
        db_url: The runs database: a PostgreSQL URL or ``sqlite:///path``.
        lease_url: The lease backend: a Redis URL, or the runs database itself.
    """

    db_url: str
    lease_url: str

    @classmethod
    def resolve(
        cls,
        *,
        db: str | None = None,
        leases: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> StorageSettings:
        """Settings from explicit URLs, else the environment, else the embedded default.

        Raises:
            ConfigurationError: For a URL of an unknown scheme.
        """
        env = os.environ if environ is None else environ
        db_url = db or env.get(POSTGRES_URL_ENV) or DEFAULT_DB_URL
        target = parse_conn_string(db_url)  # validates the scheme
        if target.backend == "memory":
            raise ConfigurationError(
                "':memory:' cannot be shared between processes; use 'sqlite:///path' or "
                f"a PostgreSQL URL (or set {POSTGRES_URL_ENV})"
            )
        if target.backend == "sqlite":
            Path(sqlite_path(target.address)).parent.mkdir(parents=True, exist_ok=True)
        return cls(db_url, leases or env.get(REDIS_URL_ENV) or db_url)

    @property
    def postgres(self) -> bool:
        """Whether the runs database is PostgreSQL (the queue of the workers needs it)."""
        return parse_conn_string(self.db_url).backend == "postgres"


def load_graph_factory(ref: str) -> Any:
    """The object ``"package.module:attribute"`` names (a graph or a graph factory).

    Raises:
        ConfigurationError: For a malformed reference, a module that cannot be imported or
            a missing attribute.
    """
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(f"a graph reference looks like 'package.module:attr', got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r} for graph {ref!r}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigurationError(f"{module_name!r} has no attribute {attr!r}") from None
    return target


def _named(params: Mapping[str, Any], **offered: Any) -> dict[str, Any]:
    """The ``offered`` arguments that a factory's parameters name."""
    return {name: value for name, value in offered.items() if name in params}


def _call_factory(factory: Any, checkpointer: Any, leases: LeaseBackend) -> Any:
    """Call ``factory`` with what it asks for: ``checkpointer`` and / or ``leases``."""
    params = _parameters(factory)
    # A builtin or C callable (no signature), or one taking ``**kwargs``: both by keyword.
    if params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return factory(checkpointer=checkpointer, leases=leases)
    if kwargs := _named(params, checkpointer=checkpointer, leases=leases):
        return factory(**kwargs)
    # ``make_graph(cp)`` with a differently named parameter, or ``make_graph()``.
    return factory(checkpointer) if params else factory()


def _build(ref: str, checkpointer: Any, leases: LeaseBackend) -> Pregel[Any, Any]:
    target = load_graph_factory(ref)
    if isinstance(target, Pregel):
        return target
    if callable(target):
        graph = _call_factory(target, checkpointer, leases)
        if isinstance(graph, Pregel):
            return graph
        raise ConfigurationError(f"{ref!r} returned {type(graph).__name__}, not a compiled graph")
    raise ConfigurationError(
        f"{ref!r} is a {type(target).__name__}; name a compiled graph or a factory "
        "build(*, checkpointer, leases) -> graph"
    )


@contextmanager
def open_graph(ref: str, settings: StorageSettings) -> Iterator[Pregel[Any, Any]]:
    """Open the checkpointer and lease backend of ``settings`` and build the graph ``ref``.

    Both are set up (tables created, idempotently) and closed on exit. A ``ref`` naming a
    compiled graph is used as it is (it brought its own checkpointer).

    Raises:
        ConfigurationError: See :func:`load_graph_factory`; also for an async factory.
    """
    with (
        RecoveryCheckpointer.from_conn_string(settings.db_url) as cp,
        lease_backend_from_url(settings.lease_url) as leases,
    ):
        cp.setup()
        leases.setup()
        yield _build(ref, cp, leases)


@asynccontextmanager
async def aopen_graph(ref: str, settings: StorageSettings) -> AsyncIterator[Pregel[Any, Any]]:
    """Async form of :func:`open_graph` (an :class:`AsyncRecoveryCheckpointer`)."""
    async with (
        AsyncRecoveryCheckpointer.from_conn_string(settings.db_url) as cp,
        lease_backend_from_url(settings.lease_url) as leases,
    ):
        await cp.setup()
        await leases.asetup()
        target = load_graph_factory(ref)
        if inspect.iscoroutinefunction(target):
            raise ConfigurationError(f"{ref!r} must build the graph synchronously")
        yield _build(ref, cp, leases)


# -- a graph for the drills and the CLI ------------------------------------------------------


@dataclass(frozen=True)
class GraphRef:
    """A graph named ``module:attribute``, and how to build it on a checkpointer.

    Attributes:
        spec: The ``module:attribute`` it was loaded from.
        target: The object found there.
        takes_checkpointer: ``target`` is a factory called with the checkpointer (as
            ``checkpointer=`` if it has such a parameter, else positionally); otherwise it
            is a compiled graph, or a factory without arguments, that brings its own.
    """

    spec: str
    target: Any
    takes_checkpointer: bool

    def build(self, checkpointer: Any = None) -> Any:
        """The compiled graph; a factory gets ``checkpointer``, which the graph must use.

        Raises:
            ConfigurationError: The factory returned no compiled graph, or one that does
                not run on the checkpointer it was given.
        """
        if not self.takes_checkpointer:
            graph = self.target if _is_graph(self.target) else self.target()
        else:
            if checkpointer is None:
                raise ConfigurationError(f"{self.spec} needs a checkpointer")
            params = _parameters(self.target)
            if params is None or "checkpointer" not in params:
                graph = self.target(checkpointer)
            else:  # build(*, checkpointer, leases): drills run unleased
                graph = self.target(**_named(params, checkpointer=checkpointer, leases=None))
        if not _is_graph(graph):
            raise ConfigurationError(
                f"{self.spec} gave {type(graph).__name__}, not a compiled graph; "
                "return builder.compile(checkpointer=checkpointer)"
            )
        if self.takes_checkpointer and graph.checkpointer is not checkpointer:
            raise ConfigurationError(
                f"the graph from {self.spec} does not use the checkpointer it was given; "
                "compile it with checkpointer=<the factory's argument>"
            )
        if graph.checkpointer is None or isinstance(graph.checkpointer, bool):
            raise ConfigurationError(
                f"the graph from {self.spec} has no checkpointer; make it a factory "
                "taking the checkpointer: def make_graph(checkpointer): ..."
            )
        return graph


def _is_graph(value: Any) -> bool:
    from langgraph.pregel import Pregel

    return isinstance(value, Pregel)


def _parameters(func: Any) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None


def _takes_checkpointer(target: Any) -> bool:
    if _is_graph(target):
        return False
    params = _parameters(target)
    if params is None:
        return True  # a builtin-like callable: give it what factories get
    if "checkpointer" in params:
        return True
    return any(
        p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for p in params.values()
    )


def load_graph(spec: str) -> GraphRef:
    """Import ``module:attribute`` (dotted attributes allowed) as a :class:`GraphRef`.

    The attribute may be a compiled graph, a factory without arguments, or (preferred, the
    only form the drills and ``--db`` can use) a factory taking the checkpointer::

        def make_graph(checkpointer):
            return tp.create_recovery_agent(model, tools, checkpointer=checkpointer)

    Raises:
        ConfigurationError: The spec is malformed, the module cannot be imported, the
            attribute is missing, or it is neither a graph nor callable.
    """
    target = load_graph_factory(spec)
    if not _is_graph(target) and not callable(target):
        raise ConfigurationError(
            f"{spec} is a {type(target).__name__}; give a compiled graph or a factory "
            "taking the checkpointer"
        )
    if hasattr(target, "compile") and not _is_graph(target):
        raise ConfigurationError(f"{spec} is an uncompiled StateGraph; compile it in a factory")
    return GraphRef(spec=spec, target=target, takes_checkpointer=_takes_checkpointer(target))
