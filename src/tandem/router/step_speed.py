"""`PrefillSpeed`: each worker's measured prefill time per token, from the engine steps its
`WorkerStats` carry (the samples the planner fits), so the KV cost can weigh a prompt's prefill
on a slow worker by what it takes there, not by its token count alone.

Per worker, over its last `window` steps that prefilled, the least-squares line
wall_ms = a + b · prefill_tokens; ms per token is its slope b (a step's fixed part and any
decode it carried go to a: a ratio of sums would make a worker whose prompts hit its cache, and
so prefill in small steps, look slow). ms per token is the line at a `reference_tokens` step
over those tokens; too few steps, or too little spread in their sizes, and the ratio of sums
stands in. `slowness(w)` is that over the fastest measured candidate's (≥ 1); a
worker not measured yet counts as the fastest (1), so nothing changes until steps arrive.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from tandem.protocols.scaling import StepSample

DEFAULT_WINDOW = 64


class PrefillSpeed:
    """Synchronous; one event loop."""

    def __init__(
        self, window: int = DEFAULT_WINDOW, min_tokens: int = 256, reference_tokens: int = 2048
    ) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self._window = window
        self._reference = reference_tokens
        self._min_tokens = min_tokens  # below this a worker's ratio is too noisy to use
        self._steps: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, worker_id: str, samples: Iterable[StepSample]) -> None:
        steps = self._steps.get(worker_id)
        for s in samples:
            if s.num_prefill_tokens <= 0 or s.wall_ms <= 0:
                continue
            if steps is None:
                steps = self._steps[worker_id] = deque(maxlen=self._window)
            steps.append((s.wall_ms, s.num_prefill_tokens))

    def forget(self, worker_id: str) -> None:
        self._steps.pop(worker_id, None)

    def ms_per_token(self, worker_id: str) -> float | None:
        steps = self._steps.get(worker_id)
        if not steps:
            return None
        n = len(steps)
        tokens = sum(t for _, t in steps)
        if tokens < self._min_tokens:
            return None
        wall = sum(ms for ms, _ in steps)
        mean_t, mean_ms = tokens / n, wall / n
        var = sum((t - mean_t) ** 2 for _, t in steps)
        if n >= 8 and var > 0 and (var / n) ** 0.5 >= 0.25 * mean_t:
            slope = sum((t - mean_t) * (ms - mean_ms) for ms, t in steps) / var
            at_reference = mean_ms + slope * (self._reference - mean_t)
            if slope > 0 and at_reference > 0:
                return at_reference / self._reference
        return wall / tokens

    def slowness(self, worker_ids: Sequence[str]) -> dict[str, float]:
        """Each worker's ms per token over the fastest measured one's; 1 when unmeasured."""
        speeds = {w: self.ms_per_token(w) for w in worker_ids}
        known = [v for v in speeds.values() if v is not None]
        if not known:
            return dict.fromkeys(worker_ids, 1.0)
        fastest = min(known)
        return {w: 1.0 if v is None else max(v / fastest, 1.0) for w, v in speeds.items()}
