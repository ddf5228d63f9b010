"""`PrefillSpeed`: each worker's measured prefill time per token, from the engine steps its
`WorkerStats` carry (the samples the planner fits), so the KV cost can weigh a prompt's prefill
on a slow worker by what it takes there, not by its token count alone.

Per worker, over its last `window` steps that prefilled, a line wall_ms = a + b · prefill_tokens
fitted by Theil–Sen (the median of the slopes between pairs of steps whose sizes differ by a
quarter of the mean or more, and the median intercept): its slope is the time per prompt token,
a step's fixed part and any decode it carried go to a (a ratio of sums would make a worker
whose prompts hit its cache, and so prefill in small steps, look slow), and a step the host
stole the CPU from does not move a median the way it moves a mean or a least-squares line (a
shared CI host showed one worker 4× slower than its identical peers from a few such steps).
ms per token is the line at a `reference_tokens` step over those tokens; too few pairs and the
median of the steps' own ms per token stands in; fewer than `min_steps` steps or `min_tokens`
tokens and the worker is not measured. `slowness(w)` is that over the fastest measured
candidate's (≥ 1); a worker not measured yet counts as the fastest (1), so nothing changes
until steps arrive. The estimate is recomputed when a worker's steps arrive, not per route.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from statistics import median

from tandem.protocols.scaling import StepSample

DEFAULT_WINDOW = 64


class PrefillSpeed:
    """Synchronous; one event loop."""

    def __init__(
        self,
        window: int = DEFAULT_WINDOW,
        min_tokens: int = 256,
        reference_tokens: int = 2048,
        min_steps: int = 3,
    ) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self._window = window
        self._reference = reference_tokens
        self._min_tokens = min_tokens  # below this a worker's ratio is too noisy to use
        self._min_steps = min_steps
        self._steps: dict[str, deque[tuple[float, int]]] = {}
        self._estimate: dict[str, float | None] = {}

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
        return self._estimate.get(worker_id)

    def _fit(self, steps: deque[tuple[float, int]]) -> float | None:
        n = len(steps)
        if n < self._min_steps or sum(t for _, t in steps) < self._min_tokens:
            return None
        spread = 0.25 * sum(t for _, t in steps) / n
        points = list(steps)
        slopes = [
            (ms_j - ms_i) / (t_j - t_i)
            for i, (ms_i, t_i) in enumerate(points)
            for ms_j, t_j in points[i + 1 :]
            if abs(t_j - t_i) >= spread
        ]
        if len(slopes) >= n:
            slope = median(slopes)
            if slope > 0:
                at_reference = median(ms - slope * t for ms, t in points) + slope * self._reference
                if at_reference > 0:
                    return at_reference / self._reference
        return median(ms / t for ms, t in points)

    def slowness(self, worker_ids: Sequence[str]) -> dict[str, float]:
        """Each worker's ms per token over the fastest measured one's; 1 when unmeasured."""
        speeds = {w: self.ms_per_token(w) for w in worker_ids}
        known = [v for v in speeds.values() if v is not None]
        if not known:
            return dict.fromkeys(worker_ids, 1.0)
        fastest = min(known)
        return {w: 1.0 if v is None else max(v / fastest, 1.0) for w, v in speeds.items()}
