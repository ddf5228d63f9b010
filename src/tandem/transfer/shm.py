"""Same-host backend: map the peer's /dev/shm segment and memcpy the block slices.

Only the *owner's* region must live in shared memory (`TransferAgent.create_region`);
the initiator copies straight between that mapping and its own region, one strided
copy per run of consecutive blocks covering all layers of the op.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
import threading

import numpy as np

from tandem.transfer.descriptor import TransferOpMeta
from tandem.transfer.operation import TransferOp
from tandem.transfer.region import MemoryRegion, copy_blocks, map_shm_segment


class ShmBackend:
    name = "shm"

    def __init__(self, host_id: str) -> None:
        self._host_id = host_id
        self._lock = threading.Lock()
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    def register(self, region: MemoryRegion) -> bytes | None:
        return region.shm_name.encode() if region.shm_name else None

    def unregister(self, region: MemoryRegion) -> None:
        pass

    def unusable_reason(self, remote: TransferOpMeta) -> str | None:
        if remote.host_id != self._host_id:
            return f"peer {remote.agent_id} is on another host ({remote.host_id})"
        shm_name = remote.handles.get("shm")
        if shm_name is None:
            return (
                f"region {remote.region!r} of peer {remote.agent_id} is not in shared memory "
                "(allocate it with TransferAgent.create_region)"
            )
        try:
            self._segment(shm_name.decode())
        except OSError as exc:
            return f"cannot map /dev/shm/{shm_name.decode()}: {exc}"
        return None

    def pull(
        self, sock: socket.socket, remote: TransferOpMeta, local: MemoryRegion, block_ids: list[int]
    ) -> int:
        layers = slice(remote.layer_start, remote.layer_end)
        copy_blocks(local.blocks(), block_ids, self._view(remote), list(remote.block_ids), layers)
        return remote.num_bytes

    def push(
        self, sock: socket.socket, remote: TransferOpMeta, local: MemoryRegion, block_ids: list[int]
    ) -> int:
        layers = slice(remote.layer_start, remote.layer_end)
        copy_blocks(self._view(remote), list(remote.block_ids), local.blocks(), block_ids, layers)
        return remote.num_bytes

    def serve(self, sock: socket.socket, op: TransferOp, region: MemoryRegion) -> int:
        return 0  # one-sided: the initiator did the copy

    def forget(self, shm_name: str) -> None:
        """Drop a cached mapping (its owner is gone or closed the region)."""
        with self._lock:
            entry = self._maps.pop(shm_name, None)
        if entry is not None:
            with contextlib.suppress(BufferError):
                entry[0].close()

    def close(self) -> None:
        for name in list(self._maps):
            self.forget(name)

    def _segment(self, shm_name: str) -> np.ndarray:
        with self._lock:
            entry = self._maps.get(shm_name)
            if entry is None:
                entry = self._maps[shm_name] = map_shm_segment(shm_name)
            return entry[1]

    def _view(self, remote: TransferOpMeta) -> np.ndarray:
        data = self._segment(remote.handles["shm"].decode())
        region = MemoryRegion(name=remote.region, layout=remote.layout, data=data)
        return region.blocks()
