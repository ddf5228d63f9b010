"""Plain values of the transfer layer: how a region is laid out, what an operation is.

A *region* is one contiguous buffer an agent registered (the engine's KV tensor
``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``). Its `RegionLayout`
says where block ``b`` of part ``p`` (K=0, V=1) of layer ``l`` lives:
``base + l*layer_stride + p*part_stride + b*block_stride``, ``block_bytes`` long.

An *operation* exposes blocks of a region to one peer: a ``readable`` op (export,
the peer pulls) or a ``writable`` op (rendezvous, the peer pushes). `TransferOpMeta`
is its serialisable description; the peer needs nothing else to do the transfer.
"""

from __future__ import annotations

import enum

import msgspec

DTYPE_BYTES = {
    "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float16": 2, "bfloat16": 2, "int16": 2,
    "float32": 4, "int32": 4, "float64": 8, "int64": 8,
}  # fmt: skip


class OpStatus(enum.StrEnum):
    """Life of an operation. Every op ends in exactly one terminal status."""

    INITIALIZED = "initialized"
    IN_PROGRESS = "in_progress"
    COMPLETE = "complete"
    ERRORED = "errored"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # an errored op whose TTL passed before any peer claimed it

    @property
    def is_terminal(self) -> bool:
        return self not in (OpStatus.INITIALIZED, OpStatus.IN_PROGRESS)


class OpKind(enum.StrEnum):
    READABLE = "readable"  # the owner exports blocks; a peer pulls them
    WRITABLE = "writable"  # the owner allocated blocks; a peer pushes into them


class RegionLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Where each block of each layer lives inside a region (all offsets in bytes)."""

    num_layers: int
    num_parts: int  # 2 for a K/V cache, 1 for a plain block pool
    num_blocks: int
    block_bytes: int  # one block of one part of one layer, contiguous
    layer_stride: int
    part_stride: int
    block_stride: int
    base: int = 0
    dtype: str = "uint8"
    block_shape: tuple[int, ...] = ()  # e.g. (block_size, kv_heads, head_dim)

    @classmethod
    def for_kv_cache(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
    ) -> RegionLayout:
        """Layout of a contiguous ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``."""
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={dtype!r} unknown; expected one of: {sorted(DTYPE_BYTES)}")
        block_bytes = block_size * num_kv_heads * head_dim * DTYPE_BYTES[dtype]
        return cls(
            num_layers=num_layers,
            num_parts=2,
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            layer_stride=2 * num_blocks * block_bytes,
            part_stride=num_blocks * block_bytes,
            block_stride=block_bytes,
            dtype=dtype,
            block_shape=(block_size, num_kv_heads, head_dim),
        )

    @classmethod
    def contiguous(cls, *, num_blocks: int, block_bytes: int, num_layers: int = 1) -> RegionLayout:
        """A ``[num_layers, num_blocks, block_bytes]`` byte pool (embeddings, benchmarks)."""
        return cls(
            num_layers=num_layers,
            num_parts=1,
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            layer_stride=num_blocks * block_bytes,
            part_stride=num_blocks * block_bytes,
            block_stride=block_bytes,
        )

    @property
    def span_bytes(self) -> int:
        """Bytes from the buffer start to one past the last byte of the last block."""
        last = (
            (self.num_layers - 1) * self.layer_stride
            + (self.num_parts - 1) * self.part_stride
            + (self.num_blocks - 1) * self.block_stride
        )
        return self.base + last + self.block_bytes

    def bytes_for(self, num_blocks: int, num_layers: int) -> int:
        return num_blocks * num_layers * self.num_parts * self.block_bytes


class TransferOpMeta(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a peer needs to pull from / push into an operation (version 1)."""

    version: int = 1
    op_id: str
    kind: OpKind
    agent_id: str
    host_id: str  # hostname + boot id: equal host ids can share memory
    address: tuple[str, int]  # the agent's control/TCP server
    backends: tuple[str, ...]  # transfer backends the owner agent can serve
    region: str
    layout: RegionLayout
    block_ids: tuple[int, ...]
    layer_start: int
    layer_end: int
    expires_at: float  # unix time; the op is released after this unless claimed
    # backend name -> what that backend needs to reach the region without the owner's
    # help (shm: the /dev/shm segment name; nixl: agent metadata + base address)
    handles: dict[str, bytes] = {}

    @property
    def num_bytes(self) -> int:
        return self.layout.bytes_for(len(self.block_ids), self.layer_end - self.layer_start)


class OpRef(msgspec.Struct, frozen=True, kw_only=True):
    """Names an op that may not exist yet: the owner waits (bounded) for it to appear."""

    address: tuple[str, int]
    op_id: str
    agent_id: str = ""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TransferOpMeta)


def encode_meta(meta: TransferOpMeta) -> bytes:
    return _encoder.encode(meta)


def decode_meta(data: bytes) -> TransferOpMeta:
    return _decoder.decode(data)
