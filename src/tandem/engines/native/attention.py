"""Attention over the paged KV cache, for a flat (varlen) batch of tokens.

Token rows are ordered: first one row per decoding sequence, then each prefill chunk.
Decode rows are attended in one padded, masked batch; each prefill chunk with one SDPA
call (causal over its cached prefix + itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True, kw_only=True)
class PrefillSpan:
    """Rows [start, end) of the batch are tokens of one sequence at positions
    [ctx_len - (end - start), ctx_len); `context_blocks` hold the K/V of all ctx_len."""

    start: int
    end: int
    ctx_len: int
    context_blocks: torch.Tensor  # [ceil(ctx_len / block_size)] long
    mask: torch.Tensor | None  # [q_len, ctx_len] bool; None = no cached prefix (pure causal)


@dataclass(slots=True, kw_only=True)
class SingleDecode:
    """The one sequence of a batch-1 decode step: its new token goes to `slot` and
    attends over ctx_len tokens, whose blocks are `table`. The torch path reads K/V in place
    when the blocks are consecutive (`first_slot`), else gathers `blocks` a block at a time,
    and applies RoPE as `rope`, the [d, d] matrix of its position; each is derived from
    `table` when not given."""

    slot: int
    ctx_len: int
    rope: torch.Tensor | None = None
    first_slot: int | None = None
    blocks: torch.Tensor | None = None
    table: list[int] | None = None

    def context(self, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[ctx_len, kv_heads, d] of one cache plane, given as slots and as block rows."""
        if self.first_slot is None and self.blocks is None:
            self._locate(slots.shape[0] // rows.shape[0], slots.device)
        if self.first_slot is not None:
            return slots[self.first_slot : self.first_slot + self.ctx_len]
        assert self.blocks is not None
        gathered = rows.index_select(0, self.blocks).view(-1, *slots.shape[1:])
        return gathered[: self.ctx_len]

    def _locate(self, block_size: int, device: torch.device) -> None:
        table = self.table
        assert table is not None, "SingleDecode needs table, first_slot or blocks"
        first = table[0]
        if table == list(range(first, first + len(table))):
            self.first_slot = first * block_size
        else:
            self.blocks = torch.tensor(table, dtype=torch.long, device=device)

    def c_index(self, block_size: int) -> torch.Tensor:
        """int64 [position, slot, ctx_len, *block table] on the CPU (what the C ops read)."""
        table = self.table
        if table is None:
            if self.blocks is not None:
                table = self.blocks.tolist()
            else:
                assert self.first_slot is not None
                first = self.first_slot // block_size
                table = list(range(first, first - (-self.ctx_len // block_size)))
        index = [self.ctx_len - 1, self.slot, self.ctx_len, *table]
        return torch.tensor(index, dtype=torch.long, device="cpu")


@dataclass(slots=True, kw_only=True)
class AttentionMetadata:
    """Everything the attention of every layer needs for one step; built once per step."""

    slot_mapping: torch.Tensor  # [T] long: where each row's K/V is written
    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor  # [T, 1, head_dim]
    num_decode: int = 0
    decode_blocks: torch.Tensor | None = None  # [D * max_blocks] long, padded with block 0
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size]: bool (True =
    # attend) or additive float (0 / -inf)
    decode_gather: tuple[torch.Tensor, torch.Tensor] | None = None  # K/V gather buffers
    prefills: list[PrefillSpan] = field(default_factory=list)
    rope: torch.Tensor | None = None  # [T, d, d] RoPE matrices (LlamaModel.rope_matrices)
    # what the C ops read (tandem.engines.native.ops); without them the torch path runs
    positions: torch.Tensor | None = None  # [T] long
    decode_lens: torch.Tensor | None = None  # [D] long: context length of each decode row
    single: SingleDecode | None = None  # set for a batch-1 decode step (LlamaModel.decode_one)


FP16_MAX = 65504.0


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as KV cache elements of `dtype`, as the C ops store them: rounded to nearest even,
    saturating at the fp16 range (not inf) for float16; NaN stays NaN."""
    if dtype == torch.float16:
        x = x.clamp(-FP16_MAX, FP16_MAX)
    return x.to(dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
    *,
    scale: float | None = None,
) -> None:
    """Write this step's k/v [T, kv_heads, d] into the cache, then attention of q
    [T, heads, d] into `out` [T, heads, d]. k_cache/v_cache: [num_blocks, block_size,
    kv_heads, d]; K/V are gathered a whole block at a time. `scale`: SDPA's (None = 1/sqrt(d)).
    A cache of a narrower dtype (fp16) stores k/v rounded, and every read of it (this step's
    own k/v too, so that a cached prefix and a fresh one give the same result) widens them
    back to q's dtype."""
    num_blocks, _, kv_heads, dim = k_cache.shape
    if k_cache.dtype != k.dtype:
        k, v = to_cache(k, k_cache.dtype), to_cache(v, v_cache.dtype)
    k_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, v)
    # 2-D views: index_select copies whole rows (one block each) ~2.5x faster than on 4-D
    k_rows, v_rows = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)
    num_decode = meta.num_decode
    if num_decode:
        assert meta.decode_blocks is not None
        qd = q[:num_decode].unsqueeze(2)  # [D, H, 1, d]
        shape = (num_decode, -1, kv_heads, dim)
        if meta.decode_gather is None:  # one pair of buffers for every layer of the step
            rows = (len(meta.decode_blocks), k_rows.shape[1])
            meta.decode_gather = (k_rows.new_empty(rows), v_rows.new_empty(rows))
        k_buf, v_buf = meta.decode_gather
        kd = torch.index_select(k_rows, 0, meta.decode_blocks, out=k_buf)
        vd = torch.index_select(v_rows, 0, meta.decode_blocks, out=v_buf)
        kd, vd = kd.view(shape).transpose(1, 2), vd.view(shape).transpose(1, 2)
        kd, vd = kd.to(q.dtype), vd.to(q.dtype)
        res = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=True, scale=scale
        )
        out[:num_decode] = res.squeeze(2)
    prefill_attention(q, k, v, k_rows, v_rows, meta, out, scale=scale)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
    *,
    scale: float | None = None,
) -> None:
    """Attention of each prefill span of q [T, heads, d] into `out`, over its own k/v
    [T, kv_heads, d] or, with a cached prefix, its blocks of the cache (block rows
    [num_blocks, block_size * kv_heads * d]; this step's K/V already written there)."""
    kv_heads, dim = k.shape[1], k.shape[2]
    for span in meta.prefills:
        qp = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, d]
        if span.mask is None:
            kp = k[span.start : span.end]
            vp = v[span.start : span.end]
        else:
            kp = k_rows.index_select(0, span.context_blocks).view(-1, kv_heads, dim)
            vp = v_rows.index_select(0, span.context_blocks).view(-1, kv_heads, dim)
            kp, vp = kp[: span.ctx_len], vp[: span.ctx_len]
        res = F.scaled_dot_product_attention(
            qp,
            kp.transpose(0, 1).unsqueeze(0).to(q.dtype),
            vp.transpose(0, 1).unsqueeze(0).to(q.dtype),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            enable_gqa=True,
            scale=scale,
        )
        out[span.start : span.end] = res[0].transpose(0, 1)
