"""Prometheus exposition shared by the frontend, the router and the workers.

Metrics are `prometheus_client` objects (Counter, Gauge, Histogram), their lock-free one-loop
counterparts for hot paths (`LoopMetric`, `LoopHistogram`) and collectors registered on
a per-process (per-frontend, per-worker) `CollectorRegistry`, never the global one, so two
stacks in one test process never share series. `render` writes text format 0.0.4 as
`prometheus_client.generate_latest` does, except that integral values are printed as integers:
a counter at 12,345,678 reads `12345678`, not `1.2345678e+07` (both parse to the same number; the
integer is what an operator greps for). `merge` joins expositions of several processes
(workers) into one, one HELP/TYPE block per family, for `/metrics/workers`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from prometheus_client import disable_created_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "summary": "summary"}
_OM_ONLY = ("_created", "_gsum", "_gcount")

# `_created` series double every counter and histogram and no dashboard reads them
disable_created_metrics()  # type: ignore[no-untyped-call]


class Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


def render(*collectors: Collector) -> bytes:
    """Text exposition of every family `collectors` yield (a registry is a collector)."""
    out: list[str] = []
    for collector in collectors:
        for family in collector.collect():
            out.extend(_family_lines(family))
    return ("\n".join(out) + "\n").encode() if out else b""


def _family_lines(family: Metric) -> Iterable[str]:
    name = family.name + "_total" if family.type == "counter" else family.name
    doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    yield f"# HELP {name} {doc}"
    yield f"# TYPE {name} {_TYPES.get(family.type, 'untyped')}"
    for s in family.samples:
        if any(s.name == family.name + suffix for suffix in _OM_ONLY):
            continue
        yield f"{s.name}{_labels(s.labels)} {format_value(s.value)}"


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    parts = (f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + ",".join(parts) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def format_value(value: float) -> str:
    """Integers exactly (ints of any size; floats up to 2**53), other floats by repr."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


class Families:
    """A fixed list of families as a collector (for `render`)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


class LoopValue:
    """One series of a `LoopMetric`: a plain number (an int while only ints are added)."""

    __slots__ = ("_counter", "value")

    def __init__(self, counter: bool) -> None:
        self.value: float = 0
        self._counter = counter

    def inc(self, amount: float = 1) -> None:
        if amount < 0 and self._counter:
            raise ValueError(f"a counter only goes up; inc({amount})")
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        if self._counter:
            raise ValueError("a counter only goes up; dec() is for gauges")
        self.value -= amount

    def set(self, value: float) -> None:
        if self._counter:
            raise ValueError("a counter only goes up; set() is for gauges")
        self.value = value


class TallyCollector:
    """One counter read at scrape time from a tally a component keeps itself (e.g. discovery
    records rejected by `EtcdDiscovery.num_forged`), so the component needs no registry."""

    def __init__(self, name: str, documentation: str, count: Callable[[], int]) -> None:
        self.name, self.documentation, self._count = name, documentation, count

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, value=self._count())


class LoopMetric:
    """A counter or gauge for one event loop's hot path: `labels(...)` gives the series as a
    `LoopValue` (inc/dec/set, no lock: prometheus_client's take one per update, and a
    request updates ~10), exposed through `collect` (register it on a registry). Not
    thread-safe."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], *, counter: bool
    ) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames, self._counter = tuple(labelnames), counter
        self._series: dict[tuple[str, ...], LoopValue] = {}

    def labels(self, *values: object) -> LoopValue:
        key = tuple(map(str, values))
        series = self._series.get(key)
        if series is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}; got {key}")
            series = self._series[key] = LoopValue(self._counter)
        return series

    def _family(self) -> CounterMetricFamily | GaugeMetricFamily:
        cls = CounterMetricFamily if self._counter else GaugeMetricFamily
        return cls(self.name, self.documentation, labels=self.labelnames)

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for labels, series in sorted(self._series.items()):
            family.add_metric(list(labels), series.value)
        return [family]


class LoopHistogram:
    """A histogram for one event loop's hot path (a token's inter-token latency): no locks,
    one bisect and three additions per observation; exposed through `collect` like
    prometheus_client's (register it on a registry). Not thread-safe. `child` gives a series
    for inline updates (`TokenTimer`), `labels(...).observe(v)` reads as prometheus_client's."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames, self.buckets = tuple(labelnames), tuple(float(b) for b in buckets)
        self._le = [*(repr(b) for b in self.buckets), "+Inf"]  # as prometheus_client writes le
        self._series: dict[tuple[str, ...], list[float]] = {}  # bucket counts..., sum

    def child(self, *labels: str) -> list[float]:
        """The series of `labels` (created at 0); pass it to `observe` on the hot path."""
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = [0.0] * (len(self.buckets) + 2)
        return series

    def observe(self, series: list[float], value: float) -> None:
        series[bisect.bisect_left(self.buckets, value)] += 1
        series[-1] += value

    def labels(self, *values: object) -> LoopHistogramSeries:
        key = tuple(map(str, values))
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}; got {key}")
        return LoopHistogramSeries(self, self.child(*key))

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, series in sorted(self._series.items()):
            acc, buckets = 0.0, []
            for le, n in zip(self._le, series[:-1], strict=True):
                acc += n
                buckets.append((le, acc))
            family.add_metric(list(labels), buckets, sum_value=series[-1])
        return [family]


class LoopHistogramSeries:
    """One series of a `LoopHistogram`, with prometheus_client's `observe`."""

    __slots__ = ("_histogram", "_series")

    def __init__(self, histogram: LoopHistogram, series: list[float]) -> None:
        self._histogram, self._series = histogram, series

    def observe(self, value: float) -> None:
        self._histogram.observe(self._series, value)


class Labelled:
    """`collector`'s families with `labels` added to every sample (first in each label set)."""

    def __init__(self, collector: Collector, labels: Mapping[str, str]) -> None:
        self._collector, self._labels = collector, dict(labels)

    def collect(self) -> Iterable[Metric]:
        for family in self._collector.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**self._labels, **s.labels}) for s in family.samples]
            yield out


def merge(texts: Iterable[str]) -> bytes:
    """One exposition from several: samples of a family are joined under its first HELP and
    TYPE (the sources must not repeat a series; workers label theirs with `worker_id`)."""
    by_name: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            seen = by_name.get(family.name)
            if seen is None:
                by_name[family.name] = family
            elif seen.type == family.type:
                seen.samples.extend(family.samples)
    return render(Families(by_name.values()))


def parse(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """sample name → {sorted label pairs → value}: what tests and `tandem bench` read back."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out
