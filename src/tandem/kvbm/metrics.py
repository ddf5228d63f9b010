"""Counters of the KV block manager: transfers per direction, hit rates per tier over a sliding
window, blocks dropped (queue full, write error, corrupt), tier occupancy; Prometheus text
lines and a one-line INFO summary.

Thread-safe: the caller's thread and the kvbm worker threads update it concurrently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from tandem.kvbm.base import StorageTier, TierName
from tandem.runtime.metrics import Families, render

logger = logging.getLogger(__name__)

Direction = Literal["device_to_host", "host_to_disk", "host_to_device", "disk_to_device"]
DIRECTIONS: tuple[Direction, ...] = (
    "device_to_host",
    "host_to_disk",
    "host_to_device",
    "disk_to_device",
)
OFFLOAD: tuple[Direction, ...] = ("device_to_host", "host_to_disk")
ONBOARD: tuple[Direction, ...] = ("host_to_device", "disk_to_device")
DROP_REASONS = ("offload_queue_full", "disk_queue_full", "disk_write_error", "disk_corrupt")


@dataclass(slots=True)
class TransferStats:
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _LookupSample:
    t: float
    num_blocks: int
    device: int
    host: int
    disk: int


def occupancy(tiers: Iterable[StorageTier | None]) -> dict[TierName, tuple[int, int]]:
    """tier name → (blocks stored, capacity in blocks), in order, skipping absent tiers."""
    return {t.name: (t.num_blocks, t.capacity_blocks) for t in tiers if t is not None}


class KvbmMetrics:
    """`window_s` bounds the hit-rate window in time; `max_samples` bounds it in memory."""

    def __init__(
        self,
        *,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_samples: int = 65_536,
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self.transfers = {d: TransferStats() for d in DIRECTIONS}
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._samples: deque[_LookupSample] = deque(maxlen=max_samples)

    def record_transfer(
        self, direction: Direction, *, num_blocks: int, num_bytes: int, seconds: float
    ) -> None:
        with self._lock:
            stats = self.transfers[direction]
            stats.num_blocks += num_blocks
            stats.num_bytes += num_bytes
            stats.seconds += seconds

    def record_drop(self, reason: str, count: int = 1) -> None:
        with self._lock:
            self.dropped[reason] += count

    def record_lookup(
        self, *, num_blocks: int, device: int = 0, host: int = 0, disk: int = 0
    ) -> None:
        """One prefix lookup of `num_blocks` blocks, of which the leading ones hit these tiers."""
        assert device + host + disk <= num_blocks, "more hits than blocks looked up"
        with self._lock:
            self._samples.append(_LookupSample(self._clock(), num_blocks, device, host, disk))

    def hit_rates(self) -> dict[TierName, float]:
        """Fraction of looked-up blocks served by each tier within the window (0 when idle)."""
        with self._lock:
            horizon = self._clock() - self._window_s
            while self._samples and self._samples[0].t < horizon:
                self._samples.popleft()
            total = sum(s.num_blocks for s in self._samples)
            hits = {
                "device": sum(s.device for s in self._samples),
                "host": sum(s.host for s in self._samples),
                "disk": sum(s.disk for s in self._samples),
            }
        return {tier: (n / total if total else 0.0) for tier, n in hits.items()}  # type: ignore[misc]

    def families(
        self, occupancy: dict[TierName, tuple[int, int]], prefix: str = "tandem_kvbm"
    ) -> list[Metric]:
        """Prometheus families; `occupancy` maps tier → (blocks used, capacity). Offload and
        onboard are the same transfers split by direction, named as Dynamo's kvbm_* are."""
        p = prefix
        out: list[Metric] = []
        transfers = self.transfers.items()
        for name, doc, by_direction in (
            ("blocks_transferred", "KV blocks copied between tiers",
             [(d, stats.num_blocks) for d, stats in transfers]),
            ("bytes_transferred", "bytes copied between tiers",
             [(d, stats.num_bytes) for d, stats in transfers]),
            ("transfer_seconds", "seconds spent copying between tiers",
             [(d, stats.seconds) for d, stats in transfers]),
        ):  # fmt: skip
            family = CounterMetricFamily(
                f"{p}_{name}", f"{doc}, by direction", labels=["direction"]
            )
            for d, value in by_direction:
                family.add_metric([d], value)
            out.append(family)
        for name, directions, doc in (
            ("offload_blocks", OFFLOAD, "KV blocks offloaded to a slower tier"),
            ("onboard_blocks", ONBOARD, "KV blocks onboarded back to the device"),
        ):
            family = CounterMetricFamily(
                f"{p}_{name}", f"{doc}, by direction", labels=["direction"]
            )
            for d in directions:
                family.add_metric([d], self.transfers[d].num_blocks)
            out.append(family)
        dropped = CounterMetricFamily(
            f"{p}_dropped", "blocks not offloaded or not onboarded, by reason", labels=["reason"]
        )
        for reason, n in self.dropped.items():
            dropped.add_metric([reason], n)
        out.append(dropped)
        rates = self.hit_rates()
        hit_rate = GaugeMetricFamily(
            f"{p}_hit_rate",
            f"fraction of looked-up prompt blocks found in each tier (last {self._window_s:g}s)",
            labels=["tier"],
        )
        for tier, rate in rates.items():
            hit_rate.add_metric([tier], rate)
        out.append(hit_rate)
        for tier in ("host", "disk"):
            out.append(
                GaugeMetricFamily(
                    f"{p}_{tier}_cache_hit_rate",
                    f"fraction of looked-up prompt blocks found in the {tier} tier "
                    f"(last {self._window_s:g}s)",
                    value=rates[tier],
                )
            )
        for name, index, doc in (
            ("tier_blocks", 0, "blocks stored in each tier"),
            ("tier_capacity_blocks", 1, "capacity of each tier in blocks"),
        ):
            gauge = GaugeMetricFamily(f"{p}_{name}", doc, labels=["tier"])
            for tier, values in occupancy.items():
                gauge.add_metric([tier], values[index])
            out.append(gauge)
        return out

    def prometheus_lines(
        self, occupancy: dict[TierName, tuple[int, int]], prefix: str = "tandem_kvbm"
    ) -> list[str]:
        """Text exposition of `families`, one line per entry."""
        return render(Families(self.families(occupancy, prefix))).decode().splitlines()

    def summary(self, occupancy: dict[TierName, tuple[int, int]]) -> str:
        rates = self.hit_rates()
        tiers = " ".join(f"{t}={u}/{c}" for t, (u, c) in occupancy.items())
        moved = " ".join(f"{d}={s.num_blocks}" for d, s in self.transfers.items())
        dropped = sum(self.dropped.values())
        return (
            f"hit_rate device={rates['device']:.1%} host={rates['host']:.1%} "
            f"disk={rates['disk']:.1%} ({self._window_s:.0f}s) | occupancy {tiers} | "
            f"blocks {moved} | dropped={dropped}"
        )
