"""vLLM/SGLang ZMQ KV event batches (wire format in `tandem.protocols.engine_kv_events`)
converted to tandem's.

Engine block hashes (ints, or bytes in newer vLLM) are kept only as lookup keys: the router
hashes the events' token ids itself (DESIGN.md §5)."""

from __future__ import annotations

from tandem.protocols.engine_kv_events import (
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEventBatch,
    decode_engine_batch,
    engine_hash_key,
)
from tandem.protocols.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
)
from tandem.router.indexer import KvIndexer, WorkerKey
from tandem.tokens.hashing import sequence_hashes

__all__ = ["decode_engine_batch", "engine_hash_key", "to_tandem_batch"]

_MEDIA = {"gpu": "device", "cuda": "device", "cpu": "host", "cpu_tier1": "host", "disk": "disk"}


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
