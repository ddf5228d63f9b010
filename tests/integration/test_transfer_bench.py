from __future__ import annotations

import json

import pytest

from tandem.bench.component.transfer import main

pytestmark = pytest.mark.timeout(60)


def test_bench_transfer_reports_every_backend_beside_memcpy(tmp_path, capsys) -> None:
    out = tmp_path / "transfer.json"
    argv = ["--sizes-mib", "0.25", "--iters", "1", "--blocks", "4", "--backends", "shm,tcp"]
    assert main([*argv, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures) == {"memcpy", "shm", "tcp"}
    assert all(v > 0 for row in figures.values() for v in row.values())
    assert "shm/nixl" in capsys.readouterr().out
