"""Load-only policies: round_robin, random, least_loaded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.protocols.discovery import Instance
from tandem.protocols.engine import PreprocessedRequest
from tandem.router.policy_router import PolicyRouter


class RoundRobinRouter(PolicyRouter):
    """Cycles through the live instances in id order."""

    policy = "round_robin"
    _counter = 0

    def _choose(
        self, request: PreprocessedRequest, candidates: Sequence[Instance]
    ) -> tuple[Instance, dict[str, Any]]:
        chosen = candidates[self._counter % len(candidates)]
        self._counter += 1
        return chosen, {"policy": self.policy}


class RandomRouter(PolicyRouter):
    """Uniformly random live instance (seeded by `RouterConfig.seed`)."""

    policy = "random"

    def _choose(
        self, request: PreprocessedRequest, candidates: Sequence[Instance]
    ) -> tuple[Instance, dict[str, Any]]:
        return self._rng.choice(list(candidates)), {"policy": self.policy}


class LeastLoadedRouter(PolicyRouter):
    """Fewest requests in flight from this router, then fewest waiting on the worker (its
    LoadMetrics), then lowest KV usage; remaining ties at random."""

    policy = "least_loaded"

    def _key(self, worker_id: str) -> tuple[int, int, float]:
        load = self.loads.get(worker_id)
        if load is None:
            return (self.inflight(worker_id), 0, 0.0)
        return (self.inflight(worker_id), load.num_waiting, load.active_fraction)

    def _choose(
        self, request: PreprocessedRequest, candidates: Sequence[Instance]
    ) -> tuple[Instance, dict[str, Any]]:
        keys = {c.instance_id: self._key(c.instance_id) for c in candidates}
        best = min(keys.values())
        tied = [c for c in candidates if keys[c.instance_id] == best]
        chosen = self._rng.choice(tied)
        return chosen, {"policy": self.policy, "inflight": best[0], "waiting": best[1]}
