"""The load generator and stack orchestration of `tandem bench` against a real `tandem serve`,
and one row of `tandem bench routers` end to end."""

from __future__ import annotations

import argparse

import psutil
import pytest

from tandem.bench.cell import run_cell
from tandem.bench.component import routers
from tandem.bench.component.router_workloads import AgentSessionsConfig, agent_sessions
from tandem.bench.loadgen import LoadConfig
from tandem.bench.tandem_stack import tandem_mocker_stack
from tandem.bench.workload import SyntheticConfig, synthetic_requests
from tandem.engines.mocker.config import MockerConfig

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


def test_a_routers_row_measures_tandem_kv_over_two_mocker_workers(tmp_path):
    """`tandem bench routers`' row for tandem `kv` (`tandem serve`, 2 mocker workers) on a
    small agents workload (12 requests in half a second, replayed once at their send times):
    every request answered, most of the reusable prefix cached, the oracle taken over the
    requests sent, the CPU of the process that routes measured, no peer fetch hinted."""
    parser = argparse.ArgumentParser()
    routers.add_arguments(parser)
    args = parser.parse_args(["--speedup-ratio", "20", "--concurrency", "4", "--context-length",
                              "8192", "--tandem-layout", "serve", "--duration-s", "30",
                              "--timeout-s", "30"])  # fmt: skip
    specs = agent_sessions(
        AgentSessionsConfig(num_sessions=6, turns=2, num_system_prompts=2, system_len=256,
                            user_len=16, answer_len=4, session_rate_per_s=20.0, think_s=0.2)
    )  # fmt: skip
    ((sent, oracle),) = routers.variant_specs(specs, ["tokens"], MockerConfig().block_size).values()
    row = routers.measure_row(
        routers.System("tandem", "kv"), "tokens", 2, sent, oracle, args, tmp_path
    )
    assert "error" not in row, row
    assert (row["system"], row["workers"], row["num_ok"], row["num_errors"]) == ("kv", 2, 12, 0)
    assert row["oracle"] == oracle(12) and row["oracle"] > 0.5
    assert row["cached_fraction"] > 0.4 and 0.6 < row["share_of_oracle"] <= 1.0
    assert row["router_cpu_ms_per_req"] > 0 and row["front_cpu_ms_per_req"] > 0
    assert row["ttft_p50_ms"] > 0 and row["ttft_p90_ms"] >= row["ttft_p50_ms"]
    assert (row["kv_fetches"], row["kv_fetch_blocks"]) == (0, 0)  # workers without --kv-fetch
    assert routers.format_table([row]).splitlines()[2].startswith("kv ")
