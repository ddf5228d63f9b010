"""`tandem bench events` receives from a publisher process through the bus and through the
await-each baseline, and reports CPU per message and what each delivered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench.component import events


@pytest.mark.timeout(120)
def test_both_receive_paths_deliver_every_message(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--messages", "300", "--burst", "8", "--timeout-s", "30", "--json", str(out)]
    assert events.main(argv) == 0
    result = json.loads(out.read_text())
    for mode in ("await_each", "bus"):
        assert result[mode]["received"] == 300
        assert result[mode]["cpu_us_per_message"] > 0


@pytest.mark.parametrize("flag", ["--messages", "--burst", "--payload-bytes"])
def test_rejects_a_zero_count(flag: str) -> None:
    with pytest.raises(SystemExit):
        events.parse_args([flag, "0"])
