"""Exposition of the frontend's and the routers' metrics: integers are exact past 10^7 (1,234,567
reads `1234567`, not `1.23457e+06`), every family has HELP and TYPE (promtool), two models'
routers share one block per family, and worker expositions merge into one."""

from __future__ import annotations

from typing import Any

import pytest
from tests.support.prometheus import needs_promtool, promtool_check

from tandem.engines.worker_metrics import request_plane_families
from tandem.frontend.observability.metrics import FrontendMetrics
from tandem.protocols.discovery import ModelCard
from tandem.router.metrics import RouterMetrics
from tandem.runtime.metrics import Families, Labelled, format_value, merge, parse, render
from tandem.runtime.tcp.server import TcpRequestServer
from tandem.transfer.metrics import transfer_families


class _Models:
    def __init__(self) -> None:
        self.a, self.b = RouterMetrics(), RouterMetrics()
        self.a.observe_route("w1", 2, 4, 0.001)
        self.a.events[("batch", "applied")] += 3
        self.b.observe_route("w2", 0, 4, 0.0002)

    def worker_loads(self) -> dict[str, dict[str, dict[str, float]]]:
        return {
            "m1": {"w1": {"inflight": 1.0, "active_blocks": 3.0}},
            "m2": {"w2": {"router_active_blocks": 2.0, "router_prefill_tokens": 5.0}},
        }

    def routers(self) -> list[tuple[str, Any]]:
        return [("m1", self.a), ("m2", self.b)]

    def cards(self) -> list[tuple[ModelCard, int]]:
        card = ModelCard(name="m1", context_length=4096, block_size=16, num_total_blocks=1024)
        return [(card, 2)]


def _busy_metrics() -> FrontendMetrics:
    m = FrontendMetrics()
    m.watch(_Models())
    m.arrived("m1")
    m.first_token("m1", 0.01)
    m.observe_itl("m1", 0.002)
    m.left("m1", 0.5, had_first_token=True, failed=False)
    m.finished("m1", num_in=12_345_678, num_out=1_234_567, num_cached=16)
    m.input_tokens.labels("m1").inc(1)
    m.counted("", "chat_completions", "unary", "error", 400)
    return m


def test_counters_past_ten_million_are_exact() -> None:
    text = _busy_metrics().render().decode()
    assert 'tandem_frontend_input_tokens_total{model="m1"} 12345679\n' in text
    assert 'tandem_frontend_output_tokens_total{model="m1"} 1234567\n' in text
    assert "e+0" not in text  # no exponent anywhere, not even in histogram sums
    assert parse(text)["tandem_frontend_input_tokens_total"][(("model", "m1"),)] == 12_345_679


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1_234_567.0, "1234567"),
        (10_000_001.0, "10000001"),
        (2**53 - 1.0, "9007199254740991"),
        (12_345_678_901_234_567_890, "12345678901234567890"),  # an int stays exact at any size
        (0.5, "0.5"),
        (1e-05, "1e-05"),
        (float("inf"), "+Inf"),
    ],
)
def test_format_value(value: float, text: str) -> None:
    assert format_value(value) == text


def test_router_metrics_of_two_models_share_one_block_per_family() -> None:
    text = _busy_metrics().render().decode()
    for family in ("tandem_router_routed_requests_total", "tandem_router_overhead_seconds"):
        assert text.count(f"# TYPE {family} ") == 1
    assert (
        'tandem_router_routed_requests_total{worker_id="w1",model="m1",component="backend"} 1'
        in text
    )
    assert (
        'tandem_router_routed_requests_total{worker_id="w2",model="m2",component="backend"} 1'
        in text
    )
    assert (
        'tandem_router_kv_events_total{type="batch",status="applied",model="m1",'
        'component="backend"} 3' in text
    )
    assert 'tandem_frontend_worker_active_decode_blocks{model="m1",worker_id="w1"} 3' in text
    assert 'tandem_frontend_worker_active_prefill_tokens{model="m2",worker_id="w2"} 5' in text
    assert 'tandem_frontend_model_context_length{model="m1"} 4096' in text
    assert 'tandem_frontend_model_workers{model="m1"} 2' in text


