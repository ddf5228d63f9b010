"""NIXL backend (UCX on CPU DRAM here; VRAM/RDMA where the hardware has it).

Imported only when the ``nixl`` package is installed. Each region is registered
with this process's NIXL agent; an op's handle carries the agent metadata and the
region's base address, so the initiator can READ / WRITE one descriptor per block
per layer per part without the owner's CPU.

Two things NIXL's Python agent does its own way are set here. Its progress thread polls UCX
with no pause (``pthrDelay`` 0, hard-coded): about 0.3 core per idle agent on these 2-core
hosts; the thread cannot be turned off (the passive side must progress UCX's connection
set-up), so it gets an idle pause (`nixl_progress`; measured idle: 0.30 -> 0.02 core).
And its logger writes to stdout with its own format, past tandem's handlers (JSON logs);
its records go to tandem's logging instead.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import msgspec
import numpy as np
from nixl import _api as nixl_api
from nixl._api import nixl_agent, nixl_agent_config

from tandem.errors import TransferError
from tandem.transfer.descriptor import RegionLayout, TransferOpMeta
from tandem.transfer.nixl_progress import idle_progress
from tandem.transfer.operation import TransferOp
from tandem.transfer.region import MemoryRegion, block_offsets

_nixl_logger = logging.getLogger("nixl")
for _handler in list(_nixl_logger.handlers):  # its stdout handler: tandem's handlers instead
    _nixl_logger.removeHandler(_handler)
_nixl_logger.propagate = True
_nixl_logger.setLevel(logging.NOTSET)


class NixlHandle(msgspec.Struct, frozen=True):
    agent_name: str
    agent_metadata: bytes  # covers every region registered up to `generation`
    generation: int
    base_addr: int


def create(*, agent_id: str, host: str) -> NixlBackend:
    return NixlBackend(agent_id)


class NixlBackend:
    name = "nixl"

    def __init__(self, agent_id: str) -> None:
        self._name = f"{agent_id}-nixl"
        # the progress thread is required: the passive (owner) side makes no calls
        self._agent = _agent_with_idle_progress(self._name)
        self._lock = threading.Lock()
        self._registered: dict[str, object] = {}
        self._generation = 0
        self._peers: dict[str, int] = {}  # remote agent -> generation of metadata loaded

    def register(self, region: MemoryRegion) -> bytes | None:
        addr = region.data.ctypes.data
        with self._lock:
            descs = self._agent.register_memory([(addr, region.data.nbytes, 0, "")], "DRAM")
            self._registered[region.name] = descs
            self._generation += 1
            handle = NixlHandle(
                self._name, self._agent.get_agent_metadata(), self._generation, addr
            )
        return msgspec.msgpack.encode(handle)

    def unregister(self, region: MemoryRegion) -> None:
        with self._lock:
            descs = self._registered.pop(region.name, None)
        if descs is not None:
            self._agent.deregister_memory(descs)

    def unusable_reason(self, remote: TransferOpMeta) -> str | None:
        raw = remote.handles.get("nixl")
        if raw is None:
            return f"region {remote.region!r} of peer {remote.agent_id} is not registered with nixl"
        handle = msgspec.msgpack.decode(raw, type=NixlHandle)
        try:
            self._connect(handle)
        except Exception as exc:  # NIXL raises its own exception types
            return f"nixl cannot load peer metadata: {exc}"
        return None

    def pull(
        self, sock: socket.socket, remote: TransferOpMeta, local: MemoryRegion, block_ids: list[int]
    ) -> int:
        return self._xfer("READ", remote, local, block_ids, sock.gettimeout() or 10.0)

    def push(
        self, sock: socket.socket, remote: TransferOpMeta, local: MemoryRegion, block_ids: list[int]
    ) -> int:
        return self._xfer("WRITE", remote, local, block_ids, sock.gettimeout() or 10.0)

    def serve(self, sock: socket.socket, op: TransferOp, region: MemoryRegion) -> int:
        return 0  # one-sided

    def close(self) -> None:
        for name in list(self._registered):
            with self._lock:
                descs = self._registered.pop(name)
            self._agent.deregister_memory(descs)

    def _connect(self, handle: NixlHandle) -> None:
        with self._lock:
            loaded = self._peers.get(handle.agent_name)
            if loaded is not None and loaded >= handle.generation:
                return
            if loaded is not None:  # the peer registered more memory since
                self._agent.remove_remote_agent(handle.agent_name)
            self._agent.add_remote_agent(handle.agent_metadata)
            self._peers[handle.agent_name] = handle.generation

    def _xfer(
        self,
        op: str,
        remote: TransferOpMeta,
        local: MemoryRegion,
        block_ids: list[int],
        timeout_s: float,
    ) -> int:
        handle = msgspec.msgpack.decode(remote.handles["nixl"], type=NixlHandle)
        layers = range(remote.layer_start, remote.layer_end)
        local_descs = _descs(local.data.ctypes.data, local.layout, block_ids, layers)
        remote_descs = _descs(handle.base_addr, remote.layout, list(remote.block_ids), layers)
        xfer = self._agent.initialize_xfer(
            op,
            self._agent.get_xfer_descs(local_descs, "DRAM"),
            self._agent.get_xfer_descs(remote_descs, "DRAM"),
            handle.agent_name,
        )
        try:
            state = self._agent.transfer(xfer)
            deadline = time.monotonic() + timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(20e-6)  # NIXL's progress thread moves the bytes; do not spin a core
                state = self._agent.check_xfer_state(xfer)
            if state != "DONE":
                raise TransferError(f"nixl {op} ended in state {state} (timeout {timeout_s:.3g}s)")
        finally:
            self._agent.release_xfer_handle(xfer)
        return remote.num_bytes


def _agent_with_idle_progress(name: str) -> Any:
    with idle_progress(nixl_api):
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _descs(base: int, layout: RegionLayout, ids: list[int], layers: range) -> np.ndarray:
    """Nx3 (address, length, device) descriptors."""
    offsets = block_offsets(layout, ids, layers)
    descs = np.zeros((offsets.size, 3), np.int64)
    descs[:, 0] = base + offsets
    descs[:, 1] = layout.block_bytes
    return descs
