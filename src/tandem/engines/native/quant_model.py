"""`QuantLlamaModel`: the llama decoder with int8 or int4 weight-only quantized projections.

Same forwards as `LlamaModel` (they call each projection as `linear(x, residual, alpha=)`);
what differs is what a projection is. RMSNorm weights cannot be folded into quantized
columns exactly, so each `QuantLinear` applies its norm weight to the activations while it
quantizes them (no extra pass). The attention scale is folded into the Q rows' group scales
when it is a power of two (exact), as in fp32. The output head keeps int8 codes for both
formats (the SmolLM2 GGUF stores its tied embedding as Q8_0, as llama.cpp serves it); the
embedding table stays fp32 for the row lookups.

Weights are converted on the CPU (where they were loaded) and then moved to `device`: on the
CPU the C kernels pack them, elsewhere the codes stay in source order for the torch path
(tandem.engines.native.quant.QuantLinear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engines.native.adapters import GATE_UP, LoraStep
from tandem.engines.native.model import LayerWeights, LlamaModel
from tandem.engines.native.model_config import ModelConfig
from tandem.engines.native.ops import CpuOps
from tandem.engines.native.quant import (
    GLU_ROWS,
    PackedWeight,
    QuantLinear,
    QWeight,
    cat_rows,
    convert,
    dequantize,
    matmul_torch,
)
from tandem.engines.native.quant import scale_rows as _scale_rows
from tandem.engines.native.quant_screen import ArgmaxScreen

QuantWeights = dict[str, torch.Tensor | QWeight]


class QuantHead:
    """logits(x) = x @ W^T from int8 codes; greedy = argmax of those logits, from a screening
    pass where the build has one (quant_screen.ArgmaxScreen: the same tokens, about half the integer
    products; in a decode step, measured: head 7.5 -> 3.9 ms at 32 rows, 2.75 -> 1.9 at 8,
    1.55 -> 1.3 at one). Immutable; thread-safe."""

    def __init__(self, linear: QuantLinear, weight: QWeight) -> None:
        self.linear = linear
        self.low = None  # no bf16 screening copy
        self.screen = ArgmaxScreen(linear, weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def greedy(self, x: torch.Tensor) -> list[int]:
        if self.screen.available:
            picks = self.screen(x)
            if picks is not None:
                return picks
        return self.logits(x).max(dim=-1).indices.tolist()

    @property
    def num_bytes(self) -> int:
        return self.linear.num_bytes


class QuantLlamaModel(LlamaModel):
    """`weights_format` 'int8' or 'int4'; `weights` may hold packed weights (GGUF blocks)
    or fp32 tensors (quantized here). Not thread-safe: one step at a time."""

    def __init__(
        self,
        config: ModelConfig,
        weights: QuantWeights,
        *,
        weights_format: str,
        max_positions: int | None = None,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        if weights_format not in ("int8", "int4"):
            raise ValueError(f"weights_format='{weights_format}'; expected int8 or int4")
        self.weights_format = weights_format
        super().__init__(
            config,
            weights,  # type: ignore[arg-type]
            dtype=torch.float32,
            max_positions=max_positions,
            pack_weights=False,
            screen_head=False,
            device=device,
            kv_dtype=kv_dtype,
        )

    def _build(
        self,
        weights: dict[str, torch.Tensor],
        pack_weights: bool,
        q_scale: float,
        screen_head: bool | None,
    ) -> None:
        w: QuantWeights = dict(weights)
        fmt, c, dev = self.weights_format, self.config, self.device
        self.layers = [self._quant_layer(w, i, fmt, q_scale, dev) for i in range(c.num_layers)]
        self.norm_weights = [
            (
                _dense(w[f"model.layers.{i}.input_layernorm.weight"]).to(dev),
                _dense(w[f"model.layers.{i}.post_attention_layernorm.weight"]).to(dev),
            )
            for i in range(c.num_layers)
        ]
        # a LoRA gate/up update goes on the glu kernel's output before its store (adapters.py)
        self.lora_gate_up_glu = all(
            getattr(layer.gate_up, "c_args", None) is not None for layer in self.layers
        )
        embed = w["model.embed_tokens.weight"]
        self.embed = (embed if isinstance(embed, torch.Tensor) else dequantize(embed)).to(
            dev, torch.float32
        )
        head = w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
        norm = _dense(w["model.norm.weight"]).to(dev)
        self.final_norm = norm  # embeddings apply it after pooling (native.embedding)
        head_q8 = _to_device(convert(head, "int8"), dev)
        self.head = QuantHead(QuantLinear(head_q8, col_scale=norm), head_q8)  # type: ignore[assignment]

    @staticmethod
    def _quant_layer(
        w: QuantWeights, i: int, fmt: str, q_scale: float, device: torch.device
    ) -> LayerWeights:
        p = f"model.layers.{i}."

        def get(name: str) -> QWeight:
            return convert(w[p + name], fmt)

        def linear(weight: QWeight, norm: str | None = None, glu: bool = False) -> QuantLinear:
            scale = None if norm is None else _dense(w[p + norm]).to(device)
            return QuantLinear(_to_device(weight, device), col_scale=scale, glu=glu)

        q = get("self_attn.q_proj.weight")
        if q_scale != 1.0:
            q = type(q)(*(t.clone() for t in q))
            _scale_rows(q, slice(None), q_scale)
        qkv = cat_rows([q, get("self_attn.k_proj.weight"), get("self_attn.v_proj.weight")])
        gate_up = cat_rows([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])
        return LayerWeights(
            qkv=linear(qkv, "input_layernorm.weight"),  # type: ignore[arg-type]
            o=linear(get("self_attn.o_proj.weight")),  # type: ignore[arg-type]
            # silu(gate) * up in the projection's own kernel (no [T, 2 ffn] round trip); its
            # 2 ffn rows are a multiple of 32 as the down projection's groups need ffn to be
            gate_up=linear(gate_up, "post_attention_layernorm.weight", glu=True),  # type: ignore[arg-type]
            down=linear(get("mlp.down_proj.weight")),  # type: ignore[arg-type]
        )

    def lora_gate_up(
        self, layer: int, x: torch.Tensor, xn: torch.Tensor, lora: LoraStep,
        ops: CpuOps | None, eps: float,
    ) -> torch.Tensor:  # fmt: skip
        """The glu projection's own weights without its activation (no second gate/up copy):
        the C kernel with its plain store gives the glu column order (B's gate/up columns
        are in that order: `lora_gate_up_glu`), the torch path [gate | up]."""
        lin = self.layers[layer].gate_up
        assert isinstance(lin, QuantLinear)
        a = lin.c_args
        if a is not None:
            x = x.contiguous()
            y = torch.empty(x.shape[0], a.n, dtype=torch.float32)
            rc = a.fn(
                x.data_ptr(), x.shape[0], a.k, 1.0, a.col_scale, a.qs, a.d, a.m, a.n,
                y.data_ptr(), 0, torch.get_num_threads(), eps, 0,
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"quantized GEMM failed (code {rc}) for x {tuple(x.shape)}")
            lora.add(y, xn, layer, GATE_UP)
            if ops is not None:
                return ops.glu_act(y)
            tiles = y.view(y.shape[0], -1, 2, GLU_ROWS)  # (gate, up) per tile
            return (F.silu(tiles[:, :, 0]) * tiles[:, :, 1]).reshape(y.shape[0], -1)
        assert not isinstance(lin.weight, PackedWeight)
        y = matmul_torch(lin.weight, xn, col_scale=lin.col_scale)  # [gate | up]
        lora.add(y, xn, layer, GATE_UP)
        ffn = y.shape[1] // 2
        return F.silu(y[:, :ffn]) * y[:, ffn:]

    def _place_streamed_weights(self) -> None:
        """Quantized weights are a few times smaller; they stay where they were loaded."""


def _to_device(w: QWeight, device: torch.device) -> QWeight:
    """`w` with its codes and scales on `device` (the same tuple when already there)."""
    if w.qs.device == device:
        return w
    return type(w)(*(t.to(device) for t in w))


def _dense(t: torch.Tensor | QWeight) -> torch.Tensor:
    return t.float() if isinstance(t, torch.Tensor) else dequantize(t)
