"""LoRA adapters in the native engine's layout, and a step's batched low-rank update.

The model fuses Q/K/V and gate/up into one projection each and folds each RMSNorm weight
into the projection after it (model.py), so an adapter is laid out the same way once, at
load: per layer and fused projection one A [R, in] (the norm weight folded into its columns,
as PEFT's q_proj sees norm(x) * g) and one B^T [R, out] (lora_alpha / r folded in, and the
attention scale where the model folds it into the Q rows), R the sum of the ranks of the
modules it adapts there; a module it does not adapt has no columns. A projection's update is
then y += (x A^T) B^T: two small matmuls, never a merged weight.

A step (`LoraStep`) puts each adapter's rows in contiguous segments (the runner orders the
batch by adapter). Where the model runs its layers in one C call (a quantized model on the
CPU: ops.DecoderPlan), the step passes each row's adapter slot and each adapter's A/B
pointers (`LoraStep.c_rows`) and the decoder adds every update after its projection's GEMM,
row by row, inside that call (kernels/ops.c lora_rows); the gate/up update goes on the
projection's own output before silu * up, in the packed glu column order (16 gate columns,
their 16 up columns, ...) where the model says so (`lora_gate_up_glu`: B's gate/up columns
are permuted once at load), so no second, unfused gate/up weight is kept. Elsewhere
(`LoraStep.add`) each segment's update is two torch matmuls over its rows, in the model's
dtype on top of the projection's output.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from tandem.engines.lora import LoraShape, LoraWeights
from tandem.engines.native.model_config import ModelConfig
from tandem.engines.native.ops import LoraRows, lora_table
from tandem.engines.native.quant import GLU_ROWS

QKV, OUT, GATE_UP, DOWN = range(4)  # the fused projections of LayerWeights, in its order
_FUSED = (
    ("q_proj", "k_proj", "v_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj"),
    ("down_proj",),
)


class BaseModel(Protocol):
    """What `prepare` reads of the model (a LlamaModel; model.py imports this module)."""

    config: ModelConfig
    attn_scale: float  # the part of head_dim ** -0.5 not folded into the Q rows
    norm_weights: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device
    dtype: torch.dtype
    lora_gate_up_glu: bool  # the gate/up output's columns in the glu order (quant.glu_rows)


class LowRank(NamedTuple):
    a: torch.Tensor  # [R, in] (each rank's row contiguous: the C update's dot products)
    b_t: torch.Tensor  # [R, out], scale folded in


@dataclass(frozen=True, slots=True, eq=False)
class NativeAdapter:
    """One adapter, laid out for the model: `layers[i][p]` is layer i's projection p update
    (None where it adapts nothing)."""

    name: str
    path: str
    rank: int
    layers: tuple[tuple[LowRank | None, ...], ...]
    adapts_gate_up: bool
    num_bytes: int
    # its ops.lora_table, made on first use by a fused step (pointers into `layers`)
    c_table: list[Any] = field(default_factory=list, compare=False, repr=False)

    def table(self) -> Any:
        """The C ops' view of `layers` (ops.lora_table), made once."""
        if not self.c_table:
            self.c_table.append(lora_table(self.layers))
        return self.c_table[0]


def lora_shape(config: ModelConfig, base_model: str) -> LoraShape:
    """What an adapter of this llama-family model must fit."""
    return LoraShape.llama(
        base_model,
        num_layers=config.num_layers,
        hidden=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        ffn=config.intermediate_size,
    )


