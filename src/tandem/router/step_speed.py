"""`PrefillSpeed`: each worker's measured prefill time per token, from the engine steps its
`WorkerStats` carry (the samples the planner fits), so the KV cost can weigh a prompt's prefill
on a slow worker by what it takes there, not by its token count alone.

Per worker, over its last `window` steps that prefilled, a line wall_ms = a + b · prefill_tokens
fitted by Theil–Sen (the median of the slopes between pairs of steps whose sizes differ by a
quarter of the mean or more). The speed is the slope b alone. The intercept holds a step's fixed
part and the decode rows it carried, which depend on what else runs on the worker (the mocker's
decode time grows with its KV use), not on how fast it prefills: counting it made identical
workers read 1.0–1.3× apart under load. A ratio of sums would make a worker whose prompts hit
its cache, and so prefill in small steps, look slow; a step the host stole the CPU from does
not move a median the way it moves a mean (a shared CI host showed one worker 4× slower than
its identical peers from a few such steps). Too few pairs and the median of the steps' own ms
per token stands in; fewer than `min_steps` steps or `min_tokens` tokens and the worker is not
measured.

`slowness(w)` is w's slope over the fastest measured candidate's (≥ 1), and 1 while the two
differ by less than the larger of their fits' errors (the median relative distance of a
worker's steps from its line: jitter, decode rows, and a step time that is not straight in
the tokens; the mocker's is quadratic, so equal workers that prefilled chunks of different
sizes fit slopes ~10 % apart). Read as speed, that spread outweighed a few decode blocks in
the cost and put a long prompt beside a running request instead of on an idle worker. A worker
not measured yet counts as the fastest (1). The estimate is recomputed when a worker's steps
arrive, not per route.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from tandem.protocols.scaling import StepSample

DEFAULT_WINDOW = 64


@functools.cache
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays (i, j) of every pair i < j of n points (n is at most a window)."""
    return np.triu_indices(n, 1)


class Slope(NamedTuple):
    """ms per prompt token, and the median relative distance of the steps from the line."""

    ms: float
    error: float


class PrefillSpeed:
    """Synchronous; one event loop."""

    def __init__(
        self,
        window: int = DEFAULT_WINDOW,
        min_tokens: int = 256,
        min_steps: int = 3,
    ) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self._window = window
        self._min_tokens = min_tokens  # below this a worker's ratio is too noisy to use
        self._min_steps = min_steps
        self._steps: dict[str, deque[tuple[float, int]]] = {}
        self._estimate: dict[str, Slope | None] = {}

    def observe(self, worker_id: str, samples: Iterable[StepSample]) -> None:
        steps = self._steps.get(worker_id)
        added = False
        for s in samples:
            if s.num_prefill_tokens <= 0 or s.wall_ms <= 0:
                continue
            if steps is None:
                steps = self._steps[worker_id] = deque(maxlen=self._window)
            steps.append((s.wall_ms, s.num_prefill_tokens))
            added = True
        if added and steps is not None:
            self._estimate[worker_id] = self._fit(steps)

    def forget(self, worker_id: str) -> None:
        self._steps.pop(worker_id, None)
        self._estimate.pop(worker_id, None)

    def ms_per_token(self, worker_id: str) -> float | None:
        estimate = self._estimate.get(worker_id)
        return None if estimate is None else estimate.ms

    def _fit(self, steps: deque[tuple[float, int]]) -> Slope | None:
        n = len(steps)
        if n < self._min_steps or sum(t for _, t in steps) < self._min_tokens:
            return None
        # numpy over the window's pairs: the fit runs on every WorkerStats with prefill steps
        # (each worker, twice a second), and the pairs loop in Python was 3 % of a busy
        # frontend's CPU
        ms, tokens = np.array(steps, dtype=np.float64).T
        spread = 0.25 * float(tokens.sum()) / n
        i, j = _pairs(n)
        d_tokens = tokens[j] - tokens[i]
        apart = np.abs(d_tokens) >= spread
        slopes = (ms[j] - ms[i])[apart] / d_tokens[apart]
        if len(slopes) >= n and (slope := float(np.median(slopes))) > 0:
            intercept = float(np.median(ms - slope * tokens))
            error = float(np.median(np.abs(ms - intercept - slope * tokens) / ms))
            return Slope(slope, error)
        ratios = ms / tokens
        ratio = float(np.median(ratios))
        return Slope(ratio, float(np.median(np.abs(ratios - ratio) / ratios)))

    def slowness(self, worker_ids: Sequence[str]) -> dict[str, float]:
        """Each worker's ms per token over the fastest measured one's; 1 when unmeasured
        or within the larger of the two fits' errors of the fastest."""
        estimates = {w: self._estimate.get(w) for w in worker_ids}
        known = [v for v in estimates.values() if v is not None]
        if not known:
            return dict.fromkeys(worker_ids, 1.0)
        fastest = min(known, key=lambda v: v.ms)

        def told_apart(v: Slope) -> bool:
            return v.ms > fastest.ms * (1.0 + max(v.error, fastest.error))

        return {
            w: v.ms / fastest.ms if v is not None and told_apart(v) else 1.0
            for w, v in estimates.items()
        }
