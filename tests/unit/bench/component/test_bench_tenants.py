"""`tandem bench tenants` (issue 33) on a tiny fast fleet: every scenario the noisy and batch
rows print is measured, A's service while it floods is counted inside the send window, and
the table carries each figure beside FIFO's."""

from __future__ import annotations

import asyncio

import pytest

from tandem.bench.component import tenants

pytestmark = pytest.mark.timeout(120)


def test_noisy_and_batch_rows_on_a_tiny_fleet() -> None:
    args = tenants.parse_args(
        ["--workers", "2", "--speedup", "10", "--duration-s", "1", "--calibrate-s", "0.5",
         "--only", "noisy,batch", "--batch-lines", "40", "--batch-timeout-s", "30"]
    )  # fmt: skip
    result = asyncio.run(tenants.run(args))
    noisy = result["noisy"]
    assert set(noisy) == {"alone", "fifo", "fair"}
    assert noisy["alone"]["a_served_tokens"] == 0  # A does not send when B runs alone
    for mode in ("fifo", "fair"):
        window = noisy[mode]["a_served_in_window_tokens"]
        assert 0 < window <= noisy[mode]["a_served_tokens"], (mode, noisy[mode])
    for mode in noisy:
        assert noisy[mode]["b_ttft_p99_s"] > 0, (mode, noisy[mode])
    batch = result["batch"]
    assert batch["without"]["batch_done"] == 0
    assert batch["fifo"]["batch_done"] == batch["fair"]["batch_done"] == 40
    assert all(batch[m]["chat_ttft_p99_s"] > 0 for m in batch)

    table = tenants.format_result(result)
    assert "A served while it flooded: FIFO" in table
    assert "target <= 1.2x" in table and "target <= +10 %" in table
    assert "lines done FIFO 40, batch class 40 of 40" in table
