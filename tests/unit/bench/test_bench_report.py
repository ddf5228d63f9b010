from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.bench.client import RequestResult
from tandem.bench.loadgen import LoadConfig, LoadRun
from tandem.bench.report import format_summary, percentile, summarize


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.floats(0, 100),
)
def test_percentile_matches_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-9, abs=1e-6)


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)


def test_summary_counts_only_successes_in_latency_and_rates():
    ok = [
        RequestResult(
            status=200,
            ttft_s=0.01 * (i + 1),
            e2e_s=0.1,
            itl_s=[0.001, 0.003],
            prompt_tokens=100,
            output_tokens=10,
            cached_tokens=25,
        )
        for i in range(4)
    ]
    failed = [RequestResult(status=503, error="busy"), RequestResult(status=0, error="refused")]
    run = LoadRun(
        config=LoadConfig(), model="m", results=ok + failed, wall_s=2.0, server_cpu_s={42: 0.02}
    )
    s = summarize(run)
    assert (s["num_ok"], s["num_errors"]) == (4, 2)
    assert s["errors_by_status"] == {"503": 1, "0": 1}
    assert s["req_per_s"] == pytest.approx(2.0)
    assert s["output_tok_per_s"] == pytest.approx(20.0)
    assert s["cached_fraction"] == pytest.approx(0.25)
    assert s["ttft_ms"]["p50"] == pytest.approx(25.0)
    assert s["itl_ms"]["p50"] == pytest.approx(2.0)  # all gaps pooled: four 1 ms, four 3 ms
    assert s["server_cpu_ms_per_request"] == {"42": pytest.approx(5.0)}
    text = format_summary(s)
    assert "4/6 ok" in text and "25.0 %" in text and "5.000 CPU-ms" in text
