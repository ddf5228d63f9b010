"""An agent's counters (`TransferStats`) and the Prometheus families a worker exposes for them."""

from __future__ import annotations

import msgspec
from prometheus_client.core import CounterMetricFamily, SummaryMetricFamily
from prometheus_client.metrics_core import Metric


class TransferStats(msgspec.Struct, kw_only=True):
    """Counters of one agent (monotonic)."""

    num_created: int = 0
    num_complete: int = 0
    num_errored: int = 0
    num_cancelled: int = 0
    num_expired: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    num_transfers: int = 0  # pulls and pushes this agent ran (its side of a transfer)
    transfer_seconds: float = 0.0  # their wall time, summed


def transfer_families(stats: TransferStats) -> list[Metric]:
    """``stats`` as the ``tandem_transfer_*`` families (operations, bytes, duration)."""
    p = "tandem_transfer"
    ops = CounterMetricFamily(
        f"{p}_operations", "transfer operations created here, by final status", labels=["status"]
    )
    ops.add_metric(["created"], stats.num_created)
    for status in ("complete", "errored", "cancelled", "expired"):
        ops.add_metric([status], getattr(stats, f"num_{status}"))
    moved = CounterMetricFamily(f"{p}_bytes", "KV bytes moved by this agent", labels=["direction"])
    moved.add_metric(["sent"], stats.bytes_sent)
    moved.add_metric(["received"], stats.bytes_received)
    duration = SummaryMetricFamily(
        f"{p}_duration_seconds",
        "wall time of the pulls and pushes this agent ran",
        count_value=stats.num_transfers,
        sum_value=stats.transfer_seconds,
    )
    return [ops, moved, duration]
