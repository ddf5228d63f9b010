"""The backend seam of the transfer layer: `TransferBackend`, and the backends by name."""

from __future__ import annotations

import socket
from typing import Protocol

from tandem.transfer.descriptor import TransferOpMeta
from tandem.transfer.operation import TransferOp
from tandem.transfer.region import MemoryRegion

BACKEND_NAMES = ("shm", "nixl", "mooncake", "tcp")  # fastest first
LAZY_BACKENDS = ("nixl", "mooncake")  # busy threads / agents a single host never needs


class TransferBackend(Protocol):
    """One way of moving block bytes between two agents.

    The agent runs the control handshake on ``sock`` (claim the remote op, report done);
    a backend moves the bytes. Instances are shared by all transfers of an agent and may
    be called from many threads at once; they raise `TransferError` or OSError.
    """

    name: str

    def register(self, region: MemoryRegion) -> bytes | None:
        """Prepare ``region`` for peers; return its handle for `TransferOpMeta.handles`."""
        ...

    def unregister(self, region: MemoryRegion) -> None: ...

    def unusable_reason(self, remote: TransferOpMeta) -> str | None:
        """None when this backend can reach ``remote``'s memory; else why not (for the logs)."""
        ...

    def pull(
        self, sock: socket.socket, remote: TransferOpMeta, local: MemoryRegion, block_ids: list[int]
    ) -> int:
        """Copy the remote op's blocks and layers into ``local`` ``block_ids``; return bytes."""
        ...

    def push(
        self, sock: socket.socket, remote: TransferOpMeta, local: MemoryRegion, block_ids: list[int]
    ) -> int:
        """Copy ``local`` ``block_ids`` into the remote op's blocks and layers; return bytes."""
        ...

    def serve(self, sock: socket.socket, op: TransferOp, region: MemoryRegion) -> int:
        """Owner side after ``Start``: move the bytes if this backend needs the owner (tcp)."""
        ...

    def close(self) -> None: ...
