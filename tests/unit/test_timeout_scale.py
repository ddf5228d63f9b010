"""TANDEM_TEST_TIMEOUT_SCALE (tests/conftest.py): the niced half of `make test` gives every test
its timeout times the scale: marked or not, method kept, a 0 limit still none. Run as a
separate pytest over a throwaway folder whose conftest is the suite's hook."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import TIMEOUT_SCALE_ENV

ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import time

import pytest


@pytest.mark.timeout(1)
def test_marked():
    time.sleep(1.6)


@pytest.mark.timeout(timeout=1, method="signal")
def test_marked_by_keyword_with_a_method():
    time.sleep(1.6)


def test_unmarked_takes_the_ini_default():
    time.sleep(1.6)


@pytest.mark.timeout(0)
def test_no_limit_stays_none():
    time.sleep(0.1)
"""


def run_pytest(folder: Path, scale: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != TIMEOUT_SCALE_ENV}
    env["PYTHONPATH"] = str(ROOT)
    if scale is not None:
        env[TIMEOUT_SCALE_ENV] = scale
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout=1",
            "-o",
            "asyncio_default_fixture_loop_scope=function",
            "--rootdir",
            str(folder),
            str(folder),
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(240)
def test_the_scale_stretches_every_timeout_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
    )
    (tmp_path / "test_sleepy.py").write_text(TESTS)

    plain = run_pytest(tmp_path, None)
    assert "3 failed, 1 passed" in plain.stdout, plain.stdout + plain.stderr
    assert plain.stdout.count("Timeout") >= 3

    scaled = run_pytest(tmp_path, "3")
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    assert "4 passed" in scaled.stdout

    for bad in ("fast", "0.5"):
        refused = run_pytest(tmp_path, bad)
        assert refused.returncode == 4, refused.stdout + refused.stderr
        assert f"{TIMEOUT_SCALE_ENV}={bad!r}: expected a number >= 1" in refused.stderr
