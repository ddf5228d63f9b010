from __future__ import annotations

import json
import sys
import types

import pytest

from tandem.cli import bench as bench_cli
from tandem.cli.main import main as tandem_main

pytestmark = pytest.mark.timeout(20)


def test_named_benchmark_dispatches_to_module_main(monkeypatch):
    seen = []
    module = types.ModuleType("tandem.bench.component.indexer")
    module.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "tandem.bench.component.indexer", module)
    assert tandem_main(["bench", "indexer", "--workers", "64"]) == 7
    assert seen == [["--workers", "64"]]


def test_unknown_benchmark_lists_the_known_ones():
    with pytest.raises(
        SystemExit, match="unknown benchmark 'idx'; expected one of: churn, disagg, engine"
    ):
        bench_cli.main(["idx"])


async def test_load_command_writes_json(fake_openai, tmp_path):
    import asyncio

    fake_openai.first_token_delay_s = fake_openai.token_gap_s = 0.0
    out = tmp_path / "out.json"
    argv = [
        "--url",
        f"http://127.0.0.1:{fake_openai.port}",
        "--num-requests",
        "5",
        "--concurrency",
        "2",
        "--isl",
        "12",
        "--json",
        str(out),
    ]
    # the command runs its own event loop: run it off this test's loop
    rc = await asyncio.to_thread(bench_cli.run_load_command, argv)
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["summary"]["num_ok"] == 5 and len(data["requests"]) == 5
    assert data["summary"]["prompt_tokens"] == 60 and data["config"]["concurrency"] == 2
    assert all(len(b["prompt"]) == 12 for b in fake_openai.bodies)
