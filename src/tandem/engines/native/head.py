"""The output head: full fp32 logits, or greedy tokens read from a bf16 copy of the head.

The head (vocab x hidden, 113 MB in fp32 for SmolLM2) is the largest single weight a decode
step streams. For greedy rows we stream a bf16 copy (half the bytes) and keep the fp32 result
exact: a rigorous error bound per vocabulary row,

    |x . w - x_lo . w_lo| <= |x| |w - w_lo| + |x - x_lo| |w_lo|        (Cauchy-Schwarz)

plus a wide margin for rounding in both products, leaves a short candidate list that must
contain the fp32 argmax; the candidates are then scored in fp32. Only where two fp32 logits
differ in the last bits (a near-tie) can the pick differ from a full fp32 head. Only up to
SCREEN_MAX_ROWS rows: there the head is memory-bound; with more rows the fp32 GEMM is
compute-bound and screening measured no faster (32 rows: same step time). Screening is a
CPU trick (oneDNN bf16 mat-vecs): a head on another device always takes the fp32 logits.
"""

from __future__ import annotations

import torch

from tandem.engines.native.linear import Linear

ROUNDING_MARGIN = 2.0**-8  # times |x||w| and |logit|: >100x fp32 accumulation error, n=576
SCREEN_MAX_ROWS = 8  # beyond, the fp32 GEMM is compute-bound and screening saves nothing
MAX_CANDIDATES = 4096  # beyond this the fp32 head is cheaper than gathering rows


def fast_bf16_available() -> bool:
    """True where bf16 mat-vecs run at memory speed (oneDNN with native bf16 support)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and torch.backends.mkldnn.is_available() and check())  # type: ignore[no-untyped-call]


class OutputHead:
    """logits(x) = x @ W^T in fp32; greedy(x) = its argmax per row. Immutable; thread-safe."""

    def __init__(self, weight: torch.Tensor, *, pack: bool, screen: bool) -> None:
        self.weight = weight.contiguous()  # [vocab, hidden] fp32: candidate rows are gathered
        self.linear = Linear(self.weight, pack=pack)
        self.low: torch.Tensor | None = None
        if screen and weight.dtype == torch.float32 and weight.device.type == "cpu":
            low = self.weight.to(torch.bfloat16)
            self.low = low
            self.low_norm = low.float().norm(dim=1)  # |w_lo|
            self.err_norm = (self.weight - low.float()).norm(dim=1)  # |w - w_lo|

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).float()

    def greedy(self, x: torch.Tensor) -> list[int]:
        """argmax_j of x @ W^T per row of x [rows, hidden], from the bf16 copy when present."""
        if self.low is None or x.dtype != torch.float32 or x.shape[0] > SCREEN_MAX_ROWS:
            return self.logits(x).max(dim=-1).indices.tolist()
        x_lo = x.to(torch.bfloat16)
        approx = torch.mm(x_lo, self.low.t()).float()  # [rows, vocab]
        x_norm = x.norm(dim=1, keepdim=True)
        dx_norm = (x - x_lo.float()).norm(dim=1, keepdim=True)
        lo_scale = x_lo.float().norm(dim=1, keepdim=True) * ROUNDING_MARGIN
        bound = x_norm * self.err_norm + (dx_norm + lo_scale) * self.low_norm
        bound.add_(approx.abs(), alpha=ROUNDING_MARGIN)
        floor = (approx - bound).max(dim=1, keepdim=True).values
        rows, cols = torch.nonzero(approx + bound >= floor, as_tuple=True)
        if cols.numel() > MAX_CANDIDATES:
            return self.logits(x).max(dim=-1).indices.tolist()
        scores = (self.weight.index_select(0, cols) * x.index_select(0, rows)).sum(dim=1)
        return _segment_argmax(rows.tolist(), cols.tolist(), scores.tolist(), x.shape[0])

    @property
    def num_bytes(self) -> int:
        """Bytes of the fp32 head (what a full-logits pass streams)."""
        return self.linear.num_bytes


def _segment_argmax(rows: list[int], cols: list[int], scores: list[float], n: int) -> list[int]:
    best = [float("-inf")] * n
    pick = [0] * n
    for r, c, s in zip(rows, cols, scores, strict=True):
        if s > best[r] or (s == best[r] and c < pick[r]):
            best[r], pick[r] = s, c
    return pick
