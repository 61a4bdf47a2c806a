"""AsyncRecoveryCheckpointer passes LangGraph's official checkpointer conformance suite.

The wrapper overrides every ``BaseCheckpointSaver`` method, so the suite's capability
detection (an override on the type) would claim capabilities the wrapped saver lacks. We
therefore skip exactly what the *inner* saver's type does not implement, as computed by the
conformance package itself, and check that the suite tested that set and nothing else.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest
from _services import create_database, drop_database
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import (
    ALL_CAPABILITIES,
    BASE_CAPABILITIES,
    Capability,
    DetectedCapabilities,
)
from langgraph.checkpoint.conformance.report import CapabilityReport, ProgressCallbacks
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from taskpilots_graph import AsyncRecoveryCheckpointer

SaverFactory = Callable[[], AbstractAsyncContextManager[BaseCheckpointSaver]]


@pytest.fixture
def other_postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A second fresh database, so the reference run cannot see the wrapped run's rows."""
    name = f"t_{uuid.uuid4().hex}"
    url = create_database(postgres_admin_url, name)
    yield url
    drop_database(postgres_admin_url, name)


def _memory_factories(request: pytest.FixtureRequest) -> tuple[SaverFactory, SaverFactory]:
    @asynccontextmanager
    async def wrapped() -> AsyncIterator[BaseCheckpointSaver]:
        yield AsyncRecoveryCheckpointer(InMemorySaver())

    @asynccontextmanager
    async def bare() -> AsyncIterator[BaseCheckpointSaver]:
        yield InMemorySaver()

    return wrapped, bare


def _sqlite_factories(request: pytest.FixtureRequest) -> tuple[SaverFactory, SaverFactory]:
    tmp_path: Path = request.getfixturevalue("tmp_path")

    @asynccontextmanager
    async def wrapped() -> AsyncIterator[BaseCheckpointSaver]:
        async with AsyncRecoveryCheckpointer.from_conn_string(
            f"sqlite:///{tmp_path / 'wrapped.db'}"
        ) as cp:
            await cp.setup()
            yield cp

    @asynccontextmanager
    async def bare() -> AsyncIterator[BaseCheckpointSaver]:
        async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "bare.db")) as saver:
            await saver.setup()
            yield saver

    return wrapped, bare


def _postgres_factories(request: pytest.FixtureRequest) -> tuple[SaverFactory, SaverFactory]:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    wrapped_url: str = request.getfixturevalue("postgres_url")
    bare_url: str = request.getfixturevalue("other_postgres_url")

    @asynccontextmanager
    async def wrapped() -> AsyncIterator[BaseCheckpointSaver]:
        async with AsyncRecoveryCheckpointer.from_conn_string(wrapped_url) as cp:
            await cp.setup()
            yield cp

    @asynccontextmanager
    async def bare() -> AsyncIterator[BaseCheckpointSaver]:
        async with AsyncPostgresSaver.from_conn_string(bare_url) as saver:
            await saver.setup()
            yield saver

    return wrapped, bare


@pytest.fixture(
    params=[
        "memory",
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def factories(request: pytest.FixtureRequest) -> tuple[SaverFactory, SaverFactory]:
    """(wrapped, bare) async context managers that open a fresh saver of one backend."""
    build = {
        "memory": _memory_factories,
        "sqlite": _sqlite_factories,
        "postgres": _postgres_factories,
    }[request.param]
    return build(request)


async def _run_suite(
    name: str, factory: SaverFactory, skip: set[str]
) -> tuple[CapabilityReport, list[str]]:
    """Run the conformance suite; return the report and the tracebacks of failed tests."""
    tracebacks: list[str] = []

    def on_result(capability: str, test: str, passed: bool, error: str | None) -> None:
        if not passed:
            tracebacks.append(f"[{capability}] {test}\n{error}")

    async def saver_gen() -> AsyncIterator[BaseCheckpointSaver]:
        async with factory() as saver:
            yield saver

    registered = checkpointer_test(name=name, skip_capabilities=skip)(saver_gen)
    report = await validate(registered, progress=ProgressCallbacks(on_test_result=on_result))
    return report, tracebacks


def _failure_message(report: CapabilityReport, tracebacks: list[str]) -> str:
    failures = {cap: result.failures for cap, result in report.results.items() if result.failures}
    return (
        f"{report.checkpointer_name}: conformance level {report.conformance_level()}, "
        f"failures {failures}\n" + "\n".join(tracebacks)
    )


def _tested(report: CapabilityReport) -> frozenset[Capability]:
    return frozenset(Capability(cap) for cap, r in report.results.items() if r.detected)


async def test_wrapper_passes_conformance_for_inner_capabilities(
    factories: tuple[SaverFactory, SaverFactory],
) -> None:
    """The wrapped saver passes every conformance test the inner saver's capabilities allow."""
    wrapped_factory, bare_factory = factories
    async with wrapped_factory() as probe:
        assert isinstance(probe, AsyncRecoveryCheckpointer)
        inner_caps = DetectedCapabilities.from_instance(probe.inner)
        wrapper_caps = DetectedCapabilities.from_instance(probe)
        inner_name = type(probe.inner).__name__
    # The wrapper claims everything by override; only the inner type says what is real.
    assert wrapper_caps.detected == ALL_CAPABILITIES
    assert inner_caps.detected >= BASE_CAPABILITIES
    skip = {cap.value for cap in inner_caps.missing}

    report, tracebacks = await _run_suite(
        f"AsyncRecoveryCheckpointer({inner_name})", wrapped_factory, skip
    )
    assert report.passed_all(), _failure_message(report, tracebacks)
    assert _tested(report) == inner_caps.detected
    assert all(report.results[cap.value].tests_passed > 0 for cap in inner_caps.detected)

    # Reference: the bare saver, auto-detected, must reach the same verdict on the same set.
    reference, ref_tracebacks = await _run_suite(inner_name, bare_factory, set())
    assert reference.passed_all(), _failure_message(reference, ref_tracebacks)
    assert _tested(reference) == inner_caps.detected
    assert {cap: r.tests_passed for cap, r in report.results.items()} == {
        cap: r.tests_passed for cap, r in reference.results.items()
    }
