"""G3: KV blocks as one file per block under a directory, LRU eviction, checksummed.

Files are `<block_hash:016x>.kvb` in the format of `disk_format`. Writes go to a temporary name
and are renamed into place, so a reader never sees half a file. I/O uses O_DIRECT with one
page-aligned buffer (no page-cache pollution by a cache larger than RAM) when the filesystem
accepts it, else buffered I/O (logged once). A block that fails its check on read is deleted,
counted in `num_corrupt` and reported as a miss: corrupt KV never reaches the model.

The directory belongs to one tier: stale `*.kvb` files from an earlier run are deleted at start.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from pathlib import Path

from tandem.kvbm import disk_format
from tandem.kvbm.base import BlockMeta, TierName
from tandem.kvbm.lru import LruTier, TierEntry

logger = logging.getLogger(__name__)
_BLOCK_FILE = re.compile(r"^[0-9a-f]{16}\.kvb(\.tmp)?$")
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def probe_direct_io(directory: Path) -> bool:
    """Whether files in `directory` accept O_DIRECT writes of an aligned buffer."""
    if not _O_DIRECT:
        return False
    path = directory / ".odirect-probe"
    buf = mmap.mmap(-1, disk_format.ALIGN)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return True
    except OSError as exc:
        logger.warning("O_DIRECT unsupported in %s (%s); using buffered I/O", directory, exc)
        return False
    finally:
        buf.close()
        path.unlink(missing_ok=True)


class DiskTier(LruTier[TierEntry]):
    """`StorageTier` over files; capacity in blocks of at most `block_bytes`. Not thread-safe."""

    name: TierName = "disk"

    def __init__(
        self, *, directory: str | Path, capacity_blocks: int, block_bytes: int, direct_io: bool
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        super().__init__(capacity_blocks=capacity_blocks, block_bytes=block_bytes)
        self._buf = mmap.mmap(-1, disk_format.file_bytes(block_bytes))  # page-aligned
        self.direct_io = direct_io and probe_direct_io(self.directory)
        self.num_corrupt = 0
        self._remove_stale_files()
        logger.info(
            "disk tier: %d blocks x %d bytes in %s (direct_io=%s)",
            capacity_blocks,
            block_bytes,
            self.directory,
            self.direct_io,
        )

    def path_of(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash & ((1 << 64) - 1):016x}.kvb"

    def put(self, block_hash: int, data: memoryview | bytes, meta: BlockMeta) -> list[int]:
        """Write the block file (raises OSError on I/O failure, leaving the tier unchanged
        apart from evictions already made)."""
        payload = memoryview(data).cast("B")
        if payload.nbytes > self._block_bytes:
            raise ValueError(f"block of {payload.nbytes} bytes exceeds {self._block_bytes}")
        if self._index.touch(block_hash) is not None:
            return []
        evicted = self._make_room()
        total = disk_format.encode_into(memoryview(self._buf), block_hash, payload)
        self._write(self.path_of(block_hash), total)
        self._index.insert(block_hash, TierEntry(num_bytes=payload.nbytes, meta=meta))
        return evicted

    def get(self, block_hash: int) -> bytes | None:
        entry = self._index.touch(block_hash)
        if entry is None:
            return None
        path = self.path_of(block_hash)
        try:
            num_read = self._read(path)
            return bytes(disk_format.decode(memoryview(self._buf), num_read, block_hash))
        except (OSError, disk_format.BlockCorrupt) as exc:
            logger.warning("disk block %s dropped: %s", path.name, exc)
            self.num_corrupt += 1
            self.remove(block_hash)
            return None

    def clear(self) -> list[int]:
        hashes = self._index.clear()
        for block_hash in hashes:
            self.path_of(block_hash).unlink(missing_ok=True)
        return hashes

    def check_integrity(self) -> None:
        assert len(self._index) <= self.capacity_blocks, "more blocks than capacity"
        on_disk = {p.name for p in self.directory.iterdir() if p.name.endswith(".kvb")}
        indexed = {self.path_of(h).name for h in self._index}
        assert on_disk == indexed, f"files {sorted(on_disk ^ indexed)} disagree with the index"
        assert all(f.num_bytes <= self._block_bytes for _, f in self._index.items())

    def _release(self, block_hash: int, entry: TierEntry) -> None:
        self.path_of(block_hash).unlink(missing_ok=True)

    def _flags(self) -> int:
        return _O_DIRECT if self.direct_io else 0

    def _write(self, path: Path, num_bytes: int) -> None:
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._flags(), 0o600)
        try:
            written = os.write(fd, memoryview(self._buf)[:num_bytes])
        finally:
            os.close(fd)
        if written != num_bytes:
            tmp.unlink(missing_ok=True)
            raise OSError(f"short write to {tmp}: {written} of {num_bytes} bytes")
        os.replace(tmp, path)

    def _read(self, path: Path) -> int:
        fd = os.open(path, os.O_RDONLY | self._flags())
        try:
            return os.readv(fd, [memoryview(self._buf)])
        finally:
            os.close(fd)

    def _remove_stale_files(self) -> None:
        stale = [p for p in self.directory.iterdir() if _BLOCK_FILE.match(p.name)]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            logger.info(
                "disk tier: removed %d stale block files from %s", len(stale), self.directory
            )
