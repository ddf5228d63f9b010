"""`EngineProfile`: an engine's measured step times, as `tandem profile` writes them.

The file is JSON (version 1):

    {"version": 1, "engine": "mocker", "model": "smollm2", "block_size": 64,
     "num_total_blocks": 16384, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
     "prefill": {"isl": [128, 512, ...], "ttft_ms": [...]},
     "decode": {"batch": [1, 4, ...], "context": [256, 1024, ...],
                "itl_ms": [[...per context...] per batch]}}

`prefill.ttft_ms[i]`: one prompt of `isl[i]` uncached tokens alone on the engine, time to its
first token. `decode.itl_ms[b][c]`: `batch[b]` sequences of `context[c]` tokens each decoding
together, time per step; the active KV tokens of that point are batch × context.
Readers interpolate linearly between grid points and extrapolate from the two outermost
points (never below 0), so a reader is defined everywhere.
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import msgspec

PROFILE_VERSION = 1


class PrefillCurve(msgspec.Struct, kw_only=True):
    isl: list[int]
    ttft_ms: list[float]


class DecodeGrid(msgspec.Struct, kw_only=True):
    batch: list[int]
    context: list[int]
    itl_ms: list[list[float]]


class EngineProfile(msgspec.Struct, kw_only=True):
    version: int = PROFILE_VERSION
    engine: str
    model: str
    block_size: int
    num_total_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill: PrefillCurve
    decode: DecodeGrid

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version={self.version}; expected {PROFILE_VERSION}")
        _check_axis("prefill.isl", self.prefill.isl)
        _check_len("prefill.ttft_ms", self.prefill.ttft_ms, len(self.prefill.isl))
        _check_axis("decode.batch", self.decode.batch)
        _check_axis("decode.context", self.decode.context)
        _check_len("decode.itl_ms", self.decode.itl_ms, len(self.decode.batch))
        for row in self.decode.itl_ms:
            _check_len("decode.itl_ms row", row, len(self.decode.context))

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_total_blocks * self.block_size

    def ttft_ms(self, isl: float) -> float:
        """Prefill time of one prompt of `isl` uncached tokens (0 tokens → 0)."""
        if isl <= 0:
            return 0.0
        return max(interp(self.prefill.isl, self.prefill.ttft_ms, isl), 0.0)

    def itl_ms(self, batch: float, context: float) -> float:
        """Decode step time with `batch` sequences of `context` tokens each (bilinear)."""
        if batch <= 0:
            return 0.0
        d = self.decode
        per_batch = [interp(d.context, row, context) for row in d.itl_ms]
        return max(interp(d.batch, per_batch, batch), 0.0)

    def prefill_tokens_per_s(self, isl: float) -> float:
        """Prefill throughput of one engine fed prompts of `isl` tokens back to back."""
        ms = self.ttft_ms(isl)
        return isl / ms * 1000.0 if ms > 0 else float("inf")


def _check_axis(name: str, axis: list[int]) -> None:
    if len(axis) < 2 or any(b <= a for a, b in itertools.pairwise(axis)) or axis[0] < 1:
        raise ValueError(f"{name}={axis}: expected >= 2 increasing positive points")


def _check_len(name: str, values: list[float] | list[list[float]], n: int) -> None:
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} values; expected {n} (one per grid point)")


def interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear y(x) through the points; linear extrapolation outside them."""
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class ProfileFile:
    path: Path

    def read(self) -> EngineProfile:
        """Raises ValueError naming the file on any malformed or invalid content."""
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=EngineProfile)
        except (OSError, msgspec.MsgspecError, ValueError) as exc:
            raise ValueError(f"engine profile {self.path}: {exc}") from exc

    def write(self, profile: EngineProfile) -> None:
        data = msgspec.to_builtins(profile)
        self.path.write_text(json.dumps(data, indent=1) + "\n")


def load_profile(path: str | Path) -> EngineProfile:
    return ProfileFile(Path(path)).read()
