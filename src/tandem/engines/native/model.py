"""A llama-family decoder as plain tensors and functions (no nn.Module overhead).

Q/K/V and gate/up projections are fused into one matmul each; residual adds are fused
into the output projections (addmm). The forward runs over a flat batch of tokens with
a paged KV cache of shape [num_layers, 2, num_blocks, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tandem.engines.native.attention import AttentionMetadata, paged_attention
from tandem.engines.native.linear import Linear, can_pack
from tandem.engines.native.model_config import ModelConfig


class LayerWeights(NamedTuple):
    input_norm: torch.Tensor
    qkv: Linear  # hidden -> (H + 2 KVH) * d
    o: Linear  # H * d -> hidden
    post_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * ffn
    down: Linear  # ffn -> hidden


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, head_dim] for rotate-half RoPE (computed as HF does)."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


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
    ) -> None:
        self.config = config
        self.dtype = dtype
        w = {k: v.to(dtype) for k, v in weights.items()}
        pack = pack_weights and can_pack(dtype)
        self.layers = [self._layer(w, i, pack) for i in range(config.num_layers)]
        self.embed = w["model.embed_tokens.weight"].contiguous()
        head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = Linear(head, pack=pack)
        self.norm = w["model.norm.weight"]
        cos, sin = rope_tables(config, max_positions or config.context_length)
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int, pack: bool) -> LayerWeights:
        p = f"model.layers.{i}."
        qkv = torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        return LayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=Linear(qkv, pack=pack),
            o=Linear(w[p + "self_attn.o_proj.weight"], pack=pack),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=Linear(gate_up, pack=pack),
            down=Linear(w[p + "mlp.down_proj.weight"], pack=pack),
        )

    def weight_bytes(self) -> int:
        """Bytes streamed per decode step: every layer weight and the output head once (the
        embedding lookup reads only a few rows)."""
        total = 0
        for layer in self.layers:
            total += sum(lin.num_bytes for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
            total += (
                layer.input_norm.numel() + layer.post_norm.numel()
            ) * layer.input_norm.element_size()
        return total + self.lm_head.num_bytes

    def new_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        c = self.config
        shape = (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        return torch.zeros(shape, dtype=self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [len(logits_rows), vocab] (fp32) for the given rows of the flat batch;
        writes every row's K/V into `kv_cache` at `meta.slot_mapping`."""
        c = self.config
        num_tokens = input_ids.shape[0]
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        eps, hidden_shape = c.rms_norm_eps, (c.hidden_size,)
        x = F.embedding(input_ids, self.embed)
        attn_out = torch.empty(num_tokens, heads, dim, dtype=self.dtype)
        cos, sin = meta.cos, meta.sin
        half = dim // 2
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, hidden_shape, layer.input_norm, eps)
            qkv = layer.qkv(h)
            qk = qkv[:, :k_end].view(num_tokens, heads + kv_heads, dim)
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin
            v = qkv[:, k_end:].view(num_tokens, kv_heads, dim)
            paged_attention(
                qk[:, :heads], qk[:, heads:], v, kv_cache[i, 0], kv_cache[i, 1], meta, attn_out
            )
            x = layer.o(attn_out.view(num_tokens, q_end), residual=x)
            h = F.rms_norm(x, hidden_shape, layer.post_norm, eps)
            gate_up = layer.gate_up(h)
            ffn = gate_up.shape[1] // 2
            act = F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
            x = layer.down(act, residual=x)
        last = F.rms_norm(x[logits_rows], hidden_shape, self.norm, eps)
        return self.lm_head(last).float()
