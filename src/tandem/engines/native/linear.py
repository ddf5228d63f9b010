"""A bias-free linear layer tuned for CPU inference.

One row (batch-1 decode) goes through MKL's mat-vec on a contiguous W^T. Several rows go
through oneDNN with a prepacked copy of W, which is 1.5-2x faster than plain GEMM for the
small row counts of batched decode. Results of the two paths differ only by fp32 rounding.
On another device (CUDA) there is no oneDNN packing: every row count is a plain mm/addmm.
"""

from __future__ import annotations

import torch

PACK_BATCH_HINT = 32  # the row count oneDNN optimises the packed layout for


def can_pack(dtype: torch.dtype, device: torch.device | None = None) -> bool:
    """Whether oneDNN can prepack weights of `dtype` on `device` (fp32 on the CPU only)."""
    return (
        dtype == torch.float32
        and (device is None or device.type == "cpu")
        and bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _zeros(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """addmm's ignored input when beta=0 (one per dtype and device, never written)."""
    z = _ZEROS.get((dtype, device))
    if z is None:
        z = _ZEROS[(dtype, device)] = torch.zeros(1, 1, dtype=dtype, device=device)
    return z


class Linear:
    """y = x @ W^T, optionally + residual. Immutable after construction; thread-safe."""

    __slots__ = ("packed", "weight_t")
    fuses_norm = False  # an RMSNorm is applied before the call (QuantLinear: in it)
    glu = False  # the output is the projection itself (QuantLinear: may be silu(gate) * up)

    def __init__(self, weight: torch.Tensor, *, pack: bool) -> None:
        self.weight_t = weight.t().contiguous()  # [in, out]
        self.packed: torch.Tensor | None = None
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.contiguous(), PACK_BATCH_HINT
            )

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        alpha: float = 1.0,
        norm_eps: float | None = None,
    ) -> torch.Tensor:
        """(alpha * x) @ W^T (+ residual); alpha rides addmm's scale (no extra kernel).
        `norm_eps`: x's rows are RMS-normalized first (a separate pass here: the model
        forwards normalize with the C ops instead, `fuses_norm` being False)."""
        if norm_eps is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps)
        if self.packed is None or x.shape[0] == 1:
            if residual is None:
                if alpha == 1.0:
                    return torch.mm(x, self.weight_t)
                return torch.addmm(_zeros(x.dtype, x.device), x, self.weight_t, beta=0, alpha=alpha)
            return torch.addmm(residual, x, self.weight_t, alpha=alpha)
        if alpha != 1.0:
            x = x * alpha
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return y if residual is None else y.add_(residual)

    @property
    def in_features(self) -> int:
        return int(self.weight_t.shape[0])

    @property
    def num_bytes(self) -> int:
        """Bytes one pass streams (one copy of the weight)."""
        return self.weight_t.numel() * self.weight_t.element_size()
