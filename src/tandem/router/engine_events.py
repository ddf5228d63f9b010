"""The KV event wire format vLLM and SGLang publish over ZMQ, and its conversion to tandem's.

Wire: multipart [topic, seq (8-byte big-endian), payload]; payload is a msgpack
`KVEventBatch` = array [ts, events, data_parallel_rank?], each event an array whose first
element is its tag ("BlockStored", "BlockRemoved", "AllBlocksCleared"). Replay: send the
first wanted seq (8-byte big-endian) to the replay ROUTER socket; it answers one
[seq, payload] message per buffered batch and ends with an empty payload.

Engine block hashes (ints, or bytes in newer vLLM) are kept only as lookup keys: the router
hashes the events' token ids itself (DESIGN.md §5)."""

from __future__ import annotations

import msgspec
import xxhash

from tandem.protocols.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
)
from tandem.router.indexer import KvIndexer, WorkerKey
from tandem.tokens.hashing import sequence_hashes

EngineHash = int | bytes


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class EngineBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class EngineBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[EngineHash]
    medium: str | None = None


class EngineAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class EngineEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[EngineBlockStored | EngineBlockRemoved | EngineAllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EngineEventBatch)
_MEDIA = {"gpu": "device", "cuda": "device", "cpu": "host", "cpu_tier1": "host", "disk": "disk"}


def decode_engine_batch(payload: bytes) -> EngineEventBatch:
    return _decoder.decode(payload)


def engine_hash_key(h: EngineHash) -> int:
    """Engine hashes as int lookup keys (bytes hashes folded with XXH3-64)."""
    return h if isinstance(h, int) else xxhash.xxh3_64_intdigest(h)


def _medium(name: str | None) -> str:
    return _MEDIA.get((name or "gpu").lower(), "device")


def to_tandem_batch(
    batch: EngineEventBatch, *, worker_id: str, seq: int, indexer: KvIndexer
) -> KvEventBatch:
    """Convert one engine batch, computing tandem hashes from token ids. Parent hashes are
    resolved through the worker's engine-hash aliases already in `indexer`, plus those of
    earlier events in this same batch."""
    dp_rank = batch.data_parallel_rank or 0
    key = WorkerKey(worker_id, dp_rank)
    aliases: dict[int, int] = {}
    events: list[KvEvent] = []
    for ev in batch.events:
        if isinstance(ev, EngineBlockStored):
            events.append(_stored(ev, key, indexer, aliases))
        elif isinstance(ev, EngineBlockRemoved):
            hashes = [engine_hash_key(h) for h in ev.block_hashes]
            events.append(BlockRemoved(block_hashes=hashes, medium=_medium(ev.medium)))  # type: ignore[arg-type]
        else:
            events.append(AllBlocksCleared())
    return KvEventBatch(
        worker_id=worker_id, dp_rank=dp_rank, event_id=seq, timestamp_s=batch.ts, events=events
    )


def _stored(
    ev: EngineBlockStored, key: WorkerKey, indexer: KvIndexer, aliases: dict[int, int]
) -> BlockStored:
    engine_hashes = [engine_hash_key(h) for h in ev.block_hashes]
    parent: int | None = None
    if ev.parent_block_hash is not None:
        engine_parent = engine_hash_key(ev.parent_block_hash)
        parent = aliases.get(engine_parent)
        if parent is None:
            parent = indexer.resolve(key, engine_parent)
        # an unknown parent (evicted, or missed) starts a fresh chain: it cannot match a prompt
    ours = sequence_hashes(ev.token_ids, ev.block_size, lora_name=ev.lora_name, parent_hash=parent)[
        : len(engine_hashes)
    ]
    aliases.update(zip(engine_hashes, ours, strict=False))
    return BlockStored(
        block_hashes=ours,
        parent_hash=parent,
        block_size=ev.block_size,
        lora_name=ev.lora_name,
        medium=_medium(ev.medium),  # type: ignore[arg-type]
        engine_block_hashes=engine_hashes[: len(ours)],
    )
