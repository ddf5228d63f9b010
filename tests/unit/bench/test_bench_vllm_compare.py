from __future__ import annotations

import asyncio

import pytest
from tests.support.eventually import eventually

from tandem.bench import vllm_compare
from tandem.bench.vllm_compare import System


def _cell(system, conc, rnd, tok_s, ttft):
    return {"system": system, "concurrency": conc, "round": rnd, "num_ok": 4,
            "output_tok_per_s": tok_s, "ttft_p50_ms": ttft}  # fmt: skip


def test_ratios_pair_each_round_with_vllms_and_take_the_median():
    cells = [
        _cell("vllm", 8, 0, 100.0, 400.0), _cell("tandem", 8, 0, 90.0, 410.0),
        _cell("vllm", 8, 1, 50.0, 800.0), _cell("tandem", 8, 1, 50.0, 801.0),
        _cell("vllm", 8, 2, 100.0, 400.0), _cell("tandem", 8, 2, 97.0, 403.0),
    ]  # fmt: skip
    (row,) = vllm_compare.summarize_ratios(cells)
    assert row["throughput_ratios"] == [0.9, 1.0, 0.97]
    assert row["median_throughput_ratio"] == 0.97
    assert row["median_ttft_p50_diff_ms"] == 3.0 and row["meets_target"]


@pytest.mark.parametrize(("ratio", "ttft", "ok"), [(0.96, 5.0, True), (0.94, 0.0, False),
                                                    (1.2, 5.5, False)])  # fmt: skip
def test_verdict_is_the_issue_targets(ratio, ttft, ok):
    cells = [_cell("vllm", 1, 0, 100.0, 200.0), _cell("tandem", 1, 0, 100 * ratio, 200 + ttft)]
    (row,) = vllm_compare.summarize_ratios(cells)
    assert row["meets_target"] is ok
    assert ("OK" in vllm_compare.format_ratios([row])) is ok


def test_cpu_by_role_sums_the_measured_stack_and_counts_the_idle_ones_apart():
    vllm = System("vllm", roles={1: "api_server", 2: "engine_core", 3: "model_worker"})
    tandem = System("tandem", roles={4: "frontend", 5: "worker_host", 6: "engine_core",
                                     7: "model_worker"})  # fmt: skip
    summary = {"server_cpu_ms_per_request": {"1": 1.0, "2": 2.0, "3": 30.0, "4": 0.5,
                                             "5": 0.0, "6": 0.0, "7": 0.25}}  # fmt: skip
    cpu = vllm_compare._cpu_by_role(summary, vllm, [vllm, tandem])
    assert cpu["engine_total"] == 32.0 and cpu["outside_engine"] == 1.0
    assert cpu["idle_stacks"] == 0.75


def test_roles_follow_vllm_process_titles_and_stack_commands():
    role = vllm_compare._role
    assert role("vllm", False, "VLLM::EngineCor", "VLLM::EngineCore") == "engine_core"
    assert role("tandem", False, "VLLM::Worker", "VLLM::Worker") == "model_worker"
    assert role("vllm", True, "python", "python -m vllm.entrypoints.openai.api_server") == (
        "api_server"
    )
    assert role("tandem", True, "python", "python -m tandem.cli serve --engine vllm") == (
        "frontend"
    )
    assert role("tandem", False, "python", "python -m tandem.cli worker --engine vllm") == (
        "worker_host"
    )
    assert role("dynamo", True, "python", "python -m dynamo.vllm --model m") == "worker_host"


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_frozen_stops_only_the_engine_processes_and_resumes_them():
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(3)]  # fmt: skip
    try:
        engine_core, model_worker, host = (p.pid for p in procs)
        other = System("vllm", roles={engine_core: "engine_core", model_worker: "model_worker",
                                      host: "api_server"})  # fmt: skip
        stopped = [engine_core, model_worker]
        with vllm_compare._frozen([other]):
            asyncio.run(eventually(lambda: all(_state(p) == "T" for p in stopped)))
            assert _state(host) != "T"
        asyncio.run(eventually(lambda: all(_state(p.pid) != "T" for p in procs)))
    finally:
        for p in procs:
            p.kill()
            p.wait()
