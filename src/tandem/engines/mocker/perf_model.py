"""How long one scheduling pass of the simulated engine takes (Dynamo's polynomial defaults).

prefill_ms(T) = 4.209989e-7·T² + 1.518344e-2·T + 16.50142, T = uncached prompt tokens computed in
the pass (= batch × (mean ISL − mean cached prefix) over the prefilling sequences);
decode_ms(u)  = max(−25.74·u² + 54.01·u + 5.74, 1), u = fraction of KV blocks in use (the
scheduler leaves out the blocks that sequences still prefilling hold themselves: no decode
reads them, and Dynamo's mocker charges a 61k-token prompt's chunks beside decodes the same).
A pass that prefills and decodes costs the sum. Pure functions; the engine divides by
`speedup_ratio`. `ProfilePerfModel` replaces the polynomials with a measured engine profile
(`tandem profile`, tandem.engines.profile), interpolated (DESIGN.md §8).
"""

from __future__ import annotations

from typing import Protocol

from tandem.engines.profile import EngineProfile, load_profile

PREFILL_A = 4.209989e-7
PREFILL_B = 1.518344e-2
PREFILL_C = 16.50142
DECODE_A = -25.74
DECODE_B = 54.01
DECODE_C = 5.74
MIN_DECODE_MS = 1.0


def prefill_ms(num_new_tokens: int) -> float:
    """Time to prefill `num_new_tokens` uncached tokens in one pass (0 tokens → 0 ms)."""
    if num_new_tokens <= 0:
        return 0.0
    t = float(num_new_tokens)
    return PREFILL_A * t * t + PREFILL_B * t + PREFILL_C


def prefill_ms_for_batch(batch_size: int, mean_isl: float, mean_cached: float) -> float:
    """The model's own form: T = batch × (mean ISL − mean cached prefix)."""
    return prefill_ms(round(batch_size * max(mean_isl - mean_cached, 0.0)))


def decode_ms(kv_usage: float) -> float:
    """Time of one decode pass with `kv_usage` ∈ [0, 1] of the KV blocks in use."""
    u = min(max(kv_usage, 0.0), 1.0)
    return max(DECODE_A * u * u + DECODE_B * u + DECODE_C, MIN_DECODE_MS)


def step_ms(num_prefill_tokens: int, num_decode_seqs: int, kv_usage: float) -> float:
    """One pass: prefill cost of its prefill tokens plus a decode pass if any sequence decodes."""
    total = prefill_ms(num_prefill_tokens)
    if num_decode_seqs > 0:
        total += decode_ms(kv_usage)
    return total


class PerfModel(Protocol):
    def step_ms(
        self, num_prefill_tokens: int, num_decode_seqs: int, num_decode_kv_tokens: int, usage: float
    ) -> float:
        """Duration of one pass (`usage`: fraction of KV blocks in use)."""
        ...


class PolynomialPerfModel:
    """The polynomial defaults above."""

    def step_ms(
        self, num_prefill_tokens: int, num_decode_seqs: int, num_decode_kv_tokens: int, usage: float
    ) -> float:
        return step_ms(num_prefill_tokens, num_decode_seqs, usage)


class ProfilePerfModel:
    """A measured engine (`tandem profile`): the pass's prefill costs the profile's TTFT of that
    many tokens, its decode the profile's ITL at (decoding sequences, mean context), both
    interpolated; a mixed pass costs the sum, as in the polynomial model."""

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile

    def step_ms(
        self, num_prefill_tokens: int, num_decode_seqs: int, num_decode_kv_tokens: int, usage: float
    ) -> float:
        total = self.profile.ttft_ms(num_prefill_tokens)
        if num_decode_seqs > 0:
            context = num_decode_kv_tokens / num_decode_seqs
            total += max(self.profile.itl_ms(num_decode_seqs, context), MIN_DECODE_MS / 10)
        return total


def make_perf_model(profile_path: str | None) -> PerfModel:
    """The profile's model when a path is given (ValueError naming the file if it is bad),
    else the polynomial defaults."""
    if profile_path is None:
        return PolynomialPerfModel()
    return ProfilePerfModel(load_profile(profile_path))
