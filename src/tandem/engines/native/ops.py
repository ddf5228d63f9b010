"""The per-layer glue of a step outside the linear layers (RoPE + KV store, paged decode
attention, silu * up, RMSNorm) as C kernels (`kernels/ops.c`).

Each call here is one C call where the torch twin is several kernels (each a few µs of
dispatch on CPU, 30 layers a step), and decode attention reads K/V through the block tables
in place instead of gathering every sequence's blocks into a padded batch first. The C path
serves fp32 tensors on CPU with a KV cache of fp32 or fp16 (one build each, `KV_DTYPES`: an
fp16 cache halves the bytes attention reads; values widen to fp32 as they load); anything
else (CUDA, bf16, a machine where the library cannot be built) gets None from `cpu_ops` and
runs the torch code in model.py / attention.py.

Built like the quantized kernels (tandem.engines.native.quant): once per machine with the
system C compiler into the tandem cache directory, keyed by source and flags, for the
instruction-set build `cbuild.select_isa` picks (`make` does it at install time, else the
first use). A failed build logs a warning once and the torch path
serves: same results up to fp32 rounding, more time per step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tandem.cbuild import ISAS, CBuildError, check_isa, compile_c, select_isa

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("kernels") / "ops.c"
_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared")  # and the build's (cbuild.ISAS)
# the KV cache dtypes the C ops serve, and each one's build flags
KV_DTYPES = {torch.float32: (), torch.float16: ("-DTO_KV_HALF",)}
_lock = threading.Lock()
# per (KV dtype, instruction-set build); None: the build failed (warned once)
_libs: dict[tuple[torch.dtype, str], ctypes.CDLL | None] = {}


class OpsBuildError(RuntimeError):
    """The C ops could not be built; the message has the compiler's output."""


def build(kv_dtype: torch.dtype = torch.float32, isa: str | None = None) -> Path:
    """Compile `kernels/ops.c` for a KV cache of `kv_dtype` (a key of KV_DTYPES; idempotent)
    and the instruction-set build `isa` (a key of cbuild.ISAS; default cbuild.select_isa(),
    as the quantized kernels: a build this CPU cannot execute is an IsaError); returns the
    shared library's path."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"no C ops for a {kv_dtype} KV cache; expected one of {list(KV_DTYPES)}")
    if isa is None:
        isa = select_isa()[0]
    check_isa(isa)
    try:
        return compile_c(_SOURCE, f"ops-{isa}", (*ISAS[isa][0], *_FLAGS, *KV_DTYPES[kv_dtype]))
    except CBuildError as exc:
        raise OpsBuildError(f"building the native engine's C ops: {exc}") from exc


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i64, f32, i32, f64 = (
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_double,
    )
    lib.to_rope_store.argtypes = [p, i64, i64, i64, i64, i64, p, p, p, p, p, p, i32]
    lib.to_rope_store.restype = None
    lib.to_decode_attention.argtypes = [p, i64, i64, i64, i64, i64, p, p, i64, p, i64, p, f32]
    lib.to_decode_attention.argtypes += [p, i32]
    lib.to_decode_attention.restype = i32
    lib.to_prefill_attention.argtypes = [p, i64, i64, i64, i64, i64, p, p, i64, p, i64, f32]
    lib.to_prefill_attention.argtypes += [p, i32]
    lib.to_prefill_attention.restype = i32
    lib.to_silu_mul.argtypes = [p, i64, i64, p, i32]
    lib.to_silu_mul.restype = None
    lib.to_rms_scale.argtypes = [p, i64, f64]
    lib.to_rms_scale.restype = f64
    lib.to_rms_rows.argtypes = [p, i64, i64, f32, p, i32]
    lib.to_rms_rows.restype = None
    lib.to_decoder.argtypes = [i64, p, p, p, p, p, p, i64, i64, i64, i64, f32, f32, p, p, p, p]
    lib.to_decoder.argtypes += [p, i64, i64, i64, i64, p, i64, p, i64, p, p, p, p, i32]
    lib.to_lora_add.argtypes = [p, p, i64, i32, p, i64, f32, p, i64, i64, i32]
    lib.to_lora_add.restype = i32
    lib.to_glu_act.argtypes = [p, i64, i64, p, i32]
    lib.to_glu_act.restype = None
    lib.to_decoder.restype = i32
    lib.to_has_avx2.restype = i32
    lib.to_kv_bytes.restype = i32
    return lib


def library(kv_dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    """The loaded C ops for a `kv_dtype` cache (built on first use), or None where they
    cannot be built (warned once; callers then run the torch path). TANDEM_NATIVE_OPS=torch
    turns them off for the models built while it is set (read on every call). The build is
    cbuild.select_isa()'s; a TANDEM_NATIVE_ISA this CPU cannot execute is an IsaError."""
    if os.environ.get("TANDEM_NATIVE_OPS", "c") == "torch":
        return None
    isa = select_isa()[0]
    key = (kv_dtype, isa)
    with _lock:
        if key not in _libs:
            try:
                _libs[key] = _load(build(kv_dtype, isa))
            except (OpsBuildError, OSError, subprocess.SubprocessError) as exc:
                logger.warning(
                    "native C ops for a %s KV cache unavailable, using torch ops (slower): %s",
                    kv_dtype, exc,
                )  # fmt: skip
                _libs[key] = None
        return _libs[key]


