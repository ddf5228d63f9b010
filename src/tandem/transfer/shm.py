"""Same-host backend: map the peer's /dev/shm segment and memcpy the block slices.

Only the *owner's* region must live in shared memory (`TransferAgent.create_region`);
the initiator copies straight between that mapping and its own region, one strided
copy per run of consecutive blocks covering all layers of the op.

Used only on proof, not by name: two containers on one machine share hostname and boot id
but not /dev/shm. Each agent writes a random token into a fresh segment (`ShmProbe`) and names
it, with the token's digest, in its handshake reply; an initiator that reads the token back
(`ShmProofs`, once per peer) shares the owner's /dev/shm, and only then is shm chosen.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import mmap
import os
import secrets
import socket
import threading

import numpy as np

from tandem.transfer.descriptor import TransferOpMeta
from tandem.transfer.operation import TransferOp
from tandem.transfer.region import (
    SHM_DIR,
    SHM_PREFIX,
    MemoryRegion,
    copy_blocks,
    map_shm_segment,
)

logger = logging.getLogger(__name__)
PROBE_BYTES = 32
_MAX_VERDICTS = 4096  # peers remembered; past it the cache starts over (a re-read is cheap)


class ShmProbe:
    """The owner's side of the proof: a fresh /dev/shm segment of `PROBE_BYTES` random bytes,
    unlinked by `close` (or by a later agent's sweep when this process died)."""

    def __init__(self) -> None:
        self.name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}-probe"
        token = secrets.token_bytes(PROBE_BYTES)
        self.digest = hashlib.sha256(token).digest()
        fd = os.open(os.path.join(SHM_DIR, self.name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, token)
        finally:
            os.close(fd)

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))


class ShmProofs:
    """The initiator's side: whether an owner's probe reads back here, remembered per probe
    (one read per peer agent, not one attempt per transfer). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verdicts: dict[str, str | None] = {}

    def why_not_shared(self, probe: str, digest: bytes) -> str | None:
        """None when this process shares the prober's /dev/shm; otherwise why not."""
        if not probe:
            return "it named no shared-memory probe"
        with self._lock:
            if probe in self._verdicts:
                return self._verdicts[probe]
        verdict = _read_back(probe, digest)
        with self._lock:
            if len(self._verdicts) >= _MAX_VERDICTS:
                self._verdicts.clear()
            self._verdicts[probe] = verdict
        return verdict


def _read_back(probe: str, digest: bytes) -> str | None:
    if "/" in probe or not probe.startswith(SHM_PREFIX):
        return f"{probe!r} is not a tandem probe name"
    try:
        with open(os.path.join(SHM_DIR, probe), "rb") as f:
            token = f.read(PROBE_BYTES + 1)
    except OSError as exc:
        return f"its probe {SHM_DIR}/{probe} is not visible here ({exc.strerror})"
    if not hmac.compare_digest(hashlib.sha256(token).digest(), digest):
        return f"its probe {SHM_DIR}/{probe} holds another token here"
    return None


class ShmBackend:
    name = "shm"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    def register(self, region: MemoryRegion) -> bytes | None:
        return region.shm_name.encode() if region.shm_name else None

    def unregister(self, region: MemoryRegion) -> None:
        pass

    def unusable_reason(self, remote: TransferOpMeta) -> str | None:
        """Why the owner's region cannot be mapped; whether the two share /dev/shm at all is
        proven before (`ShmProofs`, `BackendSelector.choose`)."""
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
