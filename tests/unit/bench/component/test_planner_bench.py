"""`tandem bench planner` and its simulator (`component.planner_sim`): the queueing and the
worker-seconds against hand-computed cases, the static baseline measured on the same arrivals,
and a verdict that fails a planner that decides wrongly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.bench.component import planner as bench
from tandem.bench.component.planner_report import (
    BenchConfig,
    Outcome,
    RunResult,
    meets_slo,
    summarize_all,
    time_at_cap,
    verdict,
)
from tandem.bench.component.planner_sim import FleetSimulation
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.profile import DecodeGrid, EngineProfile, PrefillCurve, ProfileFile
from tandem.planner.observation import PoolObservation
from tandem.planner.planner import Planner, ScaleAction

# every prompt's prefill step takes 100 ms, every decode step 10 ms: hand-computable
FLAT = EngineProfile(
    engine="mocker", model="smollm2", block_size=16, num_total_blocks=4096, max_num_seqs=64,
    max_num_batched_tokens=2048,
    prefill=PrefillCurve(isl=[16, 4096], ttft_ms=[100.0, 100.0]),
    decode=DecodeGrid(batch=[1, 64], context=[16, 4096], itl_ms=[[10.0, 10.0], [10.0, 10.0]]),
)  # fmt: skip


@pytest.fixture
def flat_profile(tmp_path: Path) -> Path:
    path = tmp_path / "flat.json"
    ProfileFile(path).write(FLAT)
    return path


def _mocker(path: Path, speedup: float = 1.0) -> MockerConfig:
    return MockerConfig(tokenizer=None, perf_profile=str(path), speedup_ratio=speedup,
                        block_size=16, num_blocks=4096, max_num_seqs=64,
                        max_num_batched_tokens=2048)  # fmt: skip


def _static(path: Path, times: list[float], n: int = 1, osl: int = 3, speedup: float = 1.0):  # type: ignore[no-untyped-def]
    sim = FleetSimulation(_mocker(path, speedup), isl=100, osl=osl, startup_s=1.0, planner=None,
                          num_static=n)  # fmt: skip
    return sim.run(times)


def test_one_worker_spaced_arrivals_have_exact_ttft_itl_and_worker_seconds(
    flat_profile: Path,
) -> None:
    res = _static(flat_profile, [0.0, 1.0])
    reqs = sorted(res.requests, key=lambda r: r.arrival_s)
    # a prefill step (100 ms) gives the first token, two decode steps (10 ms) the rest
    assert [(r.first_s, r.last_s, r.num_tokens) for r in reqs] == [
        (pytest.approx(0.1), pytest.approx(0.12), 3),
        (pytest.approx(1.1), pytest.approx(1.12), 3),
    ]
    assert res.end_s == pytest.approx(1.12)
    assert res.worker_seconds == pytest.approx(1.12)  # one worker from 0 to the last token


def test_one_worker_queues_the_second_request_behind_the_running_step(flat_profile: Path) -> None:
    res = _static(flat_profile, [0.0, 0.05])
    first, second = sorted(res.requests, key=lambda r: r.arrival_s)
    # the second waits for the first's prefill step (ends 0.1), then prefills in a mixed step
    # beside the first's decode: 100 + 10 ms, ending 0.21; then one 10 ms decode step each
    assert second.first_s - second.arrival_s == pytest.approx(0.16)
    assert first.last_s == pytest.approx(0.22)
    assert second.last_s == pytest.approx(0.23)
    assert res.end_s == pytest.approx(0.23)


def test_speedup_divides_every_time(flat_profile: Path) -> None:
    res = _static(flat_profile, [0.0, 1.0], speedup=2.0)
    assert sorted(r.first_s for r in res.requests) == [pytest.approx(0.05), pytest.approx(1.05)]
    assert res.end_s == pytest.approx(1.06)


def test_static_fleet_worker_seconds_are_measured_to_the_last_answer(flat_profile: Path) -> None:
    # two workers, round robin: each takes one request; the run ends at the last token (0.62)
    res = _static(flat_profile, [0.0, 0.5], n=2)
    assert res.end_s == pytest.approx(0.62)
    assert res.worker_seconds == pytest.approx(2 * 0.62)
    assert sorted(r.first_s - r.arrival_s for r in res.requests) == [
        pytest.approx(0.1), pytest.approx(0.1)]  # fmt: skip


def test_simulation_without_planner_or_static_workers_is_refused(flat_profile: Path) -> None:
    with pytest.raises(ValueError, match="num_static=0"):
        FleetSimulation(_mocker(flat_profile), isl=1, osl=1, startup_s=1.0, planner=None)


def test_time_at_cap_sums_the_steps_held_at_the_cap() -> None:
    timeline = [(0.0, 1), (2.0, 3), (5.0, 4), (6.0, 2)]
    assert time_at_cap(timeline, 3, 10.0) == pytest.approx(4.0)
    assert time_at_cap(timeline, 4, 10.0) == pytest.approx(1.0)
    assert time_at_cap(timeline, 5, 10.0) == 0.0
    assert time_at_cap([(0.0, 2)], 2, 7.5) == pytest.approx(7.5)


def _cfg(path: Path, *extra: str) -> tuple[BenchConfig, list[float], Path]:
    args = bench.build_parser().parse_args(
        [
            "--profile",
            str(path),
            "--sim-only",
            "--duration-s",
            "20",
            "--peak-workers",
            "3",
            "--isl",
            "100",
            "--osl",
            "8",
            "--ttft-slo-ms",
            "500",
            "--itl-slo-ms",
            "100",
            "--out",
            str(path.parent / "out"),
            *extra,
        ]
    )
    return bench.configure(args)


def test_the_slo_is_the_input_not_derived_from_the_profile(flat_profile: Path) -> None:
    cfg, _, _ = _cfg(flat_profile)
    assert (cfg.ttft_slo_ms, cfg.itl_slo_ms) == (500.0, 100.0)
    assert cfg.max_workers == 6  # default cap: twice the peak fleet
    cfg, _, _ = _cfg(flat_profile, "--max-workers", "4", "--planner-target-fraction", "0.5")
    assert (cfg.max_workers, cfg.planner_fraction) == (4, 0.5)
    assert bench.planner_config(cfg).ttft_target_ms == pytest.approx(250.0)
    defaults = bench.build_parser().parse_args([])
    assert (defaults.ttft_slo_ms, defaults.itl_slo_ms) == (
        bench.DEFAULT_TTFT_SLO_MS, bench.DEFAULT_ITL_SLO_MS)  # fmt: skip
    assert Path(defaults.profile).is_file()  # the committed native profile


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ttft-slo-ms", "0"], "expected a finite number > 0"),
        (["--itl-slo-ms", "fast"], "expected a number"),
        (["--slo-attainment", "1.5"], "expected a fraction in (0, 1]"),
        (["--runs", "planner,static-avg"], "holds planner and static-peak"),
        (["--runs", "planner,static-peak,bogus"], "subset of"),
    ],
)
def test_bad_flags_are_refused_naming_the_value(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(flags)
    assert message in " ".join(capsys.readouterr().err.split())


def test_report_measures_the_static_peak_on_the_same_arrivals_and_passes_the_planner(
    flat_profile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, times, path = _cfg(flat_profile)
    assert bench.report(cfg, times, [], path) == 0
    out = capsys.readouterr().out
    assert "PASS (sim): planner" in out
    summary = (cfg.out_dir / "summary.json").read_text()
    assert '"passed": true' in summary
    mocker = bench.mocker_config(cfg, path)
    peak = bench.sim_run("static-peak", cfg, times, mocker, startup_s=1.0)
    plan = bench.sim_run("planner", cfg, times, mocker, startup_s=1.0)
    assert len(peak.outcomes) == len(plan.outcomes) == len(times)
    # measured, not assumed: n_peak workers from 0 to the static run's own last answer
    assert peak.worker_seconds == pytest.approx(cfg.n_peak * peak.duration_s)
    assert peak.duration_s > times[-1]
    rows = {r["run"]: r for r in summarize_all([peak, plan], cfg)}
    assert rows["planner"]["ws_vs_static_peak"] == pytest.approx(
        plan.worker_seconds / peak.worker_seconds)  # fmt: skip
    assert rows["static-peak"]["slo_attainment"] >= cfg.slo_attainment


class NeverScalesUp(Planner):
    """Wrong: keeps the one worker it starts with, whatever the load."""

    def tick(self, now: float, observations: dict[str, PoolObservation]) -> list[ScaleAction]:
        super().tick(now, observations)
        return []


class ScalesDownUnderLoad(Planner):
    """Wrong: scales up as the planner does, then drains the busiest worker whenever more
    than one is ready."""

    def tick(self, now: float, observations: dict[str, PoolObservation]) -> list[ScaleAction]:
        actions = super().tick(now, observations)
        ready = observations["backend"].ready
        if len(ready) > 1 and not actions:
            busiest = max(ready, key=lambda w: w.num_inflight)
            return [ScaleAction("remove", "backend", busiest.worker_id, "wrong")]
        return actions


@pytest.mark.parametrize("wrong", [NeverScalesUp, ScalesDownUnderLoad])
def test_a_wrong_planner_decision_fails_the_verdict(flat_profile: Path, wrong: type) -> None:
    cfg, times, path = _cfg(flat_profile)
    mocker = bench.mocker_config(cfg, path)
    runs = [
        bench.sim_run("planner", cfg, times, mocker, startup_s=1.0,
                      planner_core=wrong(bench.planner_config(cfg))),
        bench.sim_run("static-peak", cfg, times, mocker, startup_s=1.0),
    ]  # fmt: skip
    rows = summarize_all(runs, cfg)
    passed, lines = verdict(rows, cfg)
    assert not passed
    assert lines[0].startswith("FAIL (sim): planner")
    planner_row = next(r for r in rows if r["run"] == "planner")
    assert planner_row["slo_attainment"] < cfg.slo_attainment


def test_verdict_names_the_cap_when_the_planner_sat_at_it() -> None:
    cfg = BenchConfig(
        duration_s=10, peak_rate=1, isl=1, osl=1, ttft_slo_ms=100, itl_slo_ms=10,
        slo_attainment=0.9, planner_fraction=0.6, worker_args=[], n_avg=1, n_peak=2,
        max_workers=2, seed=0, out_dir=Path("."), speedup=1, margin=0.7, cooldown_down_s=1,
    )  # fmt: skip
    fast = Outcome(True, 0.01, 0.001)
    runs = [
        RunResult("planner", "sim", [fast] * 10, 10.0, 15.0, [(0.0, 1), (4.0, 2)]),
        RunResult("static-peak", "sim", [fast] * 9 + [Outcome(False)], 10.0, 20.0),
    ]
    rows = summarize_all(runs, cfg)
    passed, lines = verdict(rows, cfg)
    assert passed
    assert "planner / static peak worker-s 0.75" in lines[0]
    assert "at its cap (2 workers) for 6 s of 10 s (sim)" in lines[1]
    assert rows[1]["failed"] == 1 and rows[1]["slo_attainment"] == pytest.approx(0.9)


def test_meets_slo_judges_ttft_and_mean_itl() -> None:
    assert meets_slo(Outcome(True, 0.5, 0.05), 500, 50)
    assert not meets_slo(Outcome(True, 0.501, 0.05), 500, 50)
    assert not meets_slo(Outcome(True, 0.5, 0.051), 500, 50)
    assert not meets_slo(Outcome(False, 0.1, 0.01), 500, 50)
    assert meets_slo(Outcome(True, 0.1, None), 500, 50)  # one token: no gaps


def test_a_planner_costlier_than_the_static_peak_fails_at_equal_attainment() -> None:
    cfg = BenchConfig(
        duration_s=10, peak_rate=1, isl=1, osl=1, ttft_slo_ms=100, itl_slo_ms=10,
        slo_attainment=0.9, planner_fraction=0.6, worker_args=[], n_avg=1, n_peak=2,
        max_workers=4, seed=0, out_dir=Path("."), speedup=1, margin=0.7, cooldown_down_s=1,
    )  # fmt: skip
    fast = Outcome(True, 0.01, 0.001)
    runs = [
        RunResult("planner", "live", [fast] * 10, 10.0, 25.0, [(0.0, 3)]),
        RunResult("static-peak", "live", [fast] * 10, 10.0, 20.0),
    ]
    passed, lines = verdict(summarize_all(runs, cfg), cfg)
    assert not passed
    assert lines[0].startswith("FAIL (live): planner 100.0%")
    assert "more worker-seconds than the static peak (live)" in lines[1]
