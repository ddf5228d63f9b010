"""The greedy output head's screen over the quantized weights: the argmax of `linear(x)` per
row without every column in full (`kernels/quant.c`, tq_head_greedy)."""

from __future__ import annotations

from typing import Any

import torch

from tandem.engines.native.quant import (
    GROUP,
    TILE,
    Q4Weight,
    QuantLinear,
    QWeight,
    activation_bits,
    codes,
    kernels,
)


class ArgmaxScreen:
    """`screen(x)`: per row of x, the index of the largest column of `linear(x)` (the first on
    ties), bit-for-bit what `linear(x).max(-1).indices` gives, from a screening pass over a
    copy of the weights with one int8 scale per column and block of 64 k, against the row
    rounded again to 8 bits per block, plus a rigorous error bound; the exact kernel runs
    only on the few tiles that may hold the maximum (`kernels/quant.c`, tq_head_greedy). For
    the output head of greedy rows: at 32 rows the head's cost is its integer products, and
    the screen takes half of them and a quarter of the scale steps. None where it cannot
    answer (a NaN result: the caller takes the full logits). Every kernel build has the
    screen (the VNNI and AVX2 ones in integer products; the fp32 builds, AVX-512 and scalar,
    with the fp32 kernel's rounding in the bound); it serves where `enabled` (default: on the
    VNNI build, where it was measured faster than the full head: docs/perf-engine.md; the
    fp32 builds' screen sums one int8 product per weight, which is no cheaper than their full
    head; on AVX2, SmolLM2's head, one thread: 1 row 3.9 vs 4.1 ms, 8 rows 11.6 vs 11.3, 32
    rows 38 vs 34 ms full, so it stays off there). `available` says whether it serves. The
    copy costs one byte a weight beside the packed weight. Immutable; thread-safe."""

    def __init__(
        self, linear: QuantLinear, weight: QWeight, *, enabled: bool | None = None
    ) -> None:
        self.linear = linear
        self._fn: Any = None
        if enabled is None:
            enabled = activation_bits() == 15
        if linear._args is None or linear.glu or not enabled:
            return
        lib = kernels()
        block = int(lib.tq_screen_block())
        n, k = weight.shape
        tiles = -(-n // TILE)
        cols, blocks = tiles * TILE, -(-k // block)
        q_out = torch.full((cols, k), 128, dtype=torch.uint8)  # Q + 128
        d_out = torch.zeros(cols, blocks, dtype=torch.float32)
        # per column: |W_n|_2, |W_n - W'_n|_2, max |W'_n|, max_g (max code |d| + |m|)
        stats = torch.zeros(4, cols, dtype=torch.float64)
        top = 15 if isinstance(weight, Q4Weight) else 255
        all_codes = codes(weight)
        for r0 in range(0, n, 4096):  # rows in chunks: no [N, K] float64 beside the codes
            r1 = min(n, r0 + 4096)
            d, m = weight.d[r0:r1].double(), weight.m[r0:r1].double()
            q = all_codes[r0:r1].view(r1 - r0, k // GROUP, GROUP).double()
            w = (d.unsqueeze(-1) * q + m.unsqueeze(-1)).view(r1 - r0, k)
            if not bool(w.isfinite().all()) or float(w.abs().max()) > 1e15:
                return  # the kernel's no-overflow range (SCREEN_MAX); the full head serves
            wb = torch.nn.functional.pad(w, (0, blocks * block - k)).view(r1 - r0, blocks, block)
            scale = (wb.abs().amax(-1) / 127).float()
            sd = scale.double().unsqueeze(-1)
            qs = torch.where(sd > 0, torch.round(wb / sd.clamp_min(1e-300)), torch.zeros_like(wb))
            qs = qs.clamp(-127, 127)
            err = (wb - sd * qs).view(r1 - r0, -1)
            q_out[r0:r1] = (qs.view(r1 - r0, -1)[:, :k] + 128).to(torch.uint8)
            d_out[r0:r1] = scale
            stats[0, r0:r1] = w.pow(2).sum(1).sqrt()
            stats[1, r0:r1] = err.pow(2).sum(1).sqrt()
            stats[2, r0:r1] = (sd.squeeze(-1) * qs.abs().amax(-1)).amax(1)
            stats[3, r0:r1] = (top * d.abs() + m.abs()).amax(1)
        up = 1.0 + 2.0**-20  # fp32 rounding of the float64 figures, upwards
        self._cols = (stats * up).float().contiguous()
        if lib.tq_screen_layout() == 1:
            # VNNI: per tile of 32 columns, quads of 4 k, columns 0..15 then 16..31
            self._q = q_out.view(tiles, 2, 16, k // 4, 4).permute(0, 3, 1, 2, 4).contiguous()
        else:  # the fp32 builds: per tile, k-major (32 columns a k)
            self._q = q_out.view(tiles, TILE, k).transpose(1, 2).contiguous()
        self._d = d_out.view(tiles, TILE, blocks).transpose(1, 2).contiguous()
        self._kind = 4 if isinstance(weight, Q4Weight) else 8
        self._fn = lib.tq_head_greedy

    @property
    def num_bytes(self) -> int:
        """Bytes the screening copy holds (0 where this build does not screen)."""
        if self._fn is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self._q, self._d, self._cols))

    @property
    def available(self) -> bool:
        return self._fn is not None

    def __call__(self, x: torch.Tensor) -> list[int] | None:
        a = self.linear._args
        if self._fn is None or a is None:
            return None
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        rows, k = x.shape
        if k != a.k:
            raise ValueError(f"x has {k} columns; the weight expects {a.k}")
        out = torch.empty(rows, dtype=torch.int64)
        rc = self._fn(
            self._kind, x.data_ptr(), rows, k, 1.0, a.col_scale, a.qs, a.d, a.m, a.n,
            self._q.data_ptr(), self._d.data_ptr(), self._cols.data_ptr(), out.data_ptr(),
            torch.get_num_threads(), -1.0,
        )  # fmt: skip
        if rc == 1:
            return None
        if rc != 0:
            raise RuntimeError(f"quantized greedy head failed (code {rc}) for x {tuple(x.shape)}")
        return out.tolist()
