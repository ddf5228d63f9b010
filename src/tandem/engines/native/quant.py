"""Weight-only quantized linear layers: int4 (groups of 32 with a scale and a minimum, GGUF
Q4_1's layout) and int8 (uint8 codes, groups of 32 with a scale and a minimum), run by the C
kernels in `kernels/quant.c`, compiled once per instruction set (AVX-512 VNNI, AVX-512,
AVX2 + FMA, scalar): the widest this CPU executes, or the one TANDEM_NATIVE_ISA forces
(`cbuild.select_isa`, logged at INFO).

`Q4Weight` / `Q8Weight` hold a weight in source order (GGUF blocks, row-major): what is
loaded, cached, fused (`cat_rows`) and converted. `pack` turns one into a `PackedWeight`,
tiles of 32 output columns k-major, which is what the GEMM streams; `QuantLinear` packs at
construction (a fraction of a second for the whole model).

int8 is asymmetric so that both GGUF formats convert into it exactly (Q4_1: codes x 17,
scale / 17; Q8_0: codes + 128, minimum -128 x scale): the SmolLM2 GGUF is Q4_1, and an int8
engine that re-rounded its weights would not be the model the fp32 engine serves.

The kernels are compiled once per machine with the system C compiler (`make` does it at
install time; else the first use does) into the tandem cache directory, keyed by the build,
the source and the compiler flags. Activations are fp32 on the AVX-512 (without VNNI) and
scalar builds; on the AVX-512 VNNI build they are rounded to 15-bit integers per group of 32
and the products summed in int32, twice the fp32 FMA rate; on the AVX2 build to 13-bit
integers per group of 32, summed exactly by vpmaddubsw in two byte planes (`activation_bits`;
the kernel says why those widths), or from 8 rows by vpmaddwd on the codes widened to int16
once a tile (the same integer sums, so the same bits, at 1.1-1.6x the rate). 13 bits on
SmolLM2 (the quality gate's prompts, tests' test_quantized_engine_agrees_with_fp32): every
greedy token the same as fp32, mean KL 7.3e-6 (int4) / 8.6e-6 (int8) against the gate's
1e-4; 8-bit activations with a scale per block of 32 (one vpmaddubsw per 32 products,
llama.cpp's Q8 activation blocks) measured 4.1e-3 and 87 % agreement, so they are not used.

The C kernels serve weights on the CPU. A weight on another device (CUDA), or any weight
where TANDEM_QUANT_KERNELS=torch, runs the torch path instead (`matmul_torch`): the
source-order codes stay on the device and each call dequantizes them (w = d q + m per group)
into a transient fp32 matrix for one mm/addmm. Correct, not fast: it streams more bytes than
an fp32 weight would; the point is one code path that runs on any device and is tested here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from tandem.cbuild import ISAS, CBuildError, check_isa, compile_c, select_isa

logger = logging.getLogger(__name__)

GROUP = 32
WEIGHT_FORMATS = ("fp32", "int8", "int4")
_SOURCE = Path(__file__).with_name("kernels") / "quant.c"
_COMMON = ("-O3", "-fopenmp", "-fPIC", "-shared")
# one build per instruction set (cbuild.ISAS: AVX-512 VNNI, AVX-512, AVX2 + FMA, scalar): the
# kernels pick their path at compile time; tests run every build the CPU executes (within one
# build every row count and row position gives bit-identical rows; across builds fp32
# rounding differs, and the VNNI and AVX2 builds round activations to 15 and 13 bits)
VARIANTS = {isa: (*flags, *_COMMON) for isa, (flags, _) in ISAS.items()}
TILE = 32  # output columns per packed tile (kernels/quant.c TN)
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}  # per build


class QuantKernelError(RuntimeError):
    """The quantized kernels cannot be built or loaded; the message says why and what to do."""


def build(isa: str | None = None) -> Path:
    """Compile the kernels (idempotent); returns the shared library's path. `isa` is a key
    of VARIANTS; default: cbuild.select_isa() (TANDEM_NATIVE_ISA, else the widest build this
    CPU executes). A build this CPU cannot execute is refused (cbuild.IsaError)."""
    if isa is None:
        isa = select_isa()[0]
    check_isa(isa)
    try:
        return compile_c(_SOURCE, f"tq-{isa}", VARIANTS[isa])
    except CBuildError as exc:
        raise QuantKernelError(
            f"building the int8/int4 kernels: {exc}\nserve with --weights fp32, or install/fix gcc"
        ) from exc


def load_library(path: Path) -> ctypes.CDLL:
    """A kernel library with its function signatures declared."""
    lib = ctypes.CDLL(str(path))
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.tq_gemm_q4.argtypes = [p, i64, i64, f32, p, p, p, p, i64, p, p, i32, f32, i32]
    lib.tq_gemm_q8.argtypes = [p, i64, i64, f32, p, p, p, p, i64, p, p, i32, f32, i32]
    lib.tq_dequant_q4.argtypes = [p, p, p, i64, i64, p, i32]
    lib.tq_dequant_q8.argtypes = [p, p, p, i64, i64, p, i32]
    lib.tq_pack_q4.argtypes = [p, p, p, i64, i64, p, p, p]
    lib.tq_pack_q8.argtypes = [p, p, p, i64, i64, p, p, p]
    lib.tq_head_greedy.argtypes = [i32, p, i64, i64, f32, p, p, p, p, i64, p, p, p, p, i32, f32]
    for fn in (lib.tq_gemm_q4, lib.tq_gemm_q8, lib.tq_head_greedy):
        fn.restype = ctypes.c_int
    lib.tq_screen_block.restype = ctypes.c_int
    lib.tq_screen_layout.restype = ctypes.c_int
    lib.tq_isa.restype = ctypes.c_int
    lib.tq_activation_bits.restype = ctypes.c_int
    lib.tq_issue_gmacs.argtypes = [i32, i64]
    lib.tq_issue_gmacs.restype = ctypes.c_double
    return lib


def activation_bits(lib: ctypes.CDLL | None = None) -> int:
    """32 where a build multiplies fp32 activations; 15 (VNNI) or 13 (AVX2) where it rounds
    them to integers per group of 32."""
    return int((lib or kernels()).tq_activation_bits())


ISSUE_OPS = ("fp32 fma", "vpmaddwd+vpaddd", "vpmaddubsw+vpaddw (2 planes)")


def issue_gmacs(lib: ctypes.CDLL | None = None, iters: int = 2_000_000) -> dict[str, float]:
    """GMAC/s one core issues of each instruction pair a GEMM is built on (ISSUE_OPS; the
    kernels' `tq_issue_gmacs`, thread CPU time), where this build has it (the AVX2 one)."""
    lib = lib or kernels()
    rates = {name: float(lib.tq_issue_gmacs(op, iters)) for op, name in enumerate(ISSUE_OPS)}
    return {name: rate for name, rate in rates.items() if rate > 0}


def auto_weights(dtype: str, device: str = "cpu") -> str:
    """What `--weights auto` serves: int4, the fastest format that passes the quality gate
    (`tandem bench engine`: ahead of int8 and fp32 at every batch size and in prefill),
    where the dtype is float32, the device the CPU and the kernels build here; else fp32
    (off the CPU the quantized torch path is correct, not fast; a failed build is logged)."""
    if dtype != "float32" or device != "cpu":
        return "fp32"
    try:
        kernels()
    except QuantKernelError as exc:
        logger.warning("--weights auto: serving fp32 weights: %s", exc)
        return "fp32"
    return "int4"


def kernels() -> ctypes.CDLL:
    """The loaded kernel library of the build cbuild.select_isa() picks (built on first use)."""
    isa = select_isa()[0]
    with _lock:
        if isa not in _libs:
            lib = load_library(build(isa))
            if not lib.tq_isa():
                logger.warning("int8/int4 kernels built without AVX2: the scalar path is slow")
            _libs[isa] = lib
        return _libs[isa]


class Q4Weight(NamedTuple):
    """[N, K] as 4-bit codes: qs uint8 [N, K/2] (GGUF Q4_1 nibble order), d, m fp32 [N, K/32]."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


class Q8Weight(NamedTuple):
    """[N, K] as 8-bit codes: qs uint8 [N, K], d, m fp32 [N, K/32] (w = d q + m)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


QWeight = Q4Weight | Q8Weight


class PackedWeight(NamedTuple):
    """A QWeight in the GEMM's layout: tiles of TILE output columns, k-major inside a tile
    (`kernels/quant.c`); `bits` 4 or 8, `n` x `k` the logical shape."""

    bits: int
    n: int
    k: int
    qs: torch.Tensor  # uint8 [tiles, k, TILE * bits / 8]
    d: torch.Tensor  # fp32 [tiles, k / 32, TILE]
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))


