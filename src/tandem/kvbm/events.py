"""KV events of the host and disk tiers (DESIGN.md §6), `medium` set so the router credits
tier hits (DESIGN.md §7). One BlockStored per block: each carries its own parent and tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tandem.kvbm.base import BlockMeta, StorageTier, TierName
from tandem.protocols.kv_events import BlockRemoved, BlockStored, KvEvent

EventSink = Callable[[list[KvEvent]], None]


def stored(block_hash: int, meta: BlockMeta, medium: TierName) -> BlockStored:
    return BlockStored(
        block_hashes=[block_hash],
        parent_hash=meta.parent_hash,
        token_ids=list(meta.token_ids),
        block_size=meta.block_size,
        lora_name=meta.lora_name,
        medium=medium,
    )


def removed(block_hashes: Iterable[int], medium: TierName) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(block_hashes), medium=medium)


def snapshot(tier: StorageTier) -> list[KvEvent]:
    """BlockStored for every block `tier` holds, least recently used first (no LRU touch);
    the caller serialises it with the tier's other calls."""
    out: list[KvEvent] = []
    for block_hash in tier.block_hashes():
        meta = tier.meta(block_hash)
        assert meta is not None
        out.append(stored(block_hash, meta, tier.name))
    return out


def put_events(
    block_hash: int, meta: BlockMeta, evicted: list[int], medium: TierName
) -> list[KvEvent]:
    """Events for one `put`: the evictions it caused, then the new block."""
    events: list[KvEvent] = [removed(evicted, medium)] if evicted else []
    events.append(stored(block_hash, meta, medium))
    return events
