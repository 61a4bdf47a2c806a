"""Artifacts: payloads stored once by their hash, in the recovery store unless an
:class:`~.artifacts.ArtifactStore` was plugged in (run on a worker thread for async callers)."""

from __future__ import annotations

import asyncio
from typing import Any

from taskpilots_graph._twins import Steps, asynced, io, synced
from taskpilots_graph.checkpointers._wrapper import DelegatingSaver
from taskpilots_graph.checkpointers.artifacts import (
    ARTIFACTS_TABLE,
    ArtifactRef,
    ArtifactStore,
    check_artifact_id,
    prepare_artifact,
    verify_artifact,
)
from taskpilots_graph.errors import ArtifactNotFound, ConfigurationError
from taskpilots_graph.events import check_thread_id

__all__ = ["ArtifactAccess", "checked_artifact_store"]


def checked_artifact_store(artifacts: object) -> ArtifactStore | None:
    """``artifacts`` if it is ``None`` or implements :class:`ArtifactStore`.

    Raises:
        ConfigurationError: Otherwise (a path string, say), naming the classes to use.
    """
    if artifacts is None or isinstance(artifacts, ArtifactStore):
        return artifacts
    raise ConfigurationError(
        f"artifacts must be an ArtifactStore, got {type(artifacts).__name__}; use "
        "FileArtifactStore(path) or FsspecArtifactStore(url), or omit it to keep artifacts "
        "in the checkpointer's database"
    )


class ArtifactAccess(DelegatingSaver):
    """Putting and reading artifacts, wherever they are kept."""

    artifact_store: ArtifactStore | None = None
    """A store of its own for artifacts; ``None`` keeps them in the recovery store."""

    def _artifacts_call(self, method: str, *args: Any) -> Any:
        if self.artifact_store is None:
            return self._call(method, *args)
        return getattr(self.artifact_store, method)(*args)

    async def _aartifacts_call(self, method: str, *args: Any) -> Any:
        if self.artifact_store is None:
            return await self._acall(method, *args)
        # Plugged-in stores are synchronous (files, fsspec): keep them off the event loop.
        return await asyncio.to_thread(getattr(self.artifact_store, method), *args)

    def _checked(self, artifact_id: str, data: bytes | None) -> bytes:
        if data is None:
            raise ArtifactNotFound(artifact_id)
        store = self.artifact_store
        where = ARTIFACTS_TABLE if store is None else str(getattr(store, "location", store))
        return verify_artifact(artifact_id, data, where=where)

    def _put_artifact(
        self,
        thread_id: str,
        data: bytes | bytearray | memoryview | str,
        *,
        media_type: str | None = None,
    ) -> Steps[ArtifactRef]:
        """Store a raw payload for the thread and return its reference; durable on return.

        The id is the SHA-256 of the bytes (``str`` is stored as UTF-8), so storing the same
        payload again for the thread stores nothing new and returns the same id. The thread's
        artifacts are removed by :meth:`delete_thread`.

        Args:
            thread_id: The thread that owns the artifact.
            data: The payload.
            media_type: Defaults to ``text/plain; charset=utf-8`` for ``str`` and
                ``application/octet-stream`` for bytes. A payload already stored for the
                thread keeps the media type it was first stored with.

        Raises:
            ConfigurationError: For an empty thread id, data that is not bytes or text, or
                a bad media type.
        """
        artifact = prepare_artifact(check_thread_id(thread_id), data, media_type)
        yield io(self, "_artifacts_call", "put_artifact", artifact)
        return artifact.ref

    put_artifact = synced(_put_artifact)
    aput_artifact = asynced(_put_artifact)

    def _artifact(self, artifact_id: str) -> Steps[bytes]:
        """The raw payload stored under ``artifact_id``, checked against its hash.

        Raises:
            ConfigurationError: If ``artifact_id`` is not of the form ``sha256:<hex>``.
            ArtifactNotFound: If no thread holds it (never stored, or its thread deleted).
            CorruptRecordError: If the stored bytes no longer match the id.
        """
        check_artifact_id(artifact_id)
        data = yield io(self, "_artifacts_call", "get_artifact", artifact_id)
        return self._checked(artifact_id, data)

    artifact = synced(_artifact)
    aartifact = asynced(_artifact)
