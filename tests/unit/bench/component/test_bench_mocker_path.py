"""`tandem bench mocker-path` runs the mocker's request path in process and reports CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench.component import mocker_path


@pytest.mark.timeout(60)
def test_reports_cpu_per_request_for_each_isl(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--isl", "64,200", "--num-requests", "4", "--concurrency", "2", "--repeat", "1"]
    assert mocker_path.main([*argv, "--kv-events-token-ids", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["isl"] for r in results] == [64, 200]
    assert all(r["cpu_ms_per_request"] > 0 for r in results)


def test_rejects_a_zero_count() -> None:
    with pytest.raises(SystemExit):
        mocker_path.main(["--num-requests", "0"])
