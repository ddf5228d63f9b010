"""Between-host backend: block bytes stream over the transfer's control connection.

Order on the wire: for each layer of the op, chunks of at most `CHUNK_BYTES` holding
``[num_parts, k, block_bytes]`` (k consecutive entries of the op's block id list).
Each chunk is gathered / scattered with one vectorised numpy copy.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np

from tandem.errors import TransferError
from tandem.transfer.descriptor import OpKind, TransferOpMeta
from tandem.transfer.operation import TransferOp
from tandem.transfer.region import MemoryRegion
from tandem.transfer.wire import recv_into_exact

CHUNK_BYTES = 4 << 20


class TcpBackend:
    name = "tcp"

    def register(self, region: MemoryRegion) -> bytes | None:
        return b""

    def unregister(self, region: MemoryRegion) -> None:
        pass

    def unusable_reason(self, remote: TransferOpMeta) -> str | None:
        return None  # the control connection is already up, so bytes can follow it

    def pull(
        self, sock: socket.socket, remote: TransferOpMeta, local: MemoryRegion, block_ids: list[int]
    ) -> int:
        return _receive(sock, remote, local.blocks(), block_ids, None)

    def push(
        self, sock: socket.socket, remote: TransferOpMeta, local: MemoryRegion, block_ids: list[int]
    ) -> int:
        return _send(sock, remote, local.blocks(), block_ids, None)

    def serve(self, sock: socket.socket, op: TransferOp, region: MemoryRegion) -> int:
        ids = list(op.meta.block_ids)
        if op.meta.kind is OpKind.READABLE:
            return _send(sock, op.meta, region.blocks(), ids, op)
        return _receive(sock, op.meta, region.blocks(), ids, op)

    def close(self) -> None:
        pass


def _chunks(meta: TransferOpMeta, num_blocks: int) -> Iterator[tuple[int, int, int]]:
    per_block = meta.layout.num_parts * meta.layout.block_bytes
    step = max(1, CHUNK_BYTES // per_block)
    for layer in range(meta.layer_start, meta.layer_end):
        for start in range(0, num_blocks, step):
            yield layer, start, min(start + step, num_blocks)


def _send(
    sock: socket.socket,
    meta: TransferOpMeta,
    view: np.ndarray,
    ids: list[int],
    op: TransferOp | None,
) -> int:
    sent = 0
    for layer, i, j in _chunks(meta, len(ids)):
        _check_live(op)
        chunk = np.ascontiguousarray(view[layer][:, ids[i:j]])  # one gathered copy
        sock.sendall(chunk.data.cast("B"))
        sent += chunk.nbytes
    return sent


def _receive(
    sock: socket.socket,
    meta: TransferOpMeta,
    view: np.ndarray,
    ids: list[int],
    op: TransferOp | None,
) -> int:
    lay = meta.layout
    received = 0
    buf = np.empty(0, np.uint8)
    for layer, i, j in _chunks(meta, len(ids)):
        _check_live(op)
        if buf.size != lay.num_parts * (j - i) * lay.block_bytes:
            buf = np.empty((lay.num_parts, j - i, lay.block_bytes), np.uint8)
        recv_into_exact(sock, buf.data.cast("B"))
        view[layer][:, ids[i:j]] = buf
        received += buf.nbytes
    return received


def _check_live(op: TransferOp | None) -> None:
    if op is not None and op.status.is_terminal:
        raise TransferError(
            f"transfer op={op.op_id} {op.status.value} during transfer: {op.reason}"
        )
