"""The load generator and stack orchestration of `tandem bench` against a real `tandem serve`."""

from __future__ import annotations

import psutil
import pytest

from tandem.bench.cell import run_cell
from tandem.bench.loadgen import LoadConfig
from tandem.bench.tandem_stack import tandem_mocker_stack
from tandem.bench.workload import SyntheticConfig, synthetic_requests

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_shared_prefix_load_against_tandem_serve_then_everything_stops(tmp_path):
    specs = synthetic_requests(
        SyntheticConfig(num_groups=2, prompts_per_group=4, prefix_len=256, suffix_len=16, osl=8),
        8,
    )
    with tandem_mocker_stack(tmp_path, layout="serve", num_workers=1) as stack:
        pids = [stack.frontend_pid, *(c.pid for c in psutil.Process(stack.frontend_pid).children())]
        config = LoadConfig(
            url=stack.url, concurrency=2, num_requests=8, server_pids=(stack.frontend_pid,)
        )
        first = run_cell(config, specs)
        second = run_cell(config, specs)  # same prompts again: prefixes are cached now
    assert first["num_ok"] == second["num_ok"] == 8
    assert first["output_tokens"] == 8 * 8  # ignore_eos + max_tokens honoured
    assert first["prompt_tokens"] == 8 * 272
    # 2 groups: the first pass recomputes each prefix once at most; the second reuses them
    assert second["cached_fraction"] > 0.8
    assert second["ttft_ms"]["p50"] is not None
    assert second["server_cpu_ms_per_request"][str(stack.frontend_pid)] >= 0
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