def test_every_family_has_help_and_type() -> None:
    lines = _busy_metrics().render().decode().splitlines()
    helps = {line.split()[2] for line in lines if line.startswith("# HELP ")}
    types = {line.split()[2] for line in lines if line.startswith("# TYPE ")}
    assert helps == types and len(types) >= 20
    for line in lines:
        if not line.startswith("#"):
            name = line.split("{")[0].split()[0]
            assert any(name == t or name.startswith(t + "_") for t in types), line


@needs_promtool
def test_promtool_accepts_frontend_router_and_merged_worker_text() -> None:
    promtool_check(_busy_metrics().render())
    server = TcpRequestServer()
    server.stats.requests["ns.backend.generate"] += 3

    class _Stats:
        num_created = num_complete = 2
        num_errored = num_cancelled = num_expired = 0
        bytes_sent, bytes_received, num_transfers, transfer_seconds = 0, 8192, 2, 0.01

    families = Families([*transfer_families(_Stats()), *request_plane_families(server)])
    workers = [render(Labelled(families, {"worker_id": w})).decode() for w in ("a", "b")]
    merged = merge(workers)
    promtool_check(merged)
    parsed = parse(merged.decode())
    received = parsed["tandem_transfer_bytes_total"]
    assert received[(("direction", "received"), ("worker_id", "a"))] == 8192
    assert received[(("direction", "received"), ("worker_id", "b"))] == 8192
    assert merged.decode().count("# TYPE tandem_transfer_bytes_total counter") == 1


def test_loop_histogram_buckets_are_cumulative_and_inclusive() -> None:
    from tandem.runtime.metrics import LoopHistogram

    h = LoopHistogram("x_seconds", "x", ("model",), (0.01, 0.1))
    series = h.child("m")
    for value in (0.01, 0.05, 0.1, 7.0):
        h.observe(series, value)
    rows = parse(render(h).decode())
    buckets = {dict(k)["le"]: v for k, v in rows["x_seconds_bucket"].items()}
    assert buckets == {"0.01": 1, "0.1": 3, "+Inf": 4}
    assert rows["x_seconds_count"][(("model", "m"),)] == 4
    assert rows["x_seconds_sum"][(("model", "m"),)] == pytest.approx(7.16)


def test_loop_metrics_expose_what_prometheus_client_would() -> None:
    """The frontend's lock-free counters, gauges and histograms write the same exposition as
    prometheus_client's for the same updates; a counter refuses to go down."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from tandem.runtime.metrics import LoopHistogram, LoopMetric

    ref = CollectorRegistry()
    counter = Counter("x_requests", "requests", ("model", "code"), registry=ref)
    gauge = Gauge("x_inflight", "in flight", ("model",), registry=ref)
    histogram = Histogram("x_seconds", "latency", ("model",), registry=ref, buckets=(0.01, 0.1))
    loop_counter = LoopMetric("x_requests", "requests", ("model", "code"), counter=True)
    loop_gauge = LoopMetric("x_inflight", "in flight", ("model",), counter=False)
    loop_histogram = LoopHistogram("x_seconds", "latency", ("model",), (0.01, 0.1))
    for c, g, h in ((counter, gauge, histogram), (loop_counter, loop_gauge, loop_histogram)):
        c.labels("a", 200).inc()
        c.labels("a", 200).inc(12_345_678)
        c.labels("b", 404).inc()
        g.labels("a").inc()
        g.labels("a").inc(3)
        g.labels("a").dec()
        g.labels("b").set(7.5)
        for value in (0.01, 0.05, 2.0):
            h.labels("a").observe(value)
    assert render(loop_counter, loop_gauge, loop_histogram) == render(ref)
    with pytest.raises(ValueError, match="only goes up"):
        loop_counter.labels("a", 200).inc(-1)
    with pytest.raises(ValueError, match="only goes up"):
        loop_counter.labels("a", 200).dec()
    with pytest.raises(ValueError, match="takes labels"):
        loop_gauge.labels("a", "b")