def pack(w: QWeight, lib: ctypes.CDLL | None = None) -> PackedWeight:
    """`w` in the GEMM's tiled layout (columns past n are zero weights)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"input dimension {k} is not a multiple of the group size {GROUP}")
    bits = 4 if isinstance(w, Q4Weight) else 8
    tiles = -(-n // TILE)
    qs = torch.empty(tiles, k, TILE * bits // 8, dtype=torch.uint8)
    d = torch.empty(tiles, k // GROUP, TILE, dtype=torch.float32)
    m = torch.empty_like(d)
    src = [t.contiguous() for t in w]
    lib = lib or kernels()
    fn = lib.tq_pack_q4 if bits == 4 else lib.tq_pack_q8
    fn(*(t.data_ptr() for t in src), n, k, qs.data_ptr(), d.data_ptr(), m.data_ptr())
    return PackedWeight(bits, n, k, qs, d, m)


def _groups(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"input dimension {k} is not a multiple of the group size {GROUP}")
    return w.float().reshape(n, k // GROUP, GROUP)


def _asymmetric(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, ...]:
    """Per group of 32: codes in 0..levels-1, scale and minimum (w ≈ d q + m)."""
    g = _groups(w)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    d = (hi - lo) / (levels - 1)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((g - lo.unsqueeze(2)) * inv.unsqueeze(2)).clamp_(0, levels - 1)
    return q.to(torch.uint8), d.contiguous(), lo.contiguous()


def quantize_q8(w: torch.Tensor) -> Q8Weight:
    """8-bit codes per group of 32 with a scale and a minimum."""
    q, d, m = _asymmetric(w, 256)
    return Q8Weight(q.reshape(w.shape).contiguous(), d, m)


def quantize_q4(w: torch.Tensor) -> Q4Weight:
    """4-bit codes per group of 32 with a scale and a minimum, as GGUF Q4_1."""
    q, d, m = _asymmetric(w, 16)
    packed = q[:, :, :16] | (q[:, :, 16:] << 4)  # byte j: element j low, j + 16 high
    return Q4Weight(packed.reshape(w.shape[0], -1).contiguous(), d, m)


def q4_to_q8(w: Q4Weight) -> Q8Weight:
    """The same values in 8-bit codes (exact: code x 17, scale / 17)."""
    n, k = w.shape
    b = w.qs.view(n, k // GROUP, 16)
    codes = torch.cat((b & 0x0F, b >> 4), dim=2).reshape(n, k) * 17
    return Q8Weight(codes.contiguous(), (w.d / 17.0).contiguous(), w.m.clone())


def dequantize(w: QWeight, num_threads: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 [N, K] matrix a quantized weight stands for (written into `out` if given)."""
    n, k = w.shape
    if out is None:
        out = torch.empty(n, k, dtype=torch.float32)
    lib = kernels()
    if isinstance(w, Q4Weight):
        lib.tq_dequant_q4(
            w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), n, k, out.data_ptr(), num_threads
        )
    else:
        lib.tq_dequant_q8(
            w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), n, k, out.data_ptr(), num_threads
        )
    return out


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QWeight:
    """A Q4_1 or Q8_0 GGUF tensor's raw blocks as a packed weight, without an fp32 copy."""
    n, k = shape
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // GROUP, -1)
    if type_name == "Q4_1":  # per block: d fp16, m fp16, 16 bytes of nibbles
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[:, :, 4:20].reshape(n, k // 2)
        return Q4Weight(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (qs, d, m)))
    if type_name == "Q8_0":  # per block: d fp16, 32 int8 -> codes + 128, minimum -128 d
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = (blocks[:, :, 2:34].reshape(n, k) ^ 0x80).astype(np.uint8)  # int8 + 128
        m = -128.0 * d
        return Q8Weight(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, d, m)))
    raise ValueError(f"no packed form for GGUF type {type_name}; expected Q4_1 or Q8_0")


