"""Registered memory: a named buffer plus its `RegionLayout`, and the block copy kernel.

Regions created with `create_shm_region` live in a named POSIX shared-memory segment
(``/dev/shm/tandem-<pid>-<token>-<name>``) so a peer on the same host can map them;
the owner unlinks the segment on close, and `sweep_stale_segments` removes the ones
left by processes that died without closing.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.runtime.process import pid_alive
from tandem.transfer.descriptor import RegionLayout

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "tandem-"
_SEGMENT_RE = re.compile(r"^tandem-(\d+)-[0-9a-f]+-")


@dataclass(slots=True, eq=False)
class MemoryRegion:
    """A registered buffer. ``data`` is a flat uint8 view of the whole buffer (no copy)."""

    name: str
    layout: RegionLayout
    data: np.ndarray
    shm_name: str | None = None
    _mmap: mmap.mmap | None = field(default=None, repr=False)
    _owner: Any = field(default=None, repr=False)  # keeps the caller's tensor alive

    def __post_init__(self) -> None:
        if self.data.dtype != np.uint8 or self.data.ndim != 1:
            raise ValueError(f"region {self.name!r}: data must be a flat uint8 array")
        if self.layout.span_bytes > self.data.nbytes:
            raise ValueError(
                f"region {self.name!r}: layout spans {self.layout.span_bytes} bytes "
                f"but the buffer has {self.data.nbytes}"
            )

    def blocks(self) -> np.ndarray:
        """A ``[num_layers, num_parts, num_blocks, block_bytes]`` strided view (no copy)."""
        lay = self.layout
        return np.lib.stride_tricks.as_strided(
            self.data[lay.base :],
            shape=(lay.num_layers, lay.num_parts, lay.num_blocks, lay.block_bytes),
            strides=(lay.layer_stride, lay.part_stride, lay.block_stride, 1),
        )

    def as_torch(self, dtype: str, shape: tuple[int, ...]) -> Any:
        """The whole buffer as a CPU torch tensor of ``dtype`` and ``shape`` (shares memory).

        This is how an engine puts its KV cache in a shared-memory region:
        ``agent.create_region("kv", layout).as_torch("bfloat16", kv_shape)``.
        """
        import torch

        return torch.from_numpy(self.data).view(getattr(torch, dtype)).view(shape)

    def close(self) -> None:
        """Unmap and, for a segment this process created, unlink it. Idempotent."""
        self.data = np.empty(0, np.uint8)
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # numpy views still alive: GC unmaps
                self._mmap.close()
            self._mmap = None
        if self.shm_name is not None and _segment_pid(self.shm_name) == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.shm_name))


def as_bytes(buffer: Any) -> np.ndarray:
    """A flat uint8 view of a numpy array, CPU torch tensor, mmap or bytearray (no copy)."""
    if type(buffer).__module__.startswith("torch"):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("only contiguous CPU tensors can be registered")
        import torch

        flat: np.ndarray = buffer.view(torch.uint8).reshape(-1).numpy()
        return flat
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("only C-contiguous arrays can be registered")
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(buffer, dtype=np.uint8)


def create_shm_region(name: str, layout: RegionLayout) -> MemoryRegion:
    """Allocate a zeroed region in a new /dev/shm segment owned by this process."""
    shm_name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}"
    path = os.path.join(SHM_DIR, shm_name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, layout.span_bytes)
        mm = mmap.mmap(fd, layout.span_bytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    data = np.frombuffer(mm, dtype=np.uint8)
    return MemoryRegion(name=name, layout=layout, data=data, shm_name=shm_name, _mmap=mm)


def map_shm_segment(shm_name: str) -> tuple[mmap.mmap, np.ndarray]:
    """Map a peer's segment read-write; raises OSError when it cannot be opened."""
    if "/" in shm_name or not shm_name.startswith(SHM_PREFIX):
        raise OSError(f"not a tandem shm segment name: {shm_name!r}")
    fd = os.open(os.path.join(SHM_DIR, shm_name), os.O_RDWR)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.uint8)


def sweep_stale_segments() -> list[str]:
    """Unlink tandem segments whose creating process is gone; return their names."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(SHM_DIR):
            pid = _segment_pid(entry)
            if pid is not None and not pid_alive(pid):
                with contextlib.suppress(FileNotFoundError, PermissionError):
                    os.unlink(os.path.join(SHM_DIR, entry))
                    removed.append(entry)
    if removed:
        logger.info("removed %d stale shm segments of dead processes", len(removed))
    return removed


def _segment_pid(shm_name: str) -> int | None:
    match = _SEGMENT_RE.match(shm_name)
    return int(match.group(1)) if match else None


def copy_blocks(
    dst: np.ndarray, dst_ids: list[int], src: np.ndarray, src_ids: list[int], layers: slice
) -> None:
    """``dst[layers, :, dst_ids] = src[layers, :, src_ids]`` on ``blocks()`` views.

    Runs of consecutive ids in both lists are copied as one strided slice (a single
    pass, no temporary); badly fragmented id lists use one fancy-indexed copy.
    """
    runs = _runs(dst_ids, src_ids)
    if len(runs) * 8 > len(dst_ids) + 32:
        dst[layers, :, dst_ids] = src[layers, :, src_ids]
        return
    for d0, s0, n in runs:
        np.copyto(dst[layers, :, d0 : d0 + n], src[layers, :, s0 : s0 + n])


def _runs(a: list[int], b: list[int]) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for x, y in zip(a, b, strict=True):
        if runs:
            d0, s0, n = runs[-1]
            if x == d0 + n and y == s0 + n:
                runs[-1] = (d0, s0, n + 1)
                continue
        runs.append((x, y, 1))
    return runs


def block_offsets(layout: RegionLayout, ids: list[int], layers: range) -> np.ndarray:
    """Byte offset of every (layer, part, block) chunk, layer-major then part then block.

    Each chunk is ``layout.block_bytes`` long; one-sided backends (nixl, mooncake) turn
    these into one descriptor per chunk on both sides of a transfer.
    """
    offsets = (
        np.asarray(layers, np.int64)[:, None, None] * layout.layer_stride
        + np.arange(layout.num_parts, dtype=np.int64)[None, :, None] * layout.part_stride
        + np.asarray(ids, np.int64)[None, None, :] * layout.block_stride
    )
    return layout.base + offsets.reshape(-1)
