"""Turns a scheduled batch into tensors (token ids, positions, KV slots, attention
metadata), runs the model and samples. Owns the KV cache tensor."""

from __future__ import annotations

import torch

from tandem.engines.native.attention import AttentionMetadata, PrefillSpan
from tandem.engines.native.block_manager import BlockManager
from tandem.engines.native.model import LlamaModel
from tandem.engines.native.sampler import Sampler
from tandem.engines.native.scheduler import ScheduledBatch
from tandem.engines.native.sequence import Sequence


class ModelRunner:
    """Not thread-safe; one step at a time on the engine thread."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.kv_cache = model.new_kv_cache(num_blocks, block_size)
        self.sampler = Sampler(seed)
        self._arange = torch.arange(block_size)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, block_manager: BlockManager) -> dict[int, int]:
        """Forward the batch; returns {seq_id: sampled token} for sequences whose chunk
        reached the end of their tokens (the others are mid-prefill)."""
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            ids += seq.token_ids[start : start + num_new]
            positions += range(start, start + num_new)
            if start + num_new == len(seq.token_ids):
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        pos = torch.tensor(positions, dtype=torch.long)
        meta = self._metadata(batch, block_manager, pos)
        rows = torch.tensor(sample_rows, dtype=torch.long)
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long), meta, self.kv_cache, rows)
        if not sample_seqs:
            return {}
        tokens = self.sampler(logits, sample_seqs)
        return {seq.seq_id: tok for seq, tok in zip(sample_seqs, tokens, strict=True)}

    def _slots(self, table: list[int], num_tokens: int) -> torch.Tensor:
        blocks = torch.tensor(table, dtype=torch.long)
        return (blocks[:, None] * self.block_size + self._arange).flatten()[:num_tokens]

    def _metadata(
        self, batch: ScheduledBatch, block_manager: BlockManager, pos: torch.Tensor
    ) -> AttentionMetadata:
        slot_parts: list[torch.Tensor] = []
        decode_ctx: list[torch.Tensor] = []
        prefills: list[PrefillSpan] = []
        row = 0
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            ctx_len = seq.num_computed_tokens + num_new
            slots = self._slots(block_manager.block_table(seq), ctx_len)
            slot_parts.append(slots[ctx_len - num_new :])
            if num_new == 1:
                decode_ctx.append(slots)
            else:
                mask = None
                if seq.num_computed_tokens:
                    q_pos = torch.arange(seq.num_computed_tokens, ctx_len)
                    mask = torch.arange(ctx_len)[None, :] <= q_pos[:, None]
                prefills.append(
                    PrefillSpan(start=row, end=row + num_new, context_slots=slots, mask=mask)
                )
            row += num_new
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts),
            cos=self.model.cos[pos].unsqueeze(1),
            sin=self.model.sin[pos].unsqueeze(1),
            num_decode=len(decode_ctx),
            prefills=prefills,
        )
        if decode_ctx:
            lengths = torch.tensor([len(s) for s in decode_ctx])
            meta.decode_slots = torch.nn.utils.rnn.pad_sequence(decode_ctx, batch_first=True)
            mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
            meta.decode_mask = mask[:, None, None, :]
        return meta

    def export_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Per layer, a contiguous copy [2, n, block_size, kv_heads, head_dim] of the blocks."""
        index = torch.tensor(block_ids, dtype=torch.long)
        return [layer.index_select(1, index) for layer in self.kv_cache]

    def import_blocks(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        """Write per-layer data (as from `export_blocks`) into the given blocks."""
        if len(data) != self.kv_cache.shape[0]:
            raise ValueError(
                f"got {len(data)} layers of KV data; expected {self.kv_cache.shape[0]}"
            )
        index = torch.tensor(block_ids, dtype=torch.long)
        for layer, part in zip(self.kv_cache, data, strict=True):
            layer.index_copy_(1, index, part.to(layer.dtype))

    @property
    def bytes_per_block(self) -> int:
        kv = self.kv_cache
        return kv[:, :, 0].numel() * kv.element_size()
