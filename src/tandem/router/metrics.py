"""`RouterMetrics`: counters and the routing-overhead histogram, rendered as Prometheus text."""

from __future__ import annotations

import bisect
from collections import Counter

OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class RouterMetrics:
    """Plain counters; the owner increments them. Not thread-safe."""

    def __init__(self) -> None:
        self.routed: Counter[str] = Counter()  # worker_id -> requests
        self.overlap_blocks = 0
        self.request_blocks = 0
        self.events: Counter[tuple[str, str]] = Counter()  # (type, status) -> count
        self._buckets = [0] * (len(OVERHEAD_BUCKETS_S) + 1)
        self._overhead_sum_s = 0.0
        self._overhead_count = 0

    def observe_route(
        self, worker_id: str, overlap_blocks: int, request_blocks: int, overhead_s: float
    ) -> None:
        self.routed[worker_id] += 1
        self.overlap_blocks += overlap_blocks
        self.request_blocks += request_blocks
        self._buckets[bisect.bisect_left(OVERHEAD_BUCKETS_S, overhead_s)] += 1
        self._overhead_sum_s += overhead_s
        self._overhead_count += 1

    @property
    def hit_rate(self) -> float:
        """Overlap blocks / request blocks over all routed requests (0 when none)."""
        return self.overlap_blocks / self.request_blocks if self.request_blocks else 0.0

    def render(self) -> str:
        out = ["# TYPE tandem_router_routed_requests_total counter"]
        out += [
            f'tandem_router_routed_requests_total{{worker_id="{w}"}} {n}'
            for w, n in sorted(self.routed.items())
        ]
        out += [
            "# TYPE tandem_router_kv_hit_rate gauge",
            f"tandem_router_kv_hit_rate {self.hit_rate:.6f}",
            "# TYPE tandem_router_overlap_blocks_total counter",
            f"tandem_router_overlap_blocks_total {self.overlap_blocks}",
            "# TYPE tandem_router_request_blocks_total counter",
            f"tandem_router_request_blocks_total {self.request_blocks}",
            "# TYPE tandem_router_kv_events_total counter",
        ]
        out += [
            f'tandem_router_kv_events_total{{type="{t}",status="{s}"}} {n}'
            for (t, s), n in sorted(self.events.items())
        ]
        out.append("# TYPE tandem_router_overhead_seconds histogram")
        acc = 0
        for bound, n in zip(OVERHEAD_BUCKETS_S, self._buckets, strict=False):
            acc += n
            out.append(f'tandem_router_overhead_seconds_bucket{{le="{bound}"}} {acc}')
        out.append(f'tandem_router_overhead_seconds_bucket{{le="+Inf"}} {self._overhead_count}')
        out.append(f"tandem_router_overhead_seconds_sum {self._overhead_sum_s:.9f}")
        out.append(f"tandem_router_overhead_seconds_count {self._overhead_count}")
        return "\n".join(out) + "\n"
