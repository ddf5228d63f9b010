"""Image embeddings through the KV transfer layer (`tandem.transfer`), DESIGN.md §10.

The encode worker (`EmbeddingSender`) copies each image's embedding into a slot of a fixed pool in
shared memory and opens one readable operation over a batch's slots, with a TTL; it answers per
image an `EmbeddingHandle` `{shape, dtype, mm_hash, op, index}`. The prefill / aggregated worker
(`EmbeddingReceiver`) pulls the operation into slots of its own pre-allocated receive pool (shm
memcpy on one host, TCP across hosts, NIXL when installed), which completes the operation — the
acknowledgement: the encoder frees its slots then, or when the TTL passes unclaimed.
Both pools are registered once; no request registers memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import msgspec
import numpy as np

from tandem.errors import Overloaded, TransferError
from tandem.transfer import RegionLayout, TransferAgent, TransferOp, decode_meta, encode_meta

logger = logging.getLogger(__name__)

SEND_REGION = "mm-embeddings-out"
RECEIVE_REGION = "mm-embeddings-in"
_DTYPES = {"float32": np.float32, "float16": np.float16}


class EmbeddingHandle(msgspec.Struct, kw_only=True, frozen=True):
    """One image's embedding held by an encode worker (version 1): `op` is the encoded
    `TransferOpMeta` shared by the images of one encode call, `index` this image's position in
    the op's block list, `expires_at` (unix s) when the encoder frees it unclaimed."""

    shape: tuple[int, ...]
    dtype: str
    mm_hash: int
    op: bytes
    index: int
    expires_at: float
    version: int = 1

    @property
    def num_bytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(_DTYPES[self.dtype]).itemsize


