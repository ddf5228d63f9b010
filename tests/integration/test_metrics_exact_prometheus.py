"""Counters past 10^7 keep exact values all the way into Prometheus: a real Prometheus scrapes a
`SystemServer` whose exposition holds 12,345,679 and 2^53 − 1, and its query API answers them
digit for digit (a six-significant-digit exposition would read 1.23457e+07)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from tests.support.prometheus import needs_prometheus, query, start_prometheus

from tandem.frontend.observability.metrics import FrontendMetrics
from tandem.runtime.system_server import SystemServer

pytestmark = [pytest.mark.timeout(60), needs_prometheus]


async def test_prometheus_reads_counters_past_ten_million_exactly(tmp_path: Path) -> None:
    metrics = FrontendMetrics()
    metrics.input_tokens.labels("m").inc(12_345_678)
    metrics.input_tokens.labels("m").inc(1)
    metrics.output_tokens.labels("m").inc(2**53 - 1)
    server = SystemServer(metrics=metrics.render, health=lambda: (True, {}))
    host, port = await server.start("127.0.0.1", 0)
    jobs = [{"job_name": "exact", "static_configs": [{"targets": [f"{host}:{port}"]}]}]
    prometheus = await asyncio.to_thread(start_prometheus, tmp_path, jobs)
    try:
        expected = {
            "tandem_frontend_input_tokens_total": "12345679",
            "tandem_frontend_output_tokens_total": "9007199254740991",
        }
        seen: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while seen != expected and time.monotonic() < deadline:
            for name in expected:
                rows = await asyncio.to_thread(query, prometheus, name)
                if rows:
                    seen[name] = rows[0]["value"][1]
            await asyncio.sleep(0.2)
        assert seen == expected
    finally:
        prometheus.stop()
        await server.close()
