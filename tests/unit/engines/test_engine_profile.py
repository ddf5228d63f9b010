from __future__ import annotations

from pathlib import Path

import pytest

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.perf_model import ProfilePerfModel
from tandem.engines.mocker.scheduler import Scheduler
from tandem.engines.profile import (
    DecodeGrid,
    EngineProfile,
    PrefillCurve,
    ProfileFile,
    interp,
    load_profile,
)
from tandem.protocols.engine import PreprocessedRequest, StopConditions


def _profile() -> EngineProfile:
    return EngineProfile(
        engine="mocker", model="m", block_size=16, num_total_blocks=1000, max_num_seqs=8,
        max_num_batched_tokens=2048,
        prefill=PrefillCurve(isl=[100, 1000, 2000], ttft_ms=[20.0, 110.0, 300.0]),
        decode=DecodeGrid(batch=[1, 8], context=[100, 1100],
                          itl_ms=[[5.0, 7.0], [12.0, 22.0]]),
    )  # fmt: skip


def test_interp_is_linear_inside_and_extrapolates_outside() -> None:
    assert interp([0, 10], [0.0, 100.0], 5) == 50.0
    assert interp([0, 10, 20], [0.0, 100.0, 120.0], 30) == pytest.approx(140.0)
    assert interp([10, 20], [5.0, 10.0], 0) == pytest.approx(0.0)


def test_ttft_and_itl_interpolate_over_the_grid() -> None:
    p = _profile()
    assert p.ttft_ms(550) == pytest.approx(65.0)
    assert p.ttft_ms(0) == 0.0
    assert p.itl_ms(1, 600) == pytest.approx(6.0)
    assert p.itl_ms(8, 600) == pytest.approx(17.0)
    assert p.itl_ms(4.5, 600) == pytest.approx(11.5)  # bilinear


def test_file_round_trip_and_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    ProfileFile(path).write(_profile())
    assert load_profile(path) == _profile()
    path.write_text('{"version": 1, "engine": "x"}')
    with pytest.raises(ValueError, match=f"engine profile {path}"):
        load_profile(path)
    bad = tmp_path / "bad.json"
    text = (path.parent / "profile.json").read_text()
    ProfileFile(bad).write(_profile())
    bad.write_text(
        bad.read_text().replace('"isl": [\n   100,\n   1000,', '"isl": [\n   100,\n   50,')
    )
    with pytest.raises(ValueError, match="increasing"):
        load_profile(bad)
    del text


def test_mocker_steps_take_the_profiled_times(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    ProfileFile(path).write(_profile())
    sched = Scheduler(MockerConfig(block_size=16, num_blocks=1000, tokenizer=None,
                                   perf_profile=str(path)))  # fmt: skip
    assert isinstance(sched.perf, ProfilePerfModel)
    sched.add_request(PreprocessedRequest(request_id="r", model="m", token_ids=list(range(17, 567)),
                                          stop=StopConditions(max_tokens=3)))  # fmt: skip
    first = sched.step()
    assert first.duration_ms == pytest.approx(65.0)  # 550 prompt tokens
    second = sched.step()
    assert second.num_decode_kv_tokens == 551
    assert second.duration_ms == pytest.approx(_profile().itl_ms(1, 551))
