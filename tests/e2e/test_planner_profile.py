"""`tandem profile` as a real process: on the native engine (a small grid, bounded time) and
on vLLM, launched from this venv so that it re-executes into .venv-vllm as `tandem serve`
does (marker `vllm`; skipped while .venv-vllm is not built). Each writes a profile the
planner and the mocker read back, with every point measured (> 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.vllm_env import ENGINE_FLAGS, ENV

from tandem.engines.mocker.perf_model import make_perf_model
from tandem.engines.profile import EngineProfile, load_profile

REPO = Path(__file__).resolve().parents[2]
GRID = ["--isl", "16,48", "--batch", "1,2", "--context", "16,48", "--decode-steps", "2",
        "--repeats", "1"]  # fmt: skip


def _profile(args: list[str], out: Path, timeout_s: float, env: dict[str, str]) -> EngineProfile:
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "profile", *args, *GRID, "--output", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"wrote {out}: prefill 2 points, decode 2x2 points" in proc.stdout
    profile = load_profile(out)
    assert profile.prefill.isl == [16, 48] and len(profile.decode.itl_ms) == 2
    assert all(v > 0 for v in profile.prefill.ttft_ms)
    assert all(v > 0 for row in profile.decode.itl_ms for v in row)
    make_perf_model(str(out))  # the mocker replays it
    return profile


@pytest.mark.e2e
@pytest.mark.native
@pytest.mark.timeout(180)
def test_profile_measures_the_native_engine(tmp_path: Path) -> None:
    profile = _profile(["--engine", "native", "--num-blocks", "64"], tmp_path / "native.json",
                       150, {})  # fmt: skip
    assert profile.engine == "native" and profile.model == "smollm2"
    assert profile.num_total_blocks == 64


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_profile_reexecutes_into_the_vllm_venv_and_measures_vllm(
    tmp_path: Path, vllm_hf_dir: Path
) -> None:
    hf_dir = vllm_hf_dir  # converted once per session (tests/conftest.py)
    assert "vllm" not in sys.modules  # launched from this venv: the child must re-execute
    profile = _profile(["--engine", "vllm", "--model", str(hf_dir), *ENGINE_FLAGS],
                       tmp_path / "vllm.json", 540, ENV)  # fmt: skip
    assert profile.engine == "vllm"
