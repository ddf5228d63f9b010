"""A straightforward, unpaged llama forward (HF-style ops) and the exactness rule shared by
the native engine tests: tokens must match the reference's greedy choice, except at a
near-tie (top-2 logit gap below 1e-3 in fp32), which is verified, never skipped."""

from __future__ import annotations

import torch

from tandem.engines.native.model_config import ModelConfig

TIE_GAP = 1e-3


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def reference_logits(
    c: ModelConfig,
    w: dict[str, torch.Tensor],
    token_ids: list[int],
    input_embeds: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of a full causal forward with no cache; `input_embeds`
    (position → row) replace those positions' token embeddings (image rows)."""
    n, d = len(token_ids), c.head_dim
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    for position, row in (input_embeds or {}).items():
        x[position] = row
    mask = torch.full((n, n), float("-inf")).triu(1)
    group = c.num_heads // c.num_kv_heads
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, c.num_heads, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, c.num_kv_heads, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, c.num_kv_heads, d)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5 + mask
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], c.rms_norm_eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


class Reference:
    """Teacher-forced checks of engine outputs against `reference_logits`."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config, self.weights = config, weights
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}
        self.num_ties = 0

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        key = tuple(token_ids)
        if key not in self._cache:
            self._cache[key] = reference_logits(self.config, self.weights, token_ids)
        return self._cache[key]

    def check_greedy(self, prompt: list[int], output: list[int]) -> None:
        """Every output token is the reference's argmax given the tokens before it, or
        within TIE_GAP of the max (a verified near-tie)."""
        logits = self.logits(prompt + output[:-1])
        for j, token in enumerate(output):
            row = logits[len(prompt) - 1 + j]
            best = int(row.argmax())
            if token != best:
                gap = float(row[best] - row[token])
                assert gap < TIE_GAP, (
                    f"token {j}: engine chose {token}, reference {best}, logit gap {gap:.2e}"
                )
                self.num_ties += 1

    def check_same(self, prompt: list[int], a: list[int], b: list[int]) -> None:
        """Two engine runs agree up to the first difference, which must be a near-tie."""
        for j, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                row = self.logits(prompt + a[:j])[-1]
                gap = abs(float(row[x] - row[y]))
                assert gap < TIE_GAP, f"runs differ at token {j} ({x} vs {y}), logit gap {gap:.2e}"
                self.num_ties += 1
                return
        assert len(a) == len(b), f"runs differ in length: {len(a)} vs {len(b)}"
