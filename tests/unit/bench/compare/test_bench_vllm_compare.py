from __future__ import annotations

import argparse
import asyncio

import pytest
from tests.support.eventually import eventually

from tandem.bench.compare import vllm as vllm_compare
from tandem.bench.compare.vllm import System


def _cell(system, conc, rnd, tok_s, ttft):
    return {"system": system, "concurrency": conc, "round": rnd, "num_ok": 4,
            "output_tok_per_s": tok_s, "ttft_p50_ms": ttft}  # fmt: skip


def test_rows_pair_each_round_with_vllms_and_read_the_verdict_from_the_interval():
    cells = [
        _cell("vllm", 8, 0, 100.0, 400.0), _cell("tandem", 8, 0, 90.0, 410.0),
        _cell("vllm", 8, 1, 50.0, 800.0), _cell("tandem", 8, 1, 50.0, 801.0),
        _cell("vllm", 8, 2, 100.0, 400.0), _cell("tandem", 8, 2, 97.0, 403.0),
    ]  # fmt: skip
    (row,) = vllm_compare.summarize_ratios(cells)
    assert row["throughput_ratios"] == [0.9, 1.0, 0.97]
    assert row["ttft_p50_diffs_ms"] == [10.0, 1.0, 3.0]
    # the median diff (3 ms) would have passed 5 ms; the interval, mean 4.67, does not decide
    ttft = row["ttft_p50_diff_ms"]
    assert ttft["mean"] == pytest.approx(14 / 3) and ttft["n"] == 3
    assert ttft["low"] < 0 < 5 < ttft["high"]
    assert row["ttft_verdict"] == "unresolved" and row["verdict"] == "unresolved"
    text = vllm_compare.format_ratios([row], "--max-rounds 3 reached")
    assert "UNRESOLVED: this machine cannot resolve it" in text and "95% CI [" in text


def _rounds(diffs: list[float], ratio: float = 1.0, conc: int = 1) -> list[dict]:
    cells = []
    for rnd, diff in enumerate(diffs):
        cells += [
            _cell("vllm", conc, rnd, 100.0, 200.0),
            _cell("tandem", conc, rnd, 100.0 * ratio + rnd % 2 * 0.1, 200.0 + diff),
        ]
    return cells  # fmt: skip


@pytest.mark.parametrize(
    ("diffs", "ratio", "ttft", "overall"),
    [([1.0, 2.0, 1.5, 0.5, 1.0, 2.0], 1.0, "met", "met"),
     ([9.0, 11.0, 10.0, 12.0], 1.0, "missed", "missed"),
     ([1.0, 2.0, 1.5, 0.5], 0.8, "met", "missed"),
     ([-20.0, 20.0, 15.0, -10.0], 1.0, "unresolved", "unresolved")],
)  # fmt: skip
def test_verdicts_on_both_targets(diffs, ratio, ttft, overall):
    (row,) = vllm_compare.summarize_ratios(_rounds(diffs, ratio))
    assert (row["ttft_verdict"], row["verdict"]) == (ttft, overall)
    ttft_line = vllm_compare.format_ratios([row]).splitlines()[1]
    assert ttft_line.endswith(f"target <= +5 ms: {ttft.upper()}") or ttft == "unresolved"
    assert ("UNRESOLVED" in ttft_line) is (ttft == "unresolved")


def _args(**kw):
    base = {"min_rounds": 3, "max_rounds": 8, "max_minutes": 60.0, "confidence": 0.95}
    return argparse.Namespace(**(base | kw))


def test_rounds_continue_until_resolved_or_a_budget_runs_out():
    resolved = _rounds([1.0, 2.0, 1.5, 0.5])
    assert vllm_compare.stop_reason(resolved[:4], 2, 60.0, _args()) is None  # below min
    assert "resolved after 4" in vllm_compare.stop_reason(resolved, 4, 60.0, _args())
    noisy = _rounds([-20.0, 20.0, 15.0, -10.0])
    assert vllm_compare.stop_reason(noisy, 4, 60.0, _args()) is None  # runs another round
    assert "--max-rounds 4" in vllm_compare.stop_reason(noisy, 4, 60.0, _args(max_rounds=4))
    # 4 rounds took 50 min: a fifth would end past the hour
    assert "--max-minutes 60" in vllm_compare.stop_reason(noisy, 4, 3000.0, _args())


def test_round_flags_are_checked():
    parser = argparse.ArgumentParser()
    vllm_compare.add_arguments(parser)
    with pytest.raises(SystemExit):
        vllm_compare._validate(parser, parser.parse_args(["--min-rounds", "1"]))
    with pytest.raises(SystemExit):
        vllm_compare._validate(parser, parser.parse_args(["--confidence", "1"]))
    vllm_compare._validate(parser, parser.parse_args([]))


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