def prepare(weights: LoraWeights, model: BaseModel) -> NativeAdapter:
    """`weights` in the model's fused layout, dtype and device."""
    c = model.config
    shape = lora_shape(c, "")
    q_scale = c.head_dim**-0.5 / model.attn_scale  # what the model folded into the Q rows
    layers: list[tuple[LowRank | None, ...]] = []
    for i in range(c.num_layers):
        in_norm, post_norm = model.norm_weights[i]
        norms = (in_norm, None, post_norm, None)
        fused: list[LowRank | None] = []
        for p, modules in enumerate(_FUSED):
            a_parts: list[torch.Tensor] = []
            blocks: list[tuple[int, torch.Tensor]] = []  # (row offset in out, B)
            offset = 0
            for m in modules:
                out = shape.dims[m][1]
                if (i, m) in weights.a:
                    a_parts.append(weights.a[(i, m)])
                    b = weights.b[(i, m)] * weights.scale
                    blocks.append((offset, b * q_scale if m == "q_proj" else b))
                offset += out
            if not a_parts:
                fused.append(None)
                continue
            a = torch.cat(a_parts)  # [R, in]
            norm = norms[p]
            if norm is not None:
                a = a * norm.to(a.device, torch.float32)[None, :]
            b_t = torch.zeros(a.shape[0], offset, dtype=torch.float32)
            col = 0
            for row, b in blocks:
                b_t[col : col + b.shape[1], row : row + b.shape[0]] = b.t()
                col += b.shape[1]
            if p == GATE_UP and model.lora_gate_up_glu:
                b_t = b_t[:, _glu_order(offset)]
            fused.append(
                LowRank(
                    a.to(model.device, model.dtype).contiguous(),
                    b_t.to(model.device, model.dtype).contiguous(),
                )
            )
        layers.append(tuple(fused))
    num_bytes = sum(
        t.numel() * t.element_size() for layer in layers for lr in layer if lr for t in lr
    )
    return NativeAdapter(
        name=weights.name,
        path=weights.path,
        rank=weights.rank,
        layers=tuple(layers),
        adapts_gate_up=any(layer[GATE_UP] is not None for layer in layers),
        num_bytes=num_bytes,
    )


def _glu_order(n: int) -> torch.Tensor:
    """Column j of a glu-packed gate/up output is column order[j] of [gate | up]
    (quant.glu_rows' row order)."""
    half = GLU_ROWS
    return torch.arange(n).view(2, n // (2 * half), half).transpose(0, 1).reshape(-1)


class LoraStep:
    """The adapters of one step's flat batch: (start, end, adapter) row segments."""

    __slots__ = ("adapts_gate_up", "segments")

    def __init__(self, segments: list[tuple[int, int, NativeAdapter]]) -> None:
        self.segments = segments
        self.adapts_gate_up = any(ad.adapts_gate_up for _, _, ad in segments)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: int) -> None:
        """y[rows] += (x[rows] A^T) B^T of each segment's adapter for projection `proj` of
        `layer` (y and x row-aligned, y contiguous)."""
        for start, end, adapter in self.segments:
            low = adapter.layers[layer][proj]
            if low is not None:
                y[start:end].addmm_(torch.mm(x[start:end], low.a.t()), low.b_t)

    def c_rows(self, num_rows: int) -> LoraRows:
        """Each of the `num_rows` rows' adapter slot and each slot's table, for the C ops
        (`ops.CpuOps.decoder`): one slot per distinct adapter."""
        row_slot = torch.full((num_rows,), -1, dtype=torch.int32)
        slots: dict[int, int] = {}
        tables: list[int] = []
        for start, end, adapter in self.segments:
            slot = slots.get(id(adapter))
            if slot is None:
                slot = slots[id(adapter)] = len(tables)
                tables.append(ctypes.addressof(adapter.table()))
            row_slot[start:end] = slot
        return LoraRows(row_slot, (ctypes.c_void_p * len(tables))(*tables), self.adapts_gate_up)


def step_segments(adapters: list[NativeAdapter | None], rows: list[int]) -> LoraStep | None:
    """The LoraStep of a flat batch whose i-th sequence has `rows[i]` rows and adapter
    `adapters[i]` (consecutive sequences of one adapter merge); None when none has one."""
    segments: list[tuple[int, int, NativeAdapter]] = []
    start = 0
    for adapter, n in zip(adapters, rows, strict=True):
        if adapter is not None:
            if segments and segments[-1][2] is adapter and segments[-1][1] == start:
                segments[-1] = (segments[-1][0], start + n, adapter)
            else:
                segments.append((start, start + n, adapter))
        start += n
    return LoraStep(segments) if segments else None
