from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tandem.bench.trace import BlockTokens, TraceConfig, trace_requests
from tandem.bench.workload import FIRST_PLAIN_TOKEN_ID


def _write(tmp_path, records):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    return path


def test_same_hash_id_gives_same_block_across_requests(tmp_path):
    path = _write(
        tmp_path,
        [
            {"timestamp": 0, "input_length": 20, "output_length": 3, "hash_ids": [7, 8, 9]},
            {"timestamp": 500, "input_length": 16, "output_length": 5, "hash_ids": [7, 8, 4]},
            {"timestamp": 1500, "input_length": 10, "output_length": 1, "hash_ids": [4, 1]},
        ],
    )
    specs = trace_requests(path, TraceConfig(block_size=8, vocab_size=500))
    a, b, c = (s.prompt_token_ids() for s in specs)
    assert (len(a), len(b), len(c)) == (20, 16, 10)  # trimmed to input_length
    assert a[:16] == b[:16]  # blocks 7, 8 shared
    assert b[16:] == [] and c[:8] == BlockTokens(8, 500).block(4)
    assert a[16:20] == BlockTokens(8, 500).block(9)[:4]
    assert a[:8] != a[8:16]  # different ids → different blocks
    assert all(FIRST_PLAIN_TOKEN_ID <= t < 500 for t in a + b + c)
    assert [s.max_tokens for s in specs] == [3, 5, 1]
    assert all(s.ignore_eos for s in specs)
    assert [s.send_at_s for s in specs] == [0.0, 0.5, 1.5]


def test_blocks_depend_only_on_id_and_seed():
    assert BlockTokens(16, 1000).block(42) == BlockTokens(16, 1000).block(42)
    assert BlockTokens(16, 1000).block(42) != BlockTokens(16, 1000).block(43)
    assert BlockTokens(16, 1000, seed=1).block(42) != BlockTokens(16, 1000).block(42)


def test_speedup_max_requests_padding_and_clipping(tmp_path):
    path = _write(
        tmp_path,
        [
            {"timestamp": 1000, "input_length": 30, "output_length": 2, "hash_ids": [1]},
            {"timestamp": 2000, "input_length": 30, "output_length": 2, "hash_ids": [1]},
            {"timestamp": 3000, "input_length": 4, "output_length": 2, "hash_ids": [1]},
        ],
    )
    specs = trace_requests(
        path, TraceConfig(block_size=8, vocab_size=500, speedup=4.0, max_requests=2)
    )
    assert [s.send_at_s for s in specs] == [0.25, 0.5]
    a, b = (s.prompt_token_ids() for s in specs)
    assert len(a) == len(b) == 30 and a[:8] == b[:8]
    assert a[8:] != b[8:]  # padding beyond the hash blocks is unique per request
    clipped = trace_requests(path, TraceConfig(block_size=8, vocab_size=500, max_input_length=5))
    assert [len(s.prompt_token_ids()) for s in clipped] == [5, 5, 4]
    assert [s.input_length for s in clipped] == [5, 5, 4]


def test_bad_record_names_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:2"):
        trace_requests(path, TraceConfig(block_size=4))


SHARED_TRACE = str(
    Path(__file__).resolve().parents[3].parent / "shared/data/mooncake_synthetic_trace.jsonl"
)


@pytest.mark.skipif(not os.path.exists(SHARED_TRACE), reason="shared trace not present")
def test_shared_trace_prompts_follow_hash_ids():
    specs = trace_requests(SHARED_TRACE, TraceConfig(max_requests=300))
    with open(SHARED_TRACE) as f:
        records = [json.loads(line) for _, line in zip(range(300), f, strict=False)]
    first_ids = []
    for spec, record in zip(specs, records, strict=True):
        assert spec.input_length == record["input_length"]
        assert spec.max_tokens == record["output_length"]
        first_ids.append(record["hash_ids"][0])
    assert len(set(first_ids)) < len(first_ids), "the trace should reuse some first blocks"
    blocks = BlockTokens(512, 49152)
    for spec, record in list(zip(specs, records, strict=True))[:50]:
        ids = spec.prompt_token_ids()
        assert len(ids) == record["input_length"]
        assert ids[:512] == blocks.block(record["hash_ids"][0])[: len(ids[:512])]