def convert(w: QWeight | torch.Tensor, fmt: str) -> QWeight:
    """`w` in format `fmt` ('int8' or 'int4'); a weight already in it is returned as is."""
    if fmt == "int4":
        return w if isinstance(w, Q4Weight) else quantize_q4(_dense(w))
    if fmt == "int8":
        if isinstance(w, Q4Weight):
            return q4_to_q8(w)
        return w if isinstance(w, Q8Weight) else quantize_q8(_dense(w))
    raise ValueError(f"weights='{fmt}'; expected int8 or int4")


def _dense(w: QWeight | torch.Tensor) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else dequantize(w)


def scale_rows(w: QWeight, rows: slice, factor: float) -> None:
    """Multiply output rows `rows` by `factor` in place (exact for a power of two)."""
    w.d[rows] *= factor
    w.m[rows] *= factor


def cat_rows(parts: list[QWeight]) -> QWeight:
    """Stack weights of one format along the output dimension (fused QKV, gate/up)."""
    first = parts[0]
    if isinstance(first, Q4Weight):
        return Q4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in first._fields))
    return Q8Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in first._fields))


def matmul(
    w: QWeight | PackedWeight,
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    alpha: float = 1.0,
    col_scale: torch.Tensor | None = None,
    norm_eps: float | None = None,
    glu: bool = False,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """(alpha * x * col_scale) @ W^T (+ residual) in fp32 on `torch.get_num_threads()`
    threads; `lib` picks a kernel build (default: this machine's). Every row count goes
    through the same kernel arithmetic: a row's result does not depend on its batch.
    `norm_eps`: each row of x is first divided by its RMS (an RMSNorm whose weight is
    `col_scale`). `glu`: W's rows are gate and up rows interleaved by 16 (`glu_rows`), and
    the result is silu(gate) * up, [rows, N / 2]."""
    lib = lib or kernels()
    if not isinstance(w, PackedWeight):
        w = pack(w, lib)
    return _gemm(_kernel_args(w, col_scale, lib), x, residual, alpha, norm_eps, glu)


class _KernelArgs(NamedTuple):
    """What a GEMM call passes for one weight (pointers into tensors the caller keeps alive)."""

    fn: Any  # the ctypes function for the weight's bits
    n: int
    k: int
    col_scale: int  # 0: none
    qs: int
    d: int
    m: int


def _kernel_args(w: PackedWeight, col_scale: torch.Tensor | None, lib: ctypes.CDLL) -> _KernelArgs:
    fn = lib.tq_gemm_q4 if w.bits == 4 else lib.tq_gemm_q8
    cs = 0 if col_scale is None else col_scale.data_ptr()
    return _KernelArgs(fn, w.n, w.k, cs, w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr())


def _gemm(
    a: _KernelArgs,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    alpha: float,
    norm_eps: float | None = None,
    glu: bool = False,
) -> torch.Tensor:
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    rows, k = x.shape
    if k != a.k:
        raise ValueError(f"x has {k} columns; the weight expects {a.k}")
    if glu and (a.n % (2 * GLU_ROWS) or residual is not None):
        raise ValueError(f"glu needs N a multiple of {2 * GLU_ROWS} and no residual (N={a.n})")
    y = torch.empty(rows, a.n // 2 if glu else a.n, dtype=torch.float32)
    res = 0
    if residual is not None:
        if residual.dtype != torch.float32 or not residual.is_contiguous():
            residual = residual.float().contiguous()
        res = residual.data_ptr()
    rc = a.fn(
        x.data_ptr(), rows, k, alpha, a.col_scale, a.qs, a.d, a.m, a.n, y.data_ptr(), res,
        torch.get_num_threads(), -1.0 if norm_eps is None else norm_eps, int(glu),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"quantized GEMM failed (code {rc}) for x {tuple(x.shape)}")
    return y


GLU_ROWS = TILE // 2  # gate rows, then as many up rows, a packed tile (glu)


def _check_glu_rows(n: int) -> None:
    if n % (2 * GLU_ROWS):
        raise ValueError(f"a glu weight needs a multiple of {2 * GLU_ROWS} rows, not {n}")


def glu_rows(w: QWeight) -> QWeight:
    """A [2F, K] gate/up weight (gate rows first) with its rows interleaved 16 gate, 16 up,
    ... so that each packed tile holds a gate column and its up column (`matmul(glu=True)`)."""
    n = w.shape[0]
    _check_glu_rows(n)
    order = torch.arange(n).view(2, n // (2 * GLU_ROWS), GLU_ROWS).transpose(0, 1).reshape(-1)
    return type(w)(*(t[order.to(t.device)].contiguous() for t in w))


class QuantLinear:
    """y = (alpha * x * col_scale) @ W^T (+ residual) with W quantized; `col_scale` holds the
    RMSNorm weight a fp32 Linear would fold into W's columns, and `norm_eps` in a call applies
    the RMSNorm itself (one pass over x, no normalized copy). `glu`: W is gate rows then up
    rows and a call returns silu(x W_gate^T) * (x W_up^T), in the same kernel. Runs where
    `weight` lives: the C kernels on the CPU (packed here), the torch path elsewhere or when
    forced (`uses_torch_path`). Immutable; thread-safe."""

    __slots__ = ("_args", "col_scale", "glu", "out_features", "weight")
    fuses_norm = True  # model forwards: pass norm_eps instead of a normalized x

    def __init__(
        self, weight: QWeight, col_scale: torch.Tensor | None = None, *, glu: bool = False
    ) -> None:
        self.weight: QWeight | PackedWeight = weight
        self.glu = glu
        self.out_features = weight.shape[0] // 2 if glu else weight.shape[0]
        self.col_scale = None if col_scale is None else col_scale.float().contiguous()
        self._args: _KernelArgs | None = None
        if glu:
            _check_glu_rows(weight.shape[0])
        if not uses_torch_path(weight):
            packed = pack(glu_rows(weight) if glu else weight)  # builds the kernels here
            self.weight = packed
            # the call's fixed arguments once (a batch-1 step makes ~120 calls: measured
            # 11 -> 9 us each for a small weight)
            self._args = _kernel_args(packed, self.col_scale, kernels())

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        alpha: float = 1.0,
        norm_eps: float | None = None,
    ) -> torch.Tensor:
        if self._args is not None:
            return _gemm(self._args, x, residual, alpha, norm_eps, self.glu)
        assert not isinstance(self.weight, PackedWeight)
        if norm_eps is not None:
            x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps)
        y = matmul_torch(
            self.weight, x, None if self.glu else residual, alpha=alpha, col_scale=self.col_scale
        )
        if not self.glu:
            return y
        if residual is not None:
            raise ValueError("a glu projection takes no residual")
        half = y.shape[1] // 2
        return F.silu(y[:, :half]) * y[:, half:]

    @property
    def c_args(self) -> _KernelArgs | None:
        """The C kernel and its fixed arguments (None on the torch path): what a fused
        decoder (tandem.engines.native.ops.DecoderPlan) calls for this projection."""
        return self._args

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def num_bytes(self) -> int:
        """Bytes one pass streams (codes and scales)."""
        return self.weight.num_bytes


# ------------------------------------------------------------------ torch path (any device)
KERNELS_ENV = "TANDEM_QUANT_KERNELS"  # "c" (default: C kernels on the CPU) or "torch"


def uses_torch_path(w: QWeight) -> bool:
    """Whether `w` runs as torch ops: it lives off the CPU, or TANDEM_QUANT_KERNELS=torch."""
    choice = os.environ.get(KERNELS_ENV, "c")
    if choice not in ("c", "torch"):
        raise ValueError(f"{KERNELS_ENV}='{choice}'; expected one of: c, torch")
    return w.qs.device.type != "cpu" or choice == "torch"


def dequantize_torch(w: QWeight) -> torch.Tensor:
    """`dequantize` as torch ops on `w`'s device: fp32 [N, K], w = d * q + m per group of
    32 (q4: byte j of a group holds element j low, j + 16 high; kernels/quant.c), as one
    fused multiply-add like the C loop (bit-equal to it on this CPU)."""
    n, k = w.shape
    q = codes(w).view(n, k // GROUP, GROUP)
    return torch.addcmul(w.m.unsqueeze(2), q.float(), w.d.unsqueeze(2)).view(n, k)


def codes(w: QWeight) -> torch.Tensor:
    """`w`'s codes as uint8 [N, K] in input order (q4: 0..15, q8: 0..255)."""
    n, k = w.shape
    if isinstance(w, Q4Weight):
        b = w.qs.view(n, k // GROUP, GROUP // 2)
        return torch.cat((b & 0x0F, b >> 4), dim=2).view(n, k)
    return w.qs.view(n, k)


def matmul_torch(
    w: QWeight,
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    alpha: float = 1.0,
    col_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`matmul`'s result, (alpha * x * col_scale) @ W^T (+ residual) in fp32, as torch ops
    on the weight's device: W is dequantized for this call only. Rows are not guaranteed
    bit-identical across row counts (the BLAS picks its kernel by shape), as for fp32 mm."""
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns; the weight expects {w.shape[1]}")
    x = x.float()
    if col_scale is not None:
        x = x * col_scale
    if alpha != 1.0:
        x = x * alpha
    wt = dequantize_torch(w).t()
    if residual is None:
        return torch.mm(x, wt)
    return torch.addmm(residual.float(), x, wt)
