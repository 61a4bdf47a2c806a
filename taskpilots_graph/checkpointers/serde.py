"""Compressed checkpoint blobs, through LangGraph's own serializer wrapper.

Checkpoints hold conversation text and tool results, which compress several times over.
:func:`compressed_serde` wraps LangGraph's default serializer in its ``EncryptedSerializer``
with a zlib "cipher": blobs are stored as ``<type>+zlib`` and blobs written without it (by a
plain LangGraph saver, or before this existed) still load. The checkpointers'
``from_conn_string`` use it; a saver passed in by the caller keeps its own serializer.
"""

from __future__ import annotations

import zlib
from typing import Final

from langgraph.checkpoint.serde.base import CipherProtocol, SerializerProtocol
from langgraph.checkpoint.serde.encrypted import EncryptedSerializer
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

__all__ = ["MIN_COMPRESSED_BYTES", "ZlibCipher", "compressed_serde"]

MIN_COMPRESSED_BYTES: Final = 256
"""Smaller blobs are stored as they are: compression would not pay for its header."""


class ZlibCipher(CipherProtocol):
    """A "cipher" that compresses: ``zlib`` for blobs worth it, ``raw`` for the others."""

    def encrypt(self, plaintext: bytes) -> tuple[str, bytes]:
        if len(plaintext) < MIN_COMPRESSED_BYTES:
            return "raw", plaintext
        # Level 1: nearly all of the size gain at a fraction of the default level's CPU.
        return "zlib", zlib.compress(plaintext, 1)

    def decrypt(self, ciphername: str, ciphertext: bytes) -> bytes:
        if ciphername == "zlib":
            return zlib.decompress(ciphertext)
        if ciphername == "raw":
            return ciphertext
        raise ValueError(f"unknown checkpoint blob encoding {ciphername!r}")


def compressed_serde(serde: SerializerProtocol | None = None) -> SerializerProtocol:
    """``serde`` (LangGraph's default when omitted) with zlib-compressed blobs."""
    return EncryptedSerializer(ZlibCipher(), serde or JsonPlusSerializer())
