from __future__ import annotations

from pathlib import Path

import pytest

from tandem.engines.mocker import perf_model
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.profile import ProfileFile
from tandem.planner.profiler import profile_engine

pytestmark = pytest.mark.timeout(60)


async def test_profiling_the_mocker_measures_its_perf_model(tmp_path: Path) -> None:
    engine = MockerEngine(MockerConfig(tokenizer=None, block_size=16, num_blocks=4096))
    profile = await profile_engine(
        engine, engine_name="mocker", isls=[128, 2048], batches=[1, 16], contexts=[64, 512],
        decode_steps=4, repeats=1,
    )  # fmt: skip
    # a step never ends before its simulated time (sleeping longer is the only error)
    for isl, ms in zip(profile.prefill.isl, profile.prefill.ttft_ms, strict=True):
        assert ms >= perf_model.prefill_ms(isl) * 0.99
    assert profile.prefill.ttft_ms[1] > profile.prefill.ttft_ms[0]
    assert all(ms >= perf_model.MIN_DECODE_MS for row in profile.decode.itl_ms for ms in row)
    assert profile.block_size == 16 and profile.num_total_blocks == 4096
    ProfileFile(tmp_path / "p.json").write(profile)  # the mocker can run from it
    sched = MockerEngine(MockerConfig(tokenizer=None, perf_profile=str(tmp_path / "p.json")))
    assert sched.scheduler.perf.step_ms(2048, 0, 0, 0.0) == pytest.approx(profile.ttft_ms(2048))


async def test_a_grid_point_that_cannot_fit_is_an_error_naming_it() -> None:
    engine = MockerEngine(MockerConfig(tokenizer=None, block_size=16, num_blocks=64))
    with pytest.raises(
        ValueError, match="batch 16 × context 64 needs ~1440 KV tokens; the engine holds 1024"
    ):
        await profile_engine(engine, engine_name="mocker", isls=[16, 32], batches=[1, 16],
                             contexts=[64, 512])  # fmt: skip
