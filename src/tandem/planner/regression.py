"""`StepTimeModel`: online least squares of an engine's step wall time,

    step_ms ≈ c0 + c1 · prefill_tokens + c2 · decode_kv_tokens,

over the last `window` step samples of a pool's workers (one model per pool: the workers run
the same engine). Coefficients are clamped at 0 (a longer step never gets cheaper); until
`min_samples` arrive, or when the samples do not vary enough to separate the terms, the
missing coefficients come from the prior.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from tandem.protocols.scaling import StepSample


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    base_ms: float
    ms_per_prefill_token: float
    ms_per_decode_kv_token: float

    def step_ms(self, prefill_tokens: float, decode_kv_tokens: float) -> float:
        return (
            self.base_ms
            + self.ms_per_prefill_token * prefill_tokens
            + self.ms_per_decode_kv_token * decode_kv_tokens
        )


# a small engine's guess until data arrives (the mocker's polynomial at low load)
DEFAULT_PRIOR = StepCoefficients(
    base_ms=6.0, ms_per_prefill_token=0.016, ms_per_decode_kv_token=1e-4
)


class StepTimeModel:
    """Not thread-safe. `observe` is O(1); `fit` solves a 3×3 system over the window."""

    def __init__(
        self, *, window: int = 2000, min_samples: int = 20, prior: StepCoefficients = DEFAULT_PRIOR
    ) -> None:
        self._rows: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        self.prior = prior
        self.coefficients = prior

    @property
    def num_samples(self) -> int:
        return len(self._rows)

    def observe(self, sample: StepSample) -> None:
        self._rows.append(
            (float(sample.num_prefill_tokens), float(sample.num_decode_kv_tokens), sample.wall_ms)
        )

    def fit(self) -> StepCoefficients:
        if len(self._rows) < self.min_samples:
            return self.coefficients
        data = np.asarray(self._rows)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        y = data[:, 2]
        usable = [0] + [j for j in (1, 2) if np.ptp(x[:, j]) > 0]  # a constant column says nothing
        coef, *_ = np.linalg.lstsq(x[:, usable], y, rcond=None)
        values = [
            self.prior.base_ms,
            self.prior.ms_per_prefill_token,
            self.prior.ms_per_decode_kv_token,
        ]
        for j, c in zip(usable, coef, strict=True):
            values[j] = max(float(c), 0.0)
        self.coefficients = StepCoefficients(*values)
        return self.coefficients

    def predict(self, prefill_tokens: float, decode_kv_tokens: float) -> float:
        return self.coefficients.step_ms(prefill_tokens, decode_kv_tokens)
