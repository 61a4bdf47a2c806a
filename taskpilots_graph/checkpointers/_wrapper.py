"""Delegation of every ``BaseCheckpointSaver`` method to the wrapped LangGraph saver.

Both recovery checkpointers inherit from this class, so the sync and async faces forward the
saver protocol through one piece of code. Anything that touches the recovery store (setup,
``delete_thread``, events) is defined by the two subclasses.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Collection, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from taskpilots_graph.checkpointers.base import check_thread_id, require_override
from taskpilots_graph.checkpointers.density import HeldCheckpoints, run_async, run_sync
from taskpilots_graph.checkpointers.sqlite import mapped_errors

__all__ = ["DelegatingSaver"]


def _checked(config: RunnableConfig | None) -> None:
    """Refuse a thread id no backend can store before the saver writes (or reads) it."""
    configurable = (config or {}).get("configurable") or {}
    if "thread_id" in configurable:
        value = configurable["thread_id"]
        check_thread_id(value if isinstance(value, str) else str(value))


class DelegatingSaver(BaseCheckpointSaver[Any]):
    """A ``BaseCheckpointSaver`` that forwards every call to ``self.inner``.

    Optional operations the inner saver does not implement (``copy_thread``,
    ``delete_for_runs``, ``prune`` on most LangGraph savers) raise
    :class:`~taskpilots_graph.errors.UnsupportedOperation` naming the backend.
    """

    inner: BaseCheckpointSaver[Any]
    held: HeldCheckpoints | None = None
    """Checkpoints not stored under the graph's density (``None``: every one is stored)."""

    def __init__(self, inner: BaseCheckpointSaver[Any]) -> None:
        # BaseCheckpointSaver.__init__ is deliberately not called: it would set a serde of
        # our own, while the graph must encode exactly as the inner saver does.
        self.inner = inner

    # -- attributes LangGraph reads -------------------------------------------------------

    @property
    def serde(self) -> SerializerProtocol:
        """The inner saver's serializer (shared, never copied)."""
        return self.inner.serde

    @serde.setter
    def serde(self, value: SerializerProtocol) -> None:
        self.inner.serde = value

    @property
    def config_specs(self) -> list[Any]:
        return self.inner.config_specs

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.inner.get_next_version(current, channel)

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> DelegatingSaver:
        inner = self.inner.with_allowlist(extra_allowlist)
        if inner is self.inner:
            return self
        clone = copy.copy(self)
        clone.inner = inner
        return clone

    # -- sync protocol ---------------------------------------------------------------------

    def get(self, config: RunnableConfig) -> Checkpoint | None:
        return self.inner.get(config)

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        _checked(config)
        with mapped_errors("get_tuple"):
            if self.held is not None:
                run_sync(self.inner, self.held.release(config))
            return self.inner.get_tuple(config)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        if self.held is not None:
            run_sync(self.inner, self.held.release(config))
        return self.inner.list(config, filter=filter, before=before, limit=limit)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        _checked(config)
        with mapped_errors("put"):
            if self.held is None:
                return self.inner.put(config, checkpoint, metadata, new_versions)
            args, next_config = self.held.put(config, checkpoint, metadata, new_versions)
            return next_config if args is None else self.inner.put(*args)

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        _checked(config)
        with mapped_errors("put_writes"):
            if self.held is None:
                self.inner.put_writes(config, writes, task_id, task_path)
            else:
                run_sync(self.inner, self.held.put_writes(config, writes, task_id, task_path))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        require_override(self.inner, "delete_for_runs")
        self.inner.delete_for_runs(run_ids)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        require_override(self.inner, "copy_thread")
        self.inner.copy_thread(source_thread_id, target_thread_id)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        require_override(self.inner, "prune")
        self.inner.prune(thread_ids, strategy=strategy)

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return self.inner.get_delta_channel_history(config=config, channels=channels)

    # -- async protocol --------------------------------------------------------------------

    async def aget(self, config: RunnableConfig) -> Checkpoint | None:
        return await self.inner.aget(config)

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        _checked(config)
        with mapped_errors("get_tuple"):
            if self.held is not None:
                await run_async(self.inner, self.held.release(config))
            return await self.inner.aget_tuple(config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        if self.held is not None:
            await run_async(self.inner, self.held.release(config))
        async for item in self.inner.alist(config, filter=filter, before=before, limit=limit):
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        _checked(config)
        with mapped_errors("put"):
            if self.held is None:
                return await self.inner.aput(config, checkpoint, metadata, new_versions)
            args, next_config = self.held.put(config, checkpoint, metadata, new_versions)
            return next_config if args is None else await self.inner.aput(*args)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        _checked(config)
        with mapped_errors("put_writes"):
            if self.held is None:
                await self.inner.aput_writes(config, writes, task_id, task_path)
            else:
                held = self.held.put_writes(config, writes, task_id, task_path)
                await run_async(self.inner, held)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        require_override(self.inner, "adelete_for_runs")
        await self.inner.adelete_for_runs(run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        require_override(self.inner, "acopy_thread")
        await self.inner.acopy_thread(source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        require_override(self.inner, "aprune")
        await self.inner.aprune(thread_ids, strategy=strategy)

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return await self.inner.aget_delta_channel_history(config=config, channels=channels)