class CpuOps:
    """Typed wrappers over the C ops for contiguous fp32 CPU tensors and a KV cache of
    `kv_dtype` (the library's build; a cache of another dtype is refused). Thread-safe."""

    def __init__(self, lib: ctypes.CDLL, kv_dtype: torch.dtype = torch.float32) -> None:
        self.lib = lib
        self.kv_dtype = kv_dtype
        if lib.to_kv_bytes() != torch.empty(0, dtype=kv_dtype).element_size():
            raise ValueError(f"this C ops build does not serve a {kv_dtype} KV cache")

    def _check_cache(self, *planes: torch.Tensor) -> None:
        for plane in planes:
            if plane.dtype != self.kv_dtype:
                raise ValueError(f"KV cache of {plane.dtype}; these C ops serve {self.kv_dtype}")

    def rope_store(
        self,
        qkv: torch.Tensor,
        heads: int,
        kv_heads: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_slots: torch.Tensor,
        v_slots: torch.Tensor,
    ) -> None:
        """RoPE on the q and k heads of qkv [T, (H + 2 KVH) d] in place, then each row's k
        and v into `slots` of the planes [num_slots, KVH, d]. positions/slots int64 [T]."""
        self._check_cache(k_slots, v_slots)
        d = k_slots.shape[-1]
        self.lib.to_rope_store(
            qkv.data_ptr(),
            qkv.shape[0],
            qkv.stride(0),
            heads,
            kv_heads,
            d,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            k_slots.data_ptr(),
            v_slots.data_ptr(),
            torch.get_num_threads(),
        )

    def decode_attention(
        self,
        qkv: torch.Tensor,
        num_rows: int,
        heads: int,
        k_slots: torch.Tensor,
        v_slots: torch.Tensor,
        block_size: int,
        tables: torch.Tensor,
        ctx_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of the q heads of the first `num_rows` rows of qkv (one per sequence)
        over their cached K/V, read in place through `tables` int64 [rows, W] (block ids)
        and `ctx_lens` int64 [rows]; into out [rows, H, d] (contiguous)."""
        self._check_cache(k_slots, v_slots)
        kv_heads, d = k_slots.shape[1], k_slots.shape[2]
        rc = self.lib.to_decode_attention(
            qkv.data_ptr(),
            qkv.stride(0),
            num_rows,
            heads,
            kv_heads,
            d,
            k_slots.data_ptr(),
            v_slots.data_ptr(),
            block_size,
            tables.data_ptr(),
            tables.shape[-1],
            ctx_lens.data_ptr(),
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("decode attention could not allocate its score buffers")

    def prefill_attention(
        self,
        qkv: torch.Tensor,
        heads: int,
        k_slots: torch.Tensor,
        v_slots: torch.Tensor,
        block_size: int,
        table: torch.Tensor,
        ctx_len: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Causal attention of the q heads of the rows of qkv [T, ...] (one sequence's tokens
        at positions ctx_len - T .. ctx_len - 1, their K/V already stored) over the cache
        read in place through `table` int64 [>= ceil(ctx_len / block_size)]; into out
        [T, H, d] (contiguous rows)."""
        self._check_cache(k_slots, v_slots)
        kv_heads, d = k_slots.shape[1], k_slots.shape[2]
        rc = self.lib.to_prefill_attention(
            qkv.data_ptr(), qkv.stride(0), qkv.shape[0], heads, kv_heads, d,
            k_slots.data_ptr(), v_slots.data_ptr(), block_size, table.data_ptr(), ctx_len,
            scale, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("prefill attention could not allocate its buffers")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [T, 2 ffn] (contiguous) -> [T, ffn]."""
        rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, ffn, dtype=gate_up.dtype)
        self.lib.to_silu_mul(gate_up.data_ptr(), rows, ffn, out.data_ptr(), torch.get_num_threads())
        return out

    def rms_normalize(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """x / RMS(x) per row of x [T, n]."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.to_rms_rows(
            x.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr(), torch.get_num_threads()
        )
        return out

    def decoder(
        self,
        plan: DecoderPlan,
        x: torch.Tensor,
        heads: int,
        kv_heads: int,
        eps: float,
        scale: float,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        kv_cache: torch.Tensor,
        decode: tuple[int, torch.Tensor, torch.Tensor] | None,
        spans: list[tuple[int, int, int, torch.Tensor]],
        attn_out: torch.Tensor,
        lora: LoraRows | None = None,
    ) -> None:
        """Every layer of `plan` over the rows of x [T, hidden] (contiguous fp32; replaced by
        the last layer's output): the same kernel calls LlamaModel._hidden_c makes layer by
        layer. `kv_cache` [L, 2, blocks, block_size, KVH, d]; `decode` (rows, tables int64
        [rows, W], lens int64 [rows]) for the first rows; `spans` (start, end, ctx_len,
        block table int64) for prefill chunks; `attn_out` [T, H, d] scratch. `lora`: the
        rows' LoRA adapters, each update added after its projection (gate/up's before the
        activation, in the glu column order: `lora_table`)."""
        self._check_cache(kv_cache)
        rows, d, bs = x.shape[0], kv_cache.shape[-1], kv_cache.shape[3]
        assert x.is_contiguous() and x.dtype == torch.float32 and kv_cache.is_contiguous()
        qkv = torch.empty(rows, (heads + 2 * kv_heads) * d, dtype=torch.float32)
        h = torch.empty_like(x)
        f = torch.empty(rows, plan.ffn, dtype=torch.float32)
        nd, tables, lens = decode if decode is not None else (0, None, None)
        g = None
        if lora is not None:
            if lora.row_slot.shape[0] != rows:
                raise ValueError(f"LoRA slots for {lora.row_slot.shape[0]} rows; x has {rows}")
            if lora.adapts_gate_up:
                g = torch.empty(rows, 2 * plan.ffn, dtype=torch.float32)
        c_spans = (_Span * max(len(spans), 1))(
            *(_Span(a, b, n, t.data_ptr()) for a, b, n, t in spans)
        )
        rc = self.lib.to_decoder(
            plan.num_layers, ctypes.addressof(plan.linears), x.data_ptr(), h.data_ptr(),
            qkv.data_ptr(), attn_out.data_ptr(), f.data_ptr(), rows, heads, kv_heads, d, eps,
            scale, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), bs, nd,
            0 if tables is None else tables.data_ptr(), 0 if tables is None else tables.shape[1],
            0 if lens is None else lens.data_ptr(), len(spans), ctypes.addressof(c_spans),
            None if lora is None else lora.row_slot.data_ptr(),
            None if lora is None else ctypes.addressof(lora.slots),
            None if g is None else g.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            layer, op = divmod(-rc - 1, 4)
            what = ("qkv projection", "attention", "o or gate_up projection", "down projection")
            raise MemoryError(
                f"decoder layer {layer}: the {what[op]} could not allocate its buffers"
            )

    def lora_add(
        self, lora: LoraRows, layer: int, proj: int, x: torch.Tensor, y: torch.Tensor,
        eps: float | None = None,
    ) -> None:  # fmt: skip
        """y[t] += (x[t] A^T) B^T of row t's adapter for projection `proj` (0..3: qkv, o,
        gate_up, down) of `layer`, x first divided by its RMS when `eps` is given; x [T, in]
        and y [T, out] contiguous fp32. The decoder's own arithmetic (tests compare them)."""
        assert x.is_contiguous() and y.is_contiguous() and x.dtype == y.dtype == torch.float32
        rc = self.lib.to_lora_add(
            lora.row_slot.data_ptr(), ctypes.addressof(lora.slots), layer, proj, x.data_ptr(),
            x.shape[1], -1.0 if eps is None else eps, y.data_ptr(), y.shape[1], x.shape[0],
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"a LoRA update of rank over {MAX_FUSED_RANK}")

    def glu_act(self, g: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of g [T, 2 ffn] in the glu column order (16 gate columns, their
        16 up columns, ...: quant.glu_rows) -> [T, ffn], as the quantized glu kernel stores it."""
        g = g.contiguous()
        out = torch.empty(g.shape[0], g.shape[1] // 2, dtype=torch.float32)
        self.lib.to_glu_act(g.data_ptr(), g.shape[0], out.shape[1], out.data_ptr(),
                            torch.get_num_threads())  # fmt: skip
        return out

    def rms_scale(self, x: torch.Tensor, eps: float) -> float:
        """1 / RMS of the one contiguous row x [1, n]."""
        return float(self.lib.to_rms_scale(x.data_ptr(), x.shape[-1], eps))


class _Linear(ctypes.Structure):
    """kernels/ops.c `struct to_linear`: a quantized projection's kernel and arguments."""

    _fields_ = [
        ("fn", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("cs", ctypes.c_void_p),
        ("qs", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
    ]


class _Lora(ctypes.Structure):
    """kernels/ops.c `struct to_lora`: one projection's low-rank update (a NULL: none)."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("r", ctypes.c_int64)]


MAX_FUSED_RANK = 256  # kernels/ops.c TO_LORA_MAX_RANK: the ranks fused into one projection


def lora_table(layers: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor] | None]]) -> Any:
    """An adapter's updates as `to_decoder` takes them: [L][4] `to_lora` (A [R, in] and
    B^T [R, out], contiguous fp32 CPU tensors the caller keeps alive)."""
    entries = []
    for layer in layers:
        for low in layer:
            if low is None:
                entries.append(_Lora(None, None, 0))
                continue
            a, b_t = low
            if not (a.is_contiguous() and b_t.is_contiguous()) or a.dtype != torch.float32:
                raise ValueError("a LoRA update for the C ops needs contiguous fp32 A and B")
            if not 0 < a.shape[0] <= MAX_FUSED_RANK:
                raise ValueError(f"a LoRA update of rank {a.shape[0]} (at most {MAX_FUSED_RANK})")
            entries.append(_Lora(a.data_ptr(), b_t.data_ptr(), a.shape[0]))
    return (_Lora * len(entries))(*entries)


class LoraRows(NamedTuple):
    """A step's adapters as the C ops take them: each row's slot (int32 [T], -1: the base)
    and each slot's `lora_table` (pointers; the tables and their tensors kept alive by the
    caller)."""

    row_slot: torch.Tensor
    slots: Any  # ctypes array of c_void_p
    adapts_gate_up: bool


class _Span(ctypes.Structure):
    """kernels/ops.c `struct to_span`: a prefill chunk's rows and block table."""

    _fields_ = [
        ("start", ctypes.c_int64),
        ("end", ctypes.c_int64),
        ("ctx_len", ctypes.c_int64),
        ("blocks", ctypes.c_void_p),
    ]


class DecoderPlan:
    """Every layer's four projections (qkv, o, gate_up as glu, down) as `to_decoder` takes
    them, for models whose projections are all C quantized kernels (`QuantLinear`): a step
    then makes one C call for all its layers instead of ~6 Python calls a layer (figures in
    docs/perf-engine.md, round 6). Holds pointers into the model's weights, which must
    outlive it. Immutable."""

    def __init__(self, layers: list[tuple[Any, Any, Any, Any]]) -> None:
        entries = []
        for qkv, o, gate_up, down in layers:
            for lin, glu in ((qkv, False), (o, False), (gate_up, True), (down, False)):
                a = lin.c_args
                if a is None or lin.glu != glu:
                    raise ValueError("a decoder plan needs C quantized projections")
                fn = ctypes.cast(a.fn, ctypes.c_void_p).value
                entries.append(_Linear(fn, a.n, a.k, a.col_scale or None, a.qs, a.d, a.m))
        self.num_layers = len(layers)
        self.linears = (_Linear * len(entries))(*entries)
        self.ffn = layers[0][2].out_features


def cpu_ops(
    dtype: torch.dtype, device: torch.device | str = "cpu", kv_dtype: torch.dtype | None = None
) -> CpuOps | None:
    """The C ops for tensors of this dtype and device and a KV cache of `kv_dtype` (default:
    `dtype`), or None (use the torch path)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if torch.device(device).type != "cpu" or dtype != torch.float32 or kv_dtype not in KV_DTYPES:
        return None
    lib = library(kv_dtype)
    return None if lib is None else CpuOps(lib, kv_dtype)
