from __future__ import annotations

import gc
import json

import pytest

from tandem.bench.component.indexer import build_ops, load_chains, main

pytestmark = pytest.mark.timeout(20)


def test_chains_share_prefixes_and_lru_evicts(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": ids}
        for ids in ([1, 2, 3], [1, 2, 4], [9])
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    chains = load_chains(trace, sub_blocks=2, limit=None)
    assert chains[0][:4] == chains[1][:4] and chains[0][4] != chains[1][4]
    ops = build_ops(chains, num_workers=1, capacity=6)
    stored = [h for is_store, _, hs in ops if is_store for h in hs]
    removed = [h for is_store, _, hs in ops if not is_store for h in hs]
    assert len(stored) == 6 + 2 + 2  # second request reuses 4 blocks
    assert len(stored) - len(removed) == 6  # capacity respected
    assert main(["--trace", str(trace), "--workers", "1,2", "--json"]) == 0


def test_gc_frozen_restores_the_collector(tmp_path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"hash_ids": [1, 2, 3]}) + "\n" + json.dumps({"hash_ids": [1]}))
    assert main(["--trace", str(trace), "--workers", "2", "--gc", "frozen", "--json"]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    out = capsys.readouterr().out
    assert "gc frozen" in out
    (row,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert row["workers"] == 2 and row["block_ops"] == (3 + 1) * 4  # 4 sub-blocks each
