from __future__ import annotations

import pytest

from tandem.bench.component.soak import (
    SoakConfig,
    SoakRun,
    format_table,
    slope_mb_per_min,
    summarize,
)


def test_slope_is_least_squares_in_mb_per_minute() -> None:
    assert slope_mb_per_min([(0.0, 50.0), (60.0, 51.0), (120.0, 52.0)]) == pytest.approx(1.0)
    noisy = [(t * 5.0, 80.0 + (0.3 if t % 2 else -0.3)) for t in range(60)]
    assert abs(slope_mb_per_min(noisy) or 0.0) < 0.05  # flat with noise
    assert slope_mb_per_min([(0.0, 1.0), (5.0, 2.0)]) is None  # too few points


def test_summary_leaves_warmup_out_and_flags_growth() -> None:
    run = SoakRun(duration_s=400.0)
    # the worker grows during warm-up only; the frontend keeps growing 0.6 MB/min
    run.samples["worker0"] = [(t, 50.0 + min(t, 100.0) * 0.1) for t in range(0, 400, 5)]
    run.samples["serve"] = [(t, 90.0 + t * 0.01) for t in range(0, 400, 5)]
    run.num_ok["chat"] = 10
    run.failures["chat: HTTP 500"] = 2
    summary = summarize(run, SoakConfig(duration_s=400.0, warmup_share=0.25))
    worker, serve = summary["processes"]["worker0"], summary["processes"]["serve"]
    assert worker["slope_mb_per_min"] == pytest.approx(0.0, abs=1e-9) and worker["meets_target"]
    assert serve["slope_mb_per_min"] == pytest.approx(0.6) and not serve["meets_target"]
    assert summary["num_failed"] == 2
    table = format_table(summary)
    assert "MISSED" in table and "failure x2: chat: HTTP 500" in table


def test_config_rejects_a_warmup_share_of_one() -> None:
    with pytest.raises(ValueError, match=r"warmup_share=1\.0"):
        SoakConfig(warmup_share=1.0)
