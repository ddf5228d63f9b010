"""`KvTiering`: the native engine's G1 pool backed by kvbm's host (G2) and disk (G3) tiers.

Offload on eviction: a cached block reused for new data is exported (one batched copy of all
blocks evicted since the last flush) and handed to `tandem.kvbm.BlockManager.offload`, whose
lanes copy it to host memory and disk in the background; a full queue skips the block, so
the step thread never waits on a tier. `flush_evicted()` runs before every write into the KV
cache (a forward pass, an onboard import, a disaggregated transfer), while the evicted
blocks still hold their KV.

Onboard before prefill: admission asks `onboard(seq, num_cached_tokens)` after the device
prefix match; the leading prompt blocks found in G2/G3 are read (a disk block failing its
checksum ends the hit there), written into fresh G1 blocks and cached there, and count as
cached tokens, so only the rest is computed. The read is synchronous on the step thread: it
replaces the prefill of those blocks, which is far slower.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from tandem.engines.native.block_manager import BlockManager as DeviceBlocks
from tandem.engines.native.model_runner import ModelRunner
from tandem.engines.native.sequence import Sequence
from tandem.kvbm.args import with_block_bytes
from tandem.kvbm.base import BlockMeta, KvbmConfig
from tandem.kvbm.events import EventSink
from tandem.kvbm.layout import join_blocks
from tandem.kvbm.manager import BlockManager as TierManager

logger = logging.getLogger(__name__)


class KvTiering:
    """Owned by `EngineCore`; every method runs on the engine thread. `on_events` gets the
    host/disk KV events from kvbm's threads (see `tandem.kvbm.BlockManager`)."""

    def __init__(
        self,
        config: KvbmConfig,
        blocks: DeviceBlocks,
        runner: ModelRunner,
        *,
        on_events: EventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not blocks.enable_prefix_caching:
            raise ValueError("kvbm tiers need prefix caching; drop --no-prefix-caching")
        self.blocks = blocks
        self.runner = runner
        self.kvbm = TierManager(
            with_block_bytes(config, runner.bytes_per_block), on_events=on_events, clock=clock
        )
        blocks.record_evictions = True
        layers, _, _, block_size, heads, head_dim = runner.kv_cache.shape
        # shapes/dtypes of one exported block, without memory: join_blocks only reads them
        self._template = [
            torch.empty((2, 1, block_size, heads, head_dim), dtype=runner.kv_cache.dtype,
                        device="meta")
            for _ in range(layers)
        ]  # fmt: skip
        self.num_onboarded_blocks = 0
        self.num_offload_skipped = 0
        self.max_flush_s = 0.0  # longest flush_evicted() call: the step thread's offload cost

    def flush_evicted(self) -> None:
        """Hand every block evicted since the last call to kvbm (export, then queue)."""
        evicted = self.blocks.take_evicted()
        if not evicted:
            return
        start = time.perf_counter()
        todo = [e for e in evicted if not self.kvbm.may_hold(e.block_hash, "host")]
        if todo:
            exported = self._export([e.block_id for e in todo])
            bs = self.blocks.block_size
            for e, parts in zip(todo, exported, strict=True):
                meta = BlockMeta(
                    block_size=bs,
                    token_ids=tuple(e.token_ids),
                    parent_hash=e.parent_hash,
                    lora_name=e.lora_name,
                )
                if not self.kvbm.offload(e.block_hash, parts, meta):
                    self.num_offload_skipped += 1
        self.max_flush_s = max(self.max_flush_s, time.perf_counter() - start)

    def _export(self, block_ids: list[int]) -> list[Any]:
        """One contiguous uint8 numpy array per block: its per-layer [2, 1, bs, heads, dim]
        KV back to back (the layout `join_blocks` reads). All torch work happens here, on the
        step thread, so kvbm's threads only copy bytes (no second torch thread pool)."""
        layers = self.runner.export_blocks(block_ids)  # per layer [2, n, bs, heads, dim]
        stacked = torch.stack(layers).movedim(2, 0).contiguous()  # [n, layers, 2, bs, ...]
        flat = stacked.view(len(block_ids), -1).view(torch.uint8).numpy()
        return list(flat)

    def onboard(self, seq: Sequence, num_cached_tokens: int) -> int:
        """Bring the prompt's next blocks from G2/G3 into G1 (as many as are free); returns
        the tokens they hold, now cached in the sequence's table."""
        blocks = self.blocks
        bs = blocks.block_size
        candidates = blocks.onboard_candidates(seq, num_cached_tokens)
        limit = min(len(candidates), blocks.num_free_blocks)
        num_prompt_blocks = num_cached_tokens // bs + len(candidates)
        result = self.kvbm.onboard(
            candidates[:limit],
            num_device_hits=num_cached_tokens // bs,
            num_lookup_blocks=num_prompt_blocks,
        )
        if not result.num_blocks:
            return 0
        block_ids = blocks.allocate_onboarded(seq, result.num_blocks)
        self.flush_evicted()  # the fresh blocks may have been evicted just now: save them first
        self.runner.import_blocks(block_ids, join_blocks(result.blocks, self._template))
        self.num_onboarded_blocks += result.num_blocks
        logger.debug(
            "request_id=%s onboarded %d blocks (%s)", seq.request_id, result.num_blocks,
            ",".join(result.tiers),
        )  # fmt: skip
        return result.num_blocks * bs

    def close(self) -> None:
        self.kvbm.close()
