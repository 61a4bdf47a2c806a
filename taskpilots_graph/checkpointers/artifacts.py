"""Artifacts: raw tool outputs kept outside the graph state, addressed by their content hash.

A large observation is replaced in state by a summary plus an artifact id; the raw bytes go
to an :class:`ArtifactStore`. By default that is the recovery store itself (a table in the
checkpointer's database); :class:`FileArtifactStore` keeps them in a folder and
:class:`FsspecArtifactStore` under any fsspec URL (``s3://``, ``gs://``, ``memory://`` ...).

The id is ``"sha256:<hex>"`` of the bytes, so the same payload stored twice by one thread is
stored once, and every read can be checked against its id: a payload that no longer hashes to
its id is reported as corrupt, never returned. Artifacts belong to a thread (``delete_thread``
removes them); identical bytes stored by two threads are kept once *per thread*, so deleting
one thread can never take an artifact away from another.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

from taskpilots_graph.compression import artifact_id_for
from taskpilots_graph.errors import ConfigurationError, CorruptRecordError

__all__ = [
    "ARTIFACTS_TABLE",
    "ArtifactRef",
    "ArtifactStore",
    "FileArtifactStore",
    "FsspecArtifactStore",
    "PreparedArtifact",
    "artifact_id_for",
    "check_artifact_id",
    "prepare_artifact",
    "stored_bytes",
    "verify_artifact",
]

ARTIFACTS_TABLE: Final = "taskpilots_artifacts"
"""The table of the default, in-database artifact store."""

_ID = re.compile(r"sha256:[0-9a-f]{64}")
_MAX_MEDIA_TYPE = 255
_TEXT = "text/plain; charset=utf-8"
_BINARY = "application/octet-stream"


@dataclass(frozen=True, slots=True)
class ArtifactRef:
    """What a caller keeps of a stored artifact (small enough for graph state).

    Attributes:
        id: ``"sha256:<hex>"`` of the bytes; pass it to ``checkpointer.artifact(id)``.
        size: Length of the payload in bytes.
        media_type: The payload's media type, e.g. ``"application/json"``.
    """

    id: str
    size: int
    media_type: str


@dataclass(frozen=True, slots=True)
class PreparedArtifact:
    """An artifact validated and hashed, ready for a store to write (never mutated)."""

    thread_id: str
    ref: ArtifactRef
    data: bytes
    created_at: float

    def params(self) -> dict[str, Any]:
        """Named parameters of the ``ARTIFACTS["put"]`` statement."""
        return {
            "id": self.ref.id,
            "thread_id": self.thread_id,
            "media_type": self.ref.media_type,
            "size": self.ref.size,
            "created_at": self.created_at,
            "payload": self.data,
        }


def check_artifact_id(artifact_id: str) -> str:
    """Return ``artifact_id`` if it is a well-formed id.

    The file stores build paths from the id, so this is also what keeps ``"../x"`` out.

    Raises:
        ConfigurationError: If it is not ``"sha256:"`` followed by 64 lowercase hex digits.
    """
    if not isinstance(artifact_id, str) or not _ID.fullmatch(artifact_id):
        raise ConfigurationError(
            f"{artifact_id!r} is not an artifact id; ids look like 'sha256:<64 hex digits>'"
        )
    return artifact_id


def prepare_artifact(
    thread_id: str, data: bytes | bytearray | memoryview | str, media_type: str | None
) -> PreparedArtifact:
    """Validate and hash an artifact before anything is written.

    ``str`` data is stored as UTF-8 (default media type ``text/plain; charset=utf-8``),
    bytes as they are (default ``application/octet-stream``).

    Raises:
        ConfigurationError: For an empty thread id, data that is neither bytes nor text
            (or text with lone surrogates), or an empty or unprintable media type.
    """
    if not isinstance(thread_id, str) or not thread_id or "\x00" in thread_id:
        raise ConfigurationError("thread_id must be a non-empty string without NUL")
    try:
        thread_id.encode()
    except UnicodeEncodeError as exc:
        raise ConfigurationError(f"thread_id {thread_id!r} cannot be stored: {exc}") from exc
    if isinstance(data, str):
        try:
            raw = data.encode()
        except UnicodeEncodeError as exc:
            raise ConfigurationError(f"artifact text cannot be encoded as UTF-8: {exc}") from exc
        default_type = _TEXT
    elif isinstance(data, bytes | bytearray | memoryview):
        raw = bytes(data)
        default_type = _BINARY
    else:
        raise ConfigurationError(
            f"artifact data must be bytes or str, not {type(data).__name__}; "
            "encode it first (e.g. json.dumps(value).encode())"
        )
    kind = default_type if media_type is None else media_type
    if (
        not isinstance(kind, str)
        or not kind.strip()
        or len(kind) > _MAX_MEDIA_TYPE
        or not kind.isprintable()
    ):
        raise ConfigurationError(
            f"media_type must be a printable string of 1-{_MAX_MEDIA_TYPE} characters, "
            f"got {media_type!r}"
        )
    return PreparedArtifact(
        thread_id=thread_id,
        ref=ArtifactRef(id=artifact_id_for(raw), size=len(raw), media_type=kind),
        data=raw,
        created_at=time.time(),
    )


def verify_artifact(artifact_id: str, data: bytes, *, where: str) -> bytes:
    """Return ``data`` if it still hashes to ``artifact_id``.

    Raises:
        CorruptRecordError: If it does not: the stored bytes were changed or damaged.
    """
    if artifact_id_for(data) != artifact_id:
        raise CorruptRecordError(
            f"artifact payload ({len(data)} bytes) no longer matches its content hash",
            table=where,
            key=artifact_id,
        )
    return data


def stored_bytes(raw: Any, artifact_id: str, *, where: str) -> bytes:
    """The bytes of a payload column as a driver returned it.

    Raises:
        CorruptRecordError: If the column holds something that is not bytes (a SQLite
            column edited to a number, say); text is taken as UTF-8 and then fails the hash
            check unless it is exactly the stored bytes.
    """
    if isinstance(raw, bytes | bytearray | memoryview):
        return bytes(raw)
    if isinstance(raw, str):
        return raw.encode(errors="surrogateescape")
    raise CorruptRecordError(
        f"artifact payload is a {type(raw).__name__}, not bytes", table=where, key=artifact_id
    )


@runtime_checkable
class ArtifactStore(Protocol):
    """Where artifact payloads live. Methods are synchronous; async callers use a thread.

    Every recovery store implements it (the default: the checkpointer's own database), as do
    :class:`FileArtifactStore` and :class:`FsspecArtifactStore`. Implementations need not
    verify hashes: the checkpointer checks every payload it reads against its id.
    """

    def put_artifact(self, artifact: PreparedArtifact) -> None:
        """Store the payload for ``artifact.thread_id``; a no-op if the thread has it already.

        Durable when it returns.
        """

    def get_artifact(self, artifact_id: str) -> bytes | None:
        """The payload stored under ``artifact_id`` (by any thread), or ``None``."""

    def delete_artifacts(self, thread_id: str) -> None:
        """Remove every artifact the thread stored (other threads' copies stay)."""


def _thread_dir(thread_id: str) -> str:
    # Thread ids may hold "/", ".." or be longer than a file name may be: use their hash.
    return hashlib.sha256(thread_id.encode()).hexdigest()


def _hex(artifact_id: str) -> str:
    return check_artifact_id(artifact_id).removeprefix("sha256:")


class FileArtifactStore:
    """Artifacts as files in a local folder (created if missing).

    Layout: ``objects/<aa>/<hex>/<thread>`` holds one thread's copy of a payload, and
    ``threads/<thread>/<hex>`` (empty) indexes the thread's artifacts for deletion, where
    ``<thread>`` is the SHA-256 of the thread id. The index entry is written before the
    payload and every payload is written to a temporary file, fsynced and renamed into
    place, so a crash leaves either nothing or a complete file, never a torn payload.

    Args:
        path: The folder; several checkpointers (and processes) may share it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"FileArtifactStore({str(self.path)!r})"

    @property
    def location(self) -> str:
        """Where payloads live, as named in :class:`CorruptRecordError`."""
        return str(self.path)

    def _object_dir(self, hex_id: str) -> Path:
        return self.path / "objects" / hex_id[:2] / hex_id

    def put_artifact(self, artifact: PreparedArtifact) -> None:
        hex_id = _hex(artifact.ref.id)
        owner = _thread_dir(artifact.thread_id)
        target = self._object_dir(hex_id) / owner
        if target.exists():
            return  # content-addressed: the same id always holds the same bytes
        index = self.path / "threads" / owner
        index.mkdir(parents=True, exist_ok=True)
        (index / hex_id).touch()
        _atomic_write(target, artifact.data)

    def get_artifact(self, artifact_id: str) -> bytes | None:
        folder = self._object_dir(_hex(artifact_id))
        try:
            copies = sorted(folder.iterdir())
        except FileNotFoundError:
            return None
        for copy in copies:
            if copy.name.startswith("."):
                continue  # a temporary file of a write in progress
            try:
                return copy.read_bytes()
            except FileNotFoundError:
                continue  # its thread was deleted since the listing
        return None

    def delete_artifacts(self, thread_id: str) -> None:
        owner = _thread_dir(thread_id)
        index = self.path / "threads" / owner
        try:
            entries = sorted(index.iterdir())
        except FileNotFoundError:
            return
        for entry in entries:
            folder = self._object_dir(entry.name)
            (folder / owner).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # only succeeds once no thread holds a copy
                folder.rmdir()
            entry.unlink(missing_ok=True)
        # Fails if a concurrent put for the same thread added an entry: it stays indexed.
        with contextlib.suppress(OSError):
            index.rmdir()


def _atomic_write(target: Path, data: bytes) -> None:
    for _ in range(3):
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        except FileNotFoundError:
            continue  # a concurrent delete removed the empty folder: create it again
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return
    raise OSError(f"could not write {target}: its folder keeps disappearing")


class FsspecArtifactStore:
    """Artifacts under any fsspec URL (needs the optional ``fsspec`` package).

    Same layout as :class:`FileArtifactStore`. Object stores write each file whole, so no
    temporary file is needed there.

    Args:
        url: The root, e.g. ``"s3://bucket/runs/artifacts"`` or ``"memory://artifacts"``.
        **storage_options: Passed to fsspec (credentials, endpoint, ...).

    Raises:
        ConfigurationError: If ``fsspec`` is not installed.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        try:
            import fsspec  # type: ignore[import-not-found, import-untyped, unused-ignore]
        except ImportError as exc:
            raise ConfigurationError(
                "FsspecArtifactStore needs the fsspec package (pip install fsspec, plus the "
                "driver of your storage, e.g. s3fs); or use FileArtifactStore(path)"
            ) from exc
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.fs: Any = fs
        self.root: str = str(root).rstrip("/")
        self.url = url

    def __repr__(self) -> str:
        return f"FsspecArtifactStore({self.url!r})"

    @property
    def location(self) -> str:
        """Where payloads live, as named in :class:`CorruptRecordError`."""
        return self.url

    def _object_dir(self, hex_id: str) -> str:
        return f"{self.root}/objects/{hex_id[:2]}/{hex_id}"

    def put_artifact(self, artifact: PreparedArtifact) -> None:
        hex_id = _hex(artifact.ref.id)
        owner = _thread_dir(artifact.thread_id)
        target = f"{self._object_dir(hex_id)}/{owner}"
        if self.fs.exists(target):
            return
        self._pipe(f"{self.root}/threads/{owner}/{hex_id}", b"")
        self._pipe(target, artifact.data)

    def _pipe(self, path: str, data: bytes) -> None:
        # Local and similar filesystems need the folder; object stores ignore this.
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(path, data)

    def get_artifact(self, artifact_id: str) -> bytes | None:
        folder = self._object_dir(_hex(artifact_id))
        try:
            copies = sorted(self.fs.ls(folder, detail=False))
        except FileNotFoundError:
            return None
        for copy in copies:
            try:
                return bytes(self.fs.cat_file(copy))
            except FileNotFoundError:
                continue
        return None

    def delete_artifacts(self, thread_id: str) -> None:
        owner = _thread_dir(thread_id)
        index = f"{self.root}/threads/{owner}"
        try:
            entries = sorted(self.fs.ls(index, detail=False))
        except FileNotFoundError:
            return
        for entry in entries:
            hex_id = str(entry).rstrip("/").rsplit("/", 1)[-1]
            target = f"{self._object_dir(hex_id)}/{owner}"
            if self.fs.exists(target):
                self.fs.rm_file(target)
            self.fs.rm_file(entry)
