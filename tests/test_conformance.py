"""Both recovery checkpointers pass LangGraph's official conformance suite, as published.

The suite runs unmodified, with its own capability detection and no skips: it must find
every optional capability (``copy_thread``, ``delete_for_runs``, ``prune``) on every backend,
since the wrapper overrides them all, and every one of its tests must pass. The suite drives
the async methods only. ``AsyncRecoveryCheckpointer`` runs it directly on memory, SQLite and
PostgreSQL; ``RecoveryCheckpointer`` directly on memory (whose saver has async methods), and
on SQLite and PostgreSQL through a thin adapter that turns the suite's async calls into the
sync checkpointer's own sync calls (on a worker thread), defining only the methods the sync
checkpointer's type overrides, so the suite's detection still sees what is really there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
)
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import (
    ALL_CAPABILITIES,
    DetectedCapabilities,
)
from langgraph.checkpoint.conformance.report import CapabilityReport, ProgressCallbacks
from langgraph.checkpoint.memory import InMemorySaver

from taskpilots_graph import AsyncRecoveryCheckpointer, RecoveryCheckpointer

SaverFactory = Callable[[], AbstractAsyncContextManager[BaseCheckpointSaver[Any]]]

# The suite's capabilities by the sync method that provides them on the sync checkpointer.
_SYNC_METHODS = {
    "aput": "put",
    "aput_writes": "put_writes",
    "aget_tuple": "get_tuple",
    "alist": "list",
    "adelete_thread": "delete_thread",
    "adelete_for_runs": "delete_for_runs",
    "acopy_thread": "copy_thread",
    "aprune": "prune",
}


class _SyncDriven(BaseCheckpointSaver[Any]):
    """The suite's async calls, answered by a sync checkpointer's sync methods."""

    def __init__(self, cp: RecoveryCheckpointer) -> None:
        super().__init__(serde=cp.serde)
        self.cp = cp

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return await asyncio.to_thread(self.cp.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await asyncio.to_thread(self.cp.put_writes, config, writes, task_id, task_path)

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await asyncio.to_thread(self.cp.get_tuple, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        def listed() -> list[CheckpointTuple]:
            return list(self.cp.list(config, filter=filter, before=before, limit=limit))

        for item in await asyncio.to_thread(listed):
            yield item

    async def adelete_thread(self, thread_id: str) -> None:
        await asyncio.to_thread(self.cp.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await asyncio.to_thread(self.cp.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await asyncio.to_thread(self.cp.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await asyncio.to_thread(lambda: self.cp.prune(thread_ids, strategy=strategy))


def _sync_driven_type(cp: RecoveryCheckpointer) -> type[_SyncDriven]:
    """An adapter type that overrides exactly the async methods whose sync twin ``cp``'s
    type overrides (the suite's own detection, applied to the sync names)."""
    missing = {
        name: getattr(BaseCheckpointSaver, name)
        for name, sync in _SYNC_METHODS.items()
        if getattr(type(cp), sync) is getattr(BaseCheckpointSaver, sync)
    }
    return type("SyncDriven", (_SyncDriven,), missing)


@contextmanager
def _opened(conn_string: str) -> Iterator[RecoveryCheckpointer]:
    with RecoveryCheckpointer.from_conn_string(conn_string) as cp:
        cp.setup()
        yield cp


def _factory(kind: str, backend: str, request: pytest.FixtureRequest) -> SaverFactory:
    if backend == "memory":
        conn_string = ":memory:"
    elif backend == "sqlite":
        tmp_path: Path = request.getfixturevalue("tmp_path")
        conn_string = f"sqlite:///{tmp_path / 'conformance.db'}"
    else:
        conn_string = request.getfixturevalue("postgres_url")

    @asynccontextmanager
    async def wrapped() -> AsyncIterator[BaseCheckpointSaver[Any]]:
        if kind == "async":
            async with AsyncRecoveryCheckpointer.from_conn_string(conn_string) as acp:
                await acp.setup()
                yield acp
        elif backend == "memory":
            yield RecoveryCheckpointer(InMemorySaver())
        else:
            # The sync checkpointer is opened and closed on a worker thread: its saver's
            # connection is not the event loop's business.
            stack = _opened(conn_string)
            cp = await asyncio.to_thread(stack.__enter__)
            try:
                yield _sync_driven_type(cp)(cp)
            finally:
                await asyncio.to_thread(stack.__exit__, None, None, None)

    return wrapped


async def _run_suite(name: str, factory: SaverFactory) -> tuple[CapabilityReport, list[str]]:
    """Run the suite as published; return the report and the tracebacks of failed tests."""
    tracebacks: list[str] = []

    def on_result(capability: str, test: str, passed: bool, error: str | None) -> None:
        if not passed:
            tracebacks.append(f"[{capability}] {test}\n{error}")

    async def saver_gen() -> AsyncIterator[BaseCheckpointSaver[Any]]:
        async with factory() as saver:
            yield saver

    registered = checkpointer_test(name=name)(saver_gen)
    report = await validate(registered, progress=ProgressCallbacks(on_test_result=on_result))
    return report, tracebacks


@pytest.mark.parametrize("kind", ["async", "sync"])
@pytest.mark.parametrize(
    "backend", ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_official_conformance_suite_passes_unmodified(
    kind: str, backend: str, request: pytest.FixtureRequest
) -> None:
    """The published suite finds every capability on the checkpointer and passes all of it."""
    factory = _factory(kind, backend, request)
    async with factory() as probe:
        detected = DetectedCapabilities.from_instance(probe)
    assert detected.detected == ALL_CAPABILITIES

    report, tracebacks = await _run_suite(f"{kind}-{backend}", factory)

    failures = {cap: r.failures for cap, r in report.results.items() if r.failures}
    assert report.passed_all(), f"{failures}\n" + "\n".join(tracebacks)
    assert {cap for cap, r in report.results.items() if r.detected} == {
        cap.value for cap in ALL_CAPABILITIES
    }
    assert all(r.tests_passed > 0 and r.tests_failed == 0 for r in report.results.values())
