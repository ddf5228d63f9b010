"""A llama-family decoder as plain tensors and functions (no nn.Module overhead).

Q/K/V and gate/up projections are fused into one matmul each; residual adds are fused
into the output projections (addmm). Each RMSNorm weight is folded into the columns of the
projection that follows it (and the attention scale into the Q rows when it is a power of
two, which is exact), so a norm is one reduction and one scale. The KV cache has shape
[num_layers, 2, num_blocks, block_size, kv_heads, head_dim].

Two forwards: `hidden` runs any flat batch of tokens (prefill chunks and decodes);
`decode_one` is the batch-1 decode step, where the time goes to streaming weights and every
extra kernel is overhead: norms reduce to a Python scalar, RoPE is one small matmul, and
attention reads the sequence's K/V in place when its blocks are consecutive.

`device`: where the weights, the rope tables and the KV cache live. The CPU runs the C ops
(tandem.engines.native.ops) where they build; any other device (CUDA) runs the torch code
below, which is also the CPU's fallback (TANDEM_NATIVE_OPS=torch), so one code path serves
both. Step tensors are created on `device` by their builders (ModelRunner, embedding).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tandem.engines.native.adapters import DOWN, GATE_UP, OUT, QKV, LoraStep
from tandem.engines.native.arena import huge_page_copies
from tandem.engines.native.attention import (
    AttentionMetadata,
    SingleDecode,
    paged_attention,
    to_cache,
)
from tandem.engines.native.head import OutputHead, fast_bf16_available
from tandem.engines.native.linear import Linear, can_pack
from tandem.engines.native.model_config import ModelConfig
from tandem.engines.native.ops import CpuOps, DecoderPlan, cpu_ops


class LayerWeights(NamedTuple):
    qkv: Linear  # hidden -> (H + 2 KVH) * d, input norm (and attention scale) folded in
    o: Linear  # H * d -> hidden
    gate_up: Linear  # hidden -> 2 * ffn, post-attention norm folded in
    down: Linear  # ffn -> hidden


class KvViews(NamedTuple):
    """One layer of the KV cache seen as slots [num_slots, kv_heads, d] and as block rows."""

    k_slots: torch.Tensor
    v_slots: torch.Tensor
    k_rows: torch.Tensor
    v_rows: torch.Tensor


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, head_dim] for rotate-half RoPE (computed as HF does, on the
    CPU so that every device gets the same table)."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rope_index(dim: int) -> torch.Tensor:
    """Flat positions in a [dim, dim] matrix M (out = q @ M) of cos_i on the diagonal,
    -sin_i at (i + half, i) and sin_{i + half} at (i, i + half), for i < half."""
    half, i = dim // 2, torch.arange(dim // 2)
    return torch.cat((torch.arange(dim) * (dim + 1), (i + half) * dim + i, i * dim + i + half))


class LlamaModel:
    """Weights + forward. Not thread-safe: one step at a time."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        pack_weights: bool = True,
        screen_head: bool | None = None,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype  # the KV cache's elements
        self.device = torch.device(device)
        scale = config.head_dim**-0.5
        self.attn_scale = 1.0 if math.frexp(scale)[0] == 0.5 else scale  # 2^k folds exactly
        # the gate/up projection's output columns in the glu order (adapters.py); _build sets it
        self.lora_gate_up_glu = False
        self._build(weights, pack_weights, scale / self.attn_scale, screen_head)
        cos, sin = rope_tables(config, max_positions or config.context_length)
        self.cos, self.sin = cos.to(self.device, dtype), sin.to(self.device, dtype)
        self._rope_index = _rope_index(config.head_dim).to(self.device)
        self._kv_views: tuple[tuple[int, tuple[int, ...]], list[KvViews]] | None = None
        if self.device.type == "cpu":
            self._place_streamed_weights()
        self._cpu_ops = cpu_ops(dtype, self.device, self.kv_dtype)
        # all layers in one C call where every projection is a C quantized kernel
        self._plan: DecoderPlan | None = None
        if self._cpu_ops is not None and all(
            getattr(lin, "c_args", None) is not None for layer in self.layers for lin in layer
        ):
            self._plan = DecoderPlan(self.layers)  # type: ignore[arg-type]
        # False: the same kernels called layer by layer from Python (what tests compare with)
        self.fuse_layers = True

    def c_ops(self, kv_cache: torch.Tensor) -> CpuOps | None:
        """The C ops for a step on `kv_cache` (None: its device or dtype runs torch ops)."""
        ops = self._cpu_ops
        if ops is None or kv_cache.device.type != "cpu" or kv_cache.dtype != ops.kv_dtype:
            return None
        return ops

    def _build(
        self,
        weights: dict[str, torch.Tensor],
        pack_weights: bool,
        q_scale: float,
        screen_head: bool | None,
    ) -> None:
        """Set `layers`, `embed` and `head` from HF-named weights (subclasses: other formats)."""
        config, dtype, device = self.config, self.dtype, self.device
        w = {k: v.to(device, torch.float32) for k, v in weights.items()}
        pack = pack_weights and can_pack(dtype, device)
        self.layers = [self._layer(w, i, pack, q_scale, dtype) for i in range(config.num_layers)]
        self.norm_weights = _norm_weights(w, config.num_layers)
        self.embed = w["model.embed_tokens.weight"].to(dtype).contiguous()
        self.final_norm = w["model.norm.weight"].clone()  # fp32; the head has it folded in
        head = w["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
        screen = fast_bf16_available() if screen_head is None else screen_head
        self.head = OutputHead((head * w["model.norm.weight"]).to(dtype), pack=pack, screen=screen)

    def _place_streamed_weights(self) -> None:
        """Move what a decode step streams onto huge pages (see `arena`)."""
        linears = [lin for layer in self.layers for lin in layer] + [self.head.linear]
        tensors = [lin.weight_t for lin in linears]
        if self.head.low is not None:
            tensors.append(self.head.low)
        copies = huge_page_copies(tensors)
        for lin, weight_t in zip(linears, copies, strict=False):
            lin.weight_t = weight_t
        if self.head.low is not None:
            self.head.low = copies[-1]

    @staticmethod
    def _layer(
        w: dict[str, torch.Tensor], i: int, pack: bool, q_scale: float, dtype: torch.dtype
    ) -> LayerWeights:
        p = f"model.layers.{i}."
        q = w[p + "self_attn.q_proj.weight"] * q_scale
        qkv = torch.cat([q, w[p + "self_attn.k_proj.weight"], w[p + "self_attn.v_proj.weight"]])
        gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        return LayerWeights(
            qkv=Linear((qkv * w[p + "input_layernorm.weight"]).to(dtype), pack=pack),
            o=Linear(w[p + "self_attn.o_proj.weight"].to(dtype), pack=pack),
            gate_up=Linear(
                (gate_up * w[p + "post_attention_layernorm.weight"]).to(dtype), pack=pack
            ),
            down=Linear(w[p + "mlp.down_proj.weight"].to(dtype), pack=pack),
        )

    def weight_bytes(self) -> int:
        """Bytes streamed per decode step: every layer weight and the fp32 output head once
        (the embedding lookup reads only a few rows)."""
        total = sum(
            lin.num_bytes
            for layer in self.layers
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        return total + self.head.num_bytes

    def new_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        c = self.config
        shape = (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def rope_matrix(self, position: int) -> torch.Tensor:
        """[d, d] M with q @ M == rotate-half RoPE of q at `position`."""
        d, half = self.config.head_dim, self.config.head_dim // 2
        cos, sin = self.cos[position], self.sin[position]
        m = torch.zeros(d * d, dtype=self.dtype, device=self.device)
        m[self._rope_index] = torch.cat((cos, -sin[:half], sin[half:]))
        return m.view(d, d)

    def rope_matrices(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, d, d]: `rope_matrix` of each position."""
        d, half = self.config.head_dim, self.config.head_dim // 2
        cos, sin = self.cos[positions], self.sin[positions]
        m = torch.zeros(len(positions), d * d, dtype=self.dtype, device=self.device)
        m[:, self._rope_index] = torch.cat((cos, -sin[:, :half], sin[:, half:]), dim=1)
        return m.view(-1, d, d)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [len(logits_rows), vocab] (fp32) for the given rows of the flat batch;
        writes every row's K/V into `kv_cache` at `meta.slot_mapping`."""
        return self.head.logits(self.hidden(input_ids, meta, kv_cache, logits_rows))

    def hidden(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        rows: torch.Tensor,
        input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [len(rows), hidden] (the head's input) of the given
        rows of the flat batch; writes every row's K/V into `kv_cache`. `input_embeds`
        (row indices, their embeddings) replace those rows' token embeddings (image rows).
        `lora`: the LoRA adapters of row segments, added to each projection (adapters.py)."""
        c = self.config
        num_tokens = input_ids.shape[0]
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        eps = c.rms_norm_eps
        x = F.embedding(input_ids, self.embed)
        if input_embeds is not None:
            x[input_embeds[0]] = input_embeds[1]
        attn_out = torch.empty(num_tokens, heads, dim, dtype=self.dtype, device=self.device)
        inv_n = 1.0 / c.hidden_size
        ops = self.c_ops(kv_cache)
        if ops is not None and meta.positions is not None:
            return self._hidden_c(ops, x, meta, kv_cache, rows, lora)
        for i, layer in enumerate(self.layers):
            xn = _rms_normalize(x, inv_n, eps)
            qkv = layer.qkv(xn)
            if lora is not None:
                lora.add(qkv, xn, i, QKV)
            qk = self._rope(qkv[:, :k_end].view(num_tokens, heads + kv_heads, dim), meta)
            v = qkv[:, k_end:].view(num_tokens, kv_heads, dim)
            paged_attention(
                qk[:, :heads],
                qk[:, heads:],
                v,
                kv_cache[i, 0],
                kv_cache[i, 1],
                meta,
                attn_out,
                scale=self.attn_scale,
            )
            attn_2d = attn_out.view(num_tokens, q_end)
            x = layer.o(attn_2d, residual=x)
            if lora is None:
                gate_up = layer.gate_up(_rms_normalize(x, inv_n, eps))
                x = layer.down(_silu_mul(layer.gate_up, gate_up), residual=x)
                continue
            lora.add(x, attn_2d, i, OUT)
            xn = _rms_normalize(x, inv_n, eps)
            if lora.adapts_gate_up:
                h = self.lora_gate_up(i, x, xn, lora, None, eps)
            else:
                h = _silu_mul(layer.gate_up, layer.gate_up(xn))
            x = layer.down(h, residual=x)
            lora.add(x, h, i, DOWN)
        return _rms_normalize(x[rows], inv_n, eps)

    def lora_gate_up(
        self, layer: int, x: torch.Tensor, xn: torch.Tensor, lora: LoraStep,
        ops: CpuOps | None, eps: float,
    ) -> torch.Tensor:  # fmt: skip
        """silu(gate) * up of layer `layer`'s gate/up projection of RMSNorm(x) (`xn`, the
        norm's weight not applied) with `lora`'s gate/up update added before the activation
        (the layer-by-layer paths; the fused decoder does it in C)."""
        y = self.layers[layer].gate_up(xn)  # an fp32 Linear: [gate | up]
        lora.add(y, xn, layer, GATE_UP)
        if ops is not None:
            return ops.silu_mul(y.contiguous())
        ffn = y.shape[1] // 2
        return F.silu(y[:, :ffn]).mul_(y[:, ffn:])

    @property
    def fuses_lora(self) -> bool:
        """A step with LoRA adapters runs in the one-call C decoder, batch 1 included."""
        return self._plan is not None and self.fuse_layers

    def _hidden_c(
        self,
        ops: CpuOps,
        x: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        rows: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """`hidden` through the C ops: RoPE and the K/V store in one call a layer, decode
        rows attend over the paged cache in place (no gather), and so do prefill spans
        (blocks of rows sharing each key and value load)."""
        c = self.config
        num_tokens = x.shape[0]
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_end = heads * dim
        eps, bs = c.rms_norm_eps, kv_cache.shape[3]
        attn_out = torch.empty(num_tokens, heads, dim, dtype=self.dtype, device=self.device)
        num_decode = meta.num_decode
        tables = lens = None
        if num_decode:
            assert meta.decode_blocks is not None and meta.decode_lens is not None
            tables, lens = meta.decode_blocks.view(num_decode, -1), meta.decode_lens
        positions = meta.positions
        assert positions is not None
        if self._plan is not None and self.fuse_layers:
            x = x.contiguous()
            spans = [(s.start, s.end, s.ctx_len, s.context_blocks) for s in meta.prefills]
            decode = None if tables is None or lens is None else (num_decode, tables, lens)
            ops.decoder(
                self._plan, x, heads, kv_heads, eps, self.attn_scale, positions, self.cos,
                self.sin, meta.slot_mapping, kv_cache, decode, spans, attn_out,
                None if lora is None else lora.c_rows(num_tokens),
            )  # fmt: skip
            return ops.rms_normalize(x[rows].contiguous(), eps)
        for i, (layer, kv) in enumerate(zip(self.layers, self.kv_views(kv_cache), strict=True)):
            qkv = _normed(ops, layer.qkv, x, eps).contiguous()
            if lora is not None:
                lora.add(qkv, ops.rms_normalize(x, eps), i, QKV)
            ops.rope_store(
                qkv, heads, kv_heads, positions, self.cos, self.sin, meta.slot_mapping,
                kv.k_slots, kv.v_slots,
            )  # fmt: skip
            if tables is not None and lens is not None:
                ops.decode_attention(
                    qkv, num_decode, heads, kv.k_slots, kv.v_slots, bs, tables, lens,
                    self.attn_scale, attn_out,
                )  # fmt: skip
            for span in meta.prefills:
                ops.prefill_attention(
                    qkv[span.start : span.end], heads, kv.k_slots, kv.v_slots, bs,
                    span.context_blocks, span.ctx_len, self.attn_scale,
                    attn_out[span.start : span.end],
                )  # fmt: skip
            if lora is None:
                x = layer.o(attn_out.view(num_tokens, q_end), residual=x)
                x = layer.down(_ffn_act(ops, layer.gate_up, x, eps), residual=x)
                continue
            attn_2d = attn_out.view(num_tokens, q_end)
            x = layer.o(attn_2d, residual=x)
            lora.add(x, attn_2d, i, OUT)
            if lora.adapts_gate_up:
                h = self.lora_gate_up(i, x, ops.rms_normalize(x, eps), lora, ops, eps)
            else:
                h = _ffn_act(ops, layer.gate_up, x, eps)
            x = layer.down(h, residual=x)
            lora.add(x, h, i, DOWN)
        return ops.rms_normalize(x[rows].contiguous(), eps)

    @staticmethod
    def _rope(qk: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Rotate-half RoPE of qk [T, heads, d]: one bmm with the step's per-token
        matrices when it has them (few tokens), else elementwise."""
        if meta.rope is not None:
            return torch.bmm(qk, meta.rope)
        half = qk.shape[-1] // 2
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        return qk * meta.cos + rotated * meta.sin

    def decode_one(
        self, token: int, step: SingleDecode, kv_cache: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The batch-1 decode step: final-normed hidden [1, hidden] of `token`; writes its
        K/V at `step.slot`. Same math as `hidden`, a third of the kernels. `lora`: the row's
        adapter, only where the model `fuses_lora` (the runner sends it the batch way else)."""
        ops = self.c_ops(kv_cache)
        if lora is not None and (ops is None or not self.fuses_lora):
            raise ValueError("a batch-1 step with a LoRA adapter needs the fused C decoder")
        if ops is not None:
            return self._decode_one_c(ops, token, step, kv_cache, lora)
        c = self.config
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        group, k_end = heads // kv_heads, (heads + kv_heads) * dim
        inv_n, eps, scale = 1.0 / c.hidden_size, c.rms_norm_eps, self.attn_scale
        attn = torch.empty(kv_heads, group, dim, dtype=self.dtype, device=self.device)
        rope = step.rope if step.rope is not None else self.rope_matrix(step.ctx_len - 1)
        x = self.embed[token].unsqueeze(0)
        for layer, kv in zip(self.layers, self.kv_views(kv_cache), strict=True):
            qkv = layer.qkv(x, alpha=_rms_scale(x, inv_n, eps))[0]
            rot = torch.mm(qkv[:k_end].view(-1, dim), rope)  # [H + KVH, d]
            kv.k_slots[step.slot] = to_cache(rot[heads:], kv.k_slots.dtype)
            kv.v_slots[step.slot] = to_cache(qkv[k_end:].view(kv_heads, dim), kv.v_slots.dtype)
            keys = step.context(kv.k_slots, kv.k_rows).to(self.dtype)  # widened from the cache
            values = step.context(kv.v_slots, kv.v_rows).to(self.dtype)
            scores = torch.bmm(rot[:heads].view(kv_heads, group, dim), keys.permute(1, 2, 0))
            if scale != 1.0:
                scores.mul_(scale)
            torch.bmm(scores.softmax(-1), values.transpose(0, 1), out=attn)
            x = layer.o(attn.view(1, -1), residual=x)
            gate_up = layer.gate_up(x, alpha=_rms_scale(x, inv_n, eps))
            x = layer.down(_silu_mul(layer.gate_up, gate_up), residual=x)
        return x * _rms_scale(x, inv_n, eps)

    def _decode_one_c(
        self, ops: CpuOps, token: int, step: SingleDecode, kv_cache: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """`decode_one` through the C ops: per layer four C calls and the four projections."""
        c = self.config
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        eps, scale, bs = c.rms_norm_eps, self.attn_scale, kv_cache.shape[3]
        index = step.c_index(bs)
        pos, slot, ctx, table = index[0:1], index[1:2], index[2:3], index[3:].view(1, -1)
        attn = torch.empty(1, heads * dim, dtype=self.dtype, device=self.device)
        if self._plan is not None and self.fuse_layers:
            x = self.embed[token].unsqueeze(0).clone()  # the decoder writes x in place
            ops.decoder(
                self._plan, x, heads, kv_heads, eps, scale, pos, self.cos, self.sin, slot,
                kv_cache, (1, table, ctx), [], attn, None if lora is None else lora.c_rows(1),
            )  # fmt: skip
            return x * ops.rms_scale(x, eps)
        x = self.embed[token].unsqueeze(0)
        for layer, kv in zip(self.layers, self.kv_views(kv_cache), strict=True):
            qkv = _normed(ops, layer.qkv, x, eps, one_row=True).contiguous()
            ops.rope_store(
                qkv, heads, kv_heads, pos, self.cos, self.sin, slot, kv.k_slots, kv.v_slots
            )
            ops.decode_attention(
                qkv, 1, heads, kv.k_slots, kv.v_slots, bs, table, ctx, scale, attn
            )  # fmt: skip
            x = layer.o(attn, residual=x)
            x = layer.down(_ffn_act(ops, layer.gate_up, x, eps, one_row=True), residual=x)
        return x * ops.rms_scale(x, eps)

    def kv_views(self, kv_cache: torch.Tensor) -> list[KvViews]:
        """Per-layer views of `kv_cache` (cached for the last cache seen)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if self._kv_views is None or self._kv_views[0] != key:
            _, _, num_blocks, _, kv_heads, dim = kv_cache.shape
            views = [
                KvViews(
                    layer[0].view(-1, kv_heads, dim),
                    layer[1].view(-1, kv_heads, dim),
                    layer[0].view(num_blocks, -1),
                    layer[1].view(num_blocks, -1),
                )
                for layer in kv_cache
            ]
            self._kv_views = (key, views)
        return self._kv_views[1]


def _norm_weights(
    w: dict[str, torch.Tensor], num_layers: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (input norm, post-attention norm) weights, fp32: folded into the base
    projections, and into a LoRA adapter's A when one loads (adapters.py)."""
    return [
        (
            w[f"model.layers.{i}.input_layernorm.weight"].float().clone(),
            w[f"model.layers.{i}.post_attention_layernorm.weight"].float().clone(),
        )
        for i in range(num_layers)
    ]


def _rms_normalize(x: torch.Tensor, inv_n: float, eps: float) -> torch.Tensor:
    """x / RMS(x) per row (RMSNorm; its weight is folded into the next projection)."""
    scale: torch.Tensor = torch.linalg.vecdot(x, x).mul_(inv_n).add_(eps).rsqrt_()
    return x * scale.unsqueeze(1)


def _rms_scale(x: torch.Tensor, inv_n: float, eps: float) -> float:
    """1 / RMS of the single row x (the RMSNorm factor; its weight is folded downstream)."""
    row = x[0]
    return 1.0 / math.sqrt(float(torch.dot(row, row)) * inv_n + eps)


def _normed(
    ops: CpuOps, lin: Linear, x: torch.Tensor, eps: float, *, one_row: bool = False
) -> torch.Tensor:
    """lin(RMSNorm(x)), the norm's weight folded into `lin`: in `lin`'s own kernel where it
    fuses the norm (a QuantLinear: the same arithmetic for one row or many), else x is
    normalized first (one row: as a scalar factor riding the projection)."""
    if lin.fuses_norm:
        return lin(x, norm_eps=eps)
    if one_row:
        return lin(x, alpha=ops.rms_scale(x, eps))
    return lin(ops.rms_normalize(x, eps))


def _ffn_act(
    ops: CpuOps, gate_up: Linear, x: torch.Tensor, eps: float, *, one_row: bool = False
) -> torch.Tensor:
    """silu(gate) * up of RMSNorm(x) through the fused gate/up projection: one kernel where
    the projection computes the activation itself (a glu QuantLinear), else two."""
    y = _normed(ops, gate_up, x, eps, one_row=one_row)
    return y if gate_up.glu else ops.silu_mul(y.contiguous())


def _silu_mul(gate_up: Linear, y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from the gate/up projection's output (already that for a glu one)."""
    if gate_up.glu:
        return y
    ffn = y.shape[1] // 2
    return F.silu(y[:, :ffn]).mul_(y[:, ffn:])
