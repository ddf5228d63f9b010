"""Mooncake transfer-engine backend (TCP transport with peer-to-peer handshake here).

Imported only when ``mooncake`` is installed (the ``mooncake-transfer-engine-non-cuda``
wheel, which needs ``libibverbs1``). Each region is registered with this process's
engine; an op's handle carries the engine's session address and the region's base
address, and the initiator reads / writes one buffer per block per layer per part.
"""

from __future__ import annotations

import socket
import threading

import msgspec
from mooncake.engine import TransferEngine

from tandem.errors import TransferError
from tandem.transfer.descriptor import TransferOpMeta
from tandem.transfer.operation import TransferOp
from tandem.transfer.region import MemoryRegion, block_offsets


class MooncakeHandle(msgspec.Struct, frozen=True):
    session: str  # "host:rpc_port" of the owner's engine
    base_addr: int


def create(*, agent_id: str, host: str) -> MooncakeBackend:
    return MooncakeBackend(host)


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, host: str) -> None:
        self._engine = TransferEngine()
        code = self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if code != 0:
            raise RuntimeError(f"TransferEngine.initialize returned {code}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._registered: dict[str, int] = {}

    def register(self, region: MemoryRegion) -> bytes | None:
        addr = region.data.ctypes.data
        with self._lock:
            code = self._engine.register_memory(addr, region.data.nbytes)
            if code != 0:
                return None  # peers fall back (and say why: no mooncake handle)
            self._registered[region.name] = addr
        return msgspec.msgpack.encode(MooncakeHandle(self._session, addr))

    def unregister(self, region: MemoryRegion) -> None:
        with self._lock:
            addr = self._registered.pop(region.name, None)
        if addr is not None:
            self._engine.unregister_memory(addr)

    def unusable_reason(self, remote: TransferOpMeta) -> str | None:
        if "mooncake" not in remote.handles:
            return f"region {remote.region!r} of peer {remote.agent_id} has no mooncake handle"
        return None

    def pull(
        self, sock: socket.socket, remote: TransferOpMeta, local: MemoryRegion, block_ids: list[int]
    ) -> int:
        return self._xfer(self._engine.batch_transfer_sync_read, remote, local, block_ids)

    def push(
        self, sock: socket.socket, remote: TransferOpMeta, local: MemoryRegion, block_ids: list[int]
    ) -> int:
        return self._xfer(self._engine.batch_transfer_sync_write, remote, local, block_ids)

    def serve(self, sock: socket.socket, op: TransferOp, region: MemoryRegion) -> int:
        return 0  # one-sided

    def close(self) -> None:
        for name in list(self._registered):
            with self._lock:
                addr = self._registered.pop(name)
            self._engine.unregister_memory(addr)

    def _xfer(
        self, batch: object, remote: TransferOpMeta, local: MemoryRegion, block_ids: list[int]
    ) -> int:
        handle = msgspec.msgpack.decode(remote.handles["mooncake"], type=MooncakeHandle)
        layers = range(remote.layer_start, remote.layer_end)
        local_addrs = local.data.ctypes.data + block_offsets(local.layout, block_ids, layers)
        remote_ids = list(remote.block_ids)
        remote_addrs = handle.base_addr + block_offsets(remote.layout, remote_ids, layers)
        lengths = [remote.layout.block_bytes] * len(local_addrs)
        code = batch(handle.session, local_addrs.tolist(), remote_addrs.tolist(), lengths)  # type: ignore[operator]
        if code != 0:
            raise TransferError(f"mooncake transfer to {handle.session} returned {code}")
        return remote.num_bytes
