"""The blob store: bytes kept by their sha256 where the cluster's discovery already is, so a
file a worker has (its tokenizer, chat template) reaches a process on a host without it.

A blob is named by the sha256 (hex) of its bytes and checked against it on every read: a
reader that got the name from an authenticated record (a model card in discovery) gets
exactly the bytes that record meant, or an error. Each store holds the blobs it put until it
is closed; a blob no open store holds is deleted (memory and file at once, etcd when the last
holder's lease ends).
"""

from __future__ import annotations

import hashlib
import re
from typing import Protocol

MAX_BLOB_BYTES = 64 << 20  # a tokenizer is a few MiB; weights never travel this way
_SHA256 = re.compile(r"[0-9a-f]{64}")


class BlobError(Exception):
    """A blob could not be read as named."""


class BlobMissingError(BlobError):
    """No blob with this sha256 is in the store (never put, or every holder is gone)."""


class BlobCorruptError(BlobError):
    """The bytes read back do not hash to the sha256 they were asked for."""


def blob_id(data: bytes) -> str:
    """The name of `data` in every store: its sha256, hex."""
    return hashlib.sha256(data).hexdigest()


def check_blob_id(sha256: str) -> str:
    """`sha256` if it is 64 lower-case hex digits (it becomes a key or a file name); else
    ValueError."""
    if not _SHA256.fullmatch(sha256):
        raise ValueError(f"blob id {sha256!r} is not a sha256 (64 lower-case hex digits)")
    return sha256


def check_size(data: bytes) -> bytes:
    if len(data) > MAX_BLOB_BYTES:
        raise ValueError(
            f"blob of {len(data)} bytes exceeds the store's limit of {MAX_BLOB_BYTES} bytes; "
            "only tokenizer-sized files travel through discovery"
        )
    return data


def verified(sha256: str, data: bytes, *, where: str) -> bytes:
    """`data` if it hashes to `sha256`; else BlobCorruptError naming `where` it came from."""
    actual = blob_id(data)
    if actual != sha256:
        raise BlobCorruptError(
            f"blob {sha256[:16]}… read from {where} hashes to {actual[:16]}… "
            f"({len(data)} bytes): corrupt or altered"
        )
    return data


class BlobStore(Protocol):
    """Blobs by sha256. Safe to use from one asyncio event loop; not thread-safe."""

    @property
    def where(self) -> str:
        """Where the blobs are kept, for messages (`etcd at http://...`, `directory ...`)."""
        ...

    async def put(self, data: bytes) -> str:
        """Store `data` (written once per content: an existing copy is reused) and hold it
        until `close`. Returns its sha256. Raises ValueError over MAX_BLOB_BYTES."""
        ...

    async def get(self, sha256: str) -> bytes:
        """The bytes named `sha256`, verified. Raises BlobMissingError, BlobCorruptError, and
        the backend's error when the store cannot be reached."""
        ...

    async def close(self) -> None:
        """Let go of every blob this store put; one that no other store holds is deleted."""
        ...
