"""Prometheus metrics of the frontend, rendered as text exposition format 0.0.4.

A tiny dependency-free implementation: label values are tuples, observations are O(buckets)
at worst and O(1) dict lookups otherwise, so they are cheap enough to record per chunk.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from tandem.frontend.request_stats import RequestStatsCollector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (1, 8, 32, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Counter:
    def __init__(self, name: str, help_: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help_, labels
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def render(self, kind: str = "counter") -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {kind}"
        for values, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.label_names, values)} {v:g}"


class Gauge(Counter):
    def set(self, labels: tuple[str, ...], value: float) -> None:
        self.values[labels] = value

    def render(self, kind: str = "gauge") -> Iterable[str]:
        return super().render(kind)


class Histogram:
    def __init__(
        self, name: str, help_: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
    ) -> None:
        self.name, self.help, self.buckets, self.label_names = name, help_, buckets, labels
        self.series: dict[
            tuple[str, ...], list[float]
        ] = {}  # n+1 bucket counts (last = +Inf), sum, count

    def observe(self, value: float, labels: tuple[str, ...] = ()) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = [0.0] * (len(self.buckets) + 3)
        series[bisect.bisect_left(self.buckets, value)] += 1  # last slot before sum = +Inf
        series[-2] += value
        series[-1] += 1

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        n = len(self.buckets)
        for values, series in sorted(self.series.items()):
            cumulative = 0.0
            for i, bound in enumerate((*self.buckets, float("inf"))):
                cumulative += series[i]
                le = "+Inf" if i == n else f"{bound:g}"
                labels = _labels(self.label_names, values, f'le="{le}"')
                yield f"{self.name}_bucket{labels} {cumulative:g}"
            yield f"{self.name}_sum{_labels(self.label_names, values)} {series[-2]:g}"
            yield f"{self.name}_count{_labels(self.label_names, values)} {series[-1]:g}"


class FrontendMetrics:
    """Every frontend metric; one instance per frontend. `interval`, when given, also receives
    arrivals, TTFT, ITL, ISL/OSL and outcomes for the planner (tandem.frontend.request_stats)."""

    def __init__(
        self, prefix: str = "tandem_frontend", interval: RequestStatsCollector | None = None
    ) -> None:
        self.interval = interval
        p = prefix
        m = ("model",)
        self.requests = Counter(
            f"{p}_requests_total", "requests by outcome", ("model", "endpoint", "status")
        )
        self.inflight = Gauge(f"{p}_inflight_requests", "requests in flight", m)
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds", "time to first token", _LATENCY_BUCKETS, m
        )
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds", "time between tokens", _LATENCY_BUCKETS, m
        )
        self.duration = Histogram(
            f"{p}_request_duration_seconds", "request duration", _DURATION_BUCKETS, m
        )
        self.input_len = Histogram(
            f"{p}_input_sequence_tokens", "prompt tokens per request", _TOKEN_BUCKETS, m
        )
        self.output_len = Histogram(
            f"{p}_output_sequence_tokens", "output tokens per request", _TOKEN_BUCKETS, m
        )
        self.input_tokens = Counter(f"{p}_input_tokens_total", "prompt tokens", m)
        self.output_tokens = Counter(f"{p}_output_tokens_total", "generated tokens", m)
        self.cached_tokens = Counter(
            f"{p}_cached_tokens_total", "prompt tokens from prefix cache", m
        )
        self.migrations = Counter(f"{p}_migrations_total", "streams moved to another worker", m)
        self.disconnects = Counter(
            f"{p}_client_disconnects_total", "requests cancelled by the client", m
        )
        self.worker_load = Gauge(
            f"{p}_worker_load",
            "per-worker load as the router sees it",
            ("model", "worker_id", "metric"),
        )

    def arrived(self, model: str) -> None:
        if self.interval is not None:
            self.interval.arrived(model)

    def observe_ttft(self, seconds: float, labels: tuple[str, ...]) -> None:
        self.ttft.observe(seconds, labels)
        if self.interval is not None:
            self.interval.ttft(labels[0], seconds)

    def observe_itl(self, seconds: float, labels: tuple[str, ...]) -> None:
        self.itl.observe(seconds, labels)
        if self.interval is not None:
            self.interval.itl(labels[0], seconds)

    def render(self, worker_loads: dict[str, dict[str, dict[str, float]]], extra: str = "") -> str:
        """Text exposition; `worker_loads` is model -> Router.worker_loads()."""
        self.worker_load.values.clear()
        for model, loads in worker_loads.items():
            for worker_id, row in loads.items():
                for name, value in row.items():
                    self.worker_load.set((model, worker_id, name), value)
        lines: list[str] = []
        for metric in (
            self.requests,
            self.inflight,
            self.ttft,
            self.itl,
            self.duration,
            self.input_len,
            self.output_len,
            self.input_tokens,
            self.output_tokens,
            self.cached_tokens,
            self.migrations,
            self.disconnects,
            self.worker_load,
        ):
            lines.extend(metric.render())
        text = "\n".join(lines) + "\n"
        return text + extra if extra else text