class SlotPool:
    """A free list of `num_slots` slot ids; thread-safe."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self, count: int) -> list[int] | None:
        with self._lock:
            if count > len(self._free):
                return None
            return [self._free.pop() for _ in range(count)]

    def give_back(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)


class EmbeddingSender:
    """Encode-worker side: holds embeddings in a shared-memory slot pool until pulled or expired.
    Thread-safe."""

    def __init__(
        self, agent: TransferAgent, *, slot_bytes: int, num_slots: int, ttl_s: float
    ) -> None:
        if slot_bytes <= 0 or num_slots <= 0 or ttl_s <= 0:
            raise ValueError(
                f"slot_bytes={slot_bytes}, num_slots={num_slots}, ttl_s={ttl_s} must be > 0"
            )
        self.agent = agent
        self.ttl_s = ttl_s
        layout = RegionLayout.contiguous(num_blocks=num_slots, block_bytes=slot_bytes)
        self.region = agent.create_region(SEND_REGION, layout)
        self.slot_bytes = slot_bytes
        self.slots = SlotPool(num_slots)
        self.num_released = 0

    def offer(
        self, embeddings: Sequence[np.ndarray], mm_hashes: Sequence[int]
    ) -> list[EmbeddingHandle]:
        """Copy `embeddings` (float32/float16 arrays) into slots under one readable op. Raises
        `Overloaded` when the pool has no room (the holders have not pulled yet)."""
        for emb in embeddings:
            if emb.nbytes > self.slot_bytes or emb.dtype.name not in _DTYPES:
                raise ValueError(
                    f"embedding {emb.dtype} {emb.shape} ({emb.nbytes} bytes) does not fit a "
                    f"{self.slot_bytes}-byte slot of float32/float16"
                )
        slots = self.slots.take(len(embeddings))
        if slots is None:
            raise Overloaded(
                f"encode worker holds {self.slots.num_slots - self.slots.num_free} embeddings "
                f"not yet pulled (pool of {self.slots.num_slots}); retry shortly",
                retry_after_s=1,
            )
        blocks = self.region.blocks()
        for slot, emb in zip(slots, embeddings, strict=True):
            flat = np.ascontiguousarray(emb).reshape(-1).view(np.uint8)
            blocks[0, 0, slot, : flat.nbytes] = flat
        try:
            op = self.agent.create_readable(
                SEND_REGION, slots, ttl_s=self.ttl_s, on_release=lambda o: self._released(o, slots)
            )
        except BaseException:
            self.slots.give_back(slots)
            raise
        meta = encode_meta(self.agent.current_meta(op))
        return [
            EmbeddingHandle(
                shape=tuple(emb.shape),
                dtype=emb.dtype.name,
                mm_hash=int(h),
                op=meta,
                index=i,
                expires_at=op.meta.expires_at,
            )
            for i, (emb, h) in enumerate(zip(embeddings, mm_hashes, strict=True))
        ]

    def _released(self, op: TransferOp, slots: list[int]) -> None:
        self.slots.give_back(slots)
        self.num_released += 1
        if op.status.value != "complete":
            logger.info("embedding op=%s %s: freed %d slots", op.op_id, op.status.value, len(slots))

    @property
    def num_held(self) -> int:
        """Slots holding embeddings not yet pulled (nor expired)."""
        return self.slots.num_slots - self.slots.num_free


class EmbeddingReceiver:
    """Prefill / aggregated-worker side: pulls handles into a receive pool registered once (sized
    on the first pull: `num_slots` slots of the sender's slot size). Thread-safe."""

    def __init__(self, agent: TransferAgent, *, num_slots: int = 64) -> None:
        self.agent = agent
        self.num_slots = num_slots
        self._pool: SlotPool | None = None
        self._slot_bytes = 0
        self._lock = threading.Lock()

    def _ensure_pool(self, slot_bytes: int) -> SlotPool:
        with self._lock:
            if self._pool is None:
                layout = RegionLayout.contiguous(num_blocks=self.num_slots, block_bytes=slot_bytes)
                buffer = np.zeros(layout.span_bytes, np.uint8)
                self.agent.register_region(RECEIVE_REGION, buffer, layout)
                self._pool, self._slot_bytes = SlotPool(self.num_slots), slot_bytes
            elif slot_bytes != self._slot_bytes:
                raise TransferError(
                    f"encode worker slots are {slot_bytes} bytes; this receive pool has "
                    f"{self._slot_bytes}-byte slots (encoders of one model must agree)"
                )
            return self._pool

    def pull(self, handles: Sequence[EmbeddingHandle], *, timeout_s: float) -> list[np.ndarray]:
        """Pull every op the handles name (once each) and return the arrays in handle order.
        Raises `TransferError` (op gone, expired, peer dead, timeout) or `Overloaded` when the
        receive pool is full for longer than `timeout_s`."""
        by_op: dict[bytes, list[int]] = {}
        for i, h in enumerate(handles):
            by_op.setdefault(h.op, []).append(i)
        out: list[np.ndarray | None] = [None] * len(handles)
        deadline = time.monotonic() + timeout_s
        for op_bytes, positions in by_op.items():
            meta = decode_meta(op_bytes)
            if time.time() > meta.expires_at:  # the encoder has freed (or is freeing) it
                raise TransferError(
                    f"embedding op={meta.op_id} of encoder agent {meta.agent_id} expired "
                    f"{time.time() - meta.expires_at:.3f}s ago (its ttl passed before the pull)"
                )
            pool = self._ensure_pool(meta.layout.block_bytes)
            slots = self._take(pool, len(meta.block_ids), deadline)
            try:
                remaining = max(0.001, deadline - time.monotonic())
                self.agent.pull(meta, RECEIVE_REGION, slots, timeout_s=remaining)
                blocks = self.agent.region(RECEIVE_REGION).blocks()
                for i in positions:
                    h = handles[i]
                    raw = blocks[0, 0, slots[h.index], : h.num_bytes]
                    out[i] = raw.view(_DTYPES[h.dtype]).reshape(h.shape).copy()
            finally:
                pool.give_back(slots)
        return [a for a in out if a is not None]

    def _take(self, pool: SlotPool, count: int, deadline: float) -> list[int]:
        if count > pool.num_slots:
            raise TransferError(
                f"an op of {count} embeddings exceeds the {pool.num_slots}-slot pool"
            )
        while True:
            slots = pool.take(count)
            if slots is not None:
                return slots
            if time.monotonic() >= deadline:
                raise Overloaded(
                    f"embedding receive pool ({pool.num_slots} slots) stayed full", retry_after_s=1
                )
            time.sleep(0.001)
