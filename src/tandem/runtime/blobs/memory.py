"""In-process blobs: shared by every store opened on the same `MemoryDiscovery` (one process,
as the discovery itself is)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from tandem.runtime.blobs.base import (
    BlobMissingError,
    blob_id,
    check_blob_id,
    check_size,
    verified,
)


@dataclass
class MemoryBlobSpace:
    """The blobs of one in-process cluster, and which stores hold each."""

    data: dict[str, bytes] = field(default_factory=dict)
    holders: dict[str, set[int]] = field(default_factory=dict)


_spaces: weakref.WeakKeyDictionary[object, MemoryBlobSpace] = weakref.WeakKeyDictionary()


def space_of(discovery: object) -> MemoryBlobSpace:
    """The blob space that goes with `discovery` (made on first use, dropped with it)."""
    space = _spaces.get(discovery)
    if space is None:
        space = _spaces[discovery] = MemoryBlobSpace()
    return space


class MemoryBlobStore:
    """Implements `BlobStore` over a `MemoryBlobSpace` (a private one when none is given)."""

    where = "this process's memory"

    def __init__(self, space: MemoryBlobSpace | None = None) -> None:
        self.space = space or MemoryBlobSpace()
        self._held: set[str] = set()

    async def put(self, data: bytes) -> str:
        sha = blob_id(check_size(data))
        self.space.data.setdefault(sha, bytes(data))
        self.space.holders.setdefault(sha, set()).add(id(self))
        self._held.add(sha)
        return sha

    async def get(self, sha256: str) -> bytes:
        data = self.space.data.get(check_blob_id(sha256))
        if data is None:
            raise BlobMissingError(f"blob {sha256[:16]}… is not in {self.where}")
        return verified(sha256, data, where=self.where)

    async def close(self) -> None:
        for sha in self._held:
            holders = self.space.holders.get(sha, set())
            holders.discard(id(self))
            if not holders:
                self.space.holders.pop(sha, None)
                self.space.data.pop(sha, None)
        self._held.clear()
