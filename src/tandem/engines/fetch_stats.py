"""`PeerFetchStats`: one worker's peer KV fetches (issue 31) as it pulls and exports them,
whichever way its KV moves (tandem's transfer agents in `tandem.disagg.peer_fetch`, vLLM's
NixlConnector in `tandem.engines.vllm.peer_fetch`), and their ``tandem_kv_fetch_*`` metrics.
The bandwidth and setup time it measures reach the router with the worker's load."""

from __future__ import annotations

import collections
import statistics
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

BANDWIDTH_EWMA = 0.2  # weight of the newest fetch in the measured bandwidth
SETUP_WINDOW = 32  # fetches whose setup time's median the router charges


class PeerFetchStats:
    """Counters of one worker's fetches (fetcher) and exports (holder). Loop thread, except
    `num_exported`/`num_export_blocks` (agent threads; int updates are atomic enough)."""

    def __init__(self, bandwidth_bytes_per_s: float) -> None:
        self.num_started = 0
        self.num_succeeded = 0
        self.num_fell_back = 0
        self.num_blocks = 0
        self.num_bytes = 0
        self.seconds = 0.0
        self.num_exported = 0
        self.num_export_blocks = 0
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s  # declared, then measured (EWMA)
        # the measured fixed part of a fetch, all of it but the pull: the median of the last
        # SETUP_WINDOW (one starved by a busy host moves it little); None before the first
        self.setup_s: float | None = None
        self._setups: collections.deque[float] = collections.deque(maxlen=SETUP_WINDOW)

    def add_setup(self, seconds: float) -> None:
        self._setups.append(seconds)
        self.setup_s = statistics.median(self._setups)

    def succeeded(self, *, num_blocks: int, num_bytes: int, seconds: float, pull_s: float) -> None:
        """Count a fetch of ``seconds`` in all; the bandwidth is measured over its pull
        (``pull_s``: the bytes moving), not its round trips (the router charges those as the
        fetch's setup)."""
        self.num_succeeded += 1
        self.num_blocks += num_blocks
        self.num_bytes += num_bytes
        self.seconds += seconds
        self.add_setup(max(seconds - pull_s, 0.0))
        if pull_s > 0 and num_bytes > 0:
            measured = num_bytes / pull_s
            self.bandwidth_bytes_per_s += BANDWIDTH_EWMA * (measured - self.bandwidth_bytes_per_s)

    def families(self) -> list[Metric]:
        """``tandem_kv_fetch_*``: this worker's peer KV fetches and exports."""
        out: list[Metric] = []
        for name, doc, value in (
            ("started", "peer KV fetches started", self.num_started),
            ("succeeded", "peer KV fetches that filled the prefix", self.num_succeeded),
            ("fell_back", "peer KV fetches given up (the prompt was computed)", self.num_fell_back),
            ("blocks", "KV blocks fetched from peers", self.num_blocks),
            ("bytes", "KV bytes fetched from peers", self.num_bytes),
            ("seconds", "time spent fetching KV from peers", self.seconds),
            ("exported", "peer fetches this worker served", self.num_exported),
            ("exported_blocks", "KV blocks this worker exported to peers", self.num_export_blocks),
        ):
            out.append(CounterMetricFamily(f"tandem_kv_fetch_{name}", doc, value=value))
        out.append(
            GaugeMetricFamily(
                "tandem_kv_fetch_bandwidth_bytes_per_second",
                "peer KV fetch bandwidth (declared, then measured)",
                value=self.bandwidth_bytes_per_s,
            )
        )
        out.append(
            GaugeMetricFamily(
                "tandem_kv_fetch_setup_seconds",
                "measured fixed part of a peer KV fetch (round trips, not the bytes)",
                value=self.setup_s or 0.0,
            )
        )
        return out
