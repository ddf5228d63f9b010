"""`tandem bench kvbm` runs end to end on a tiny model (local HF dir) and reports, per tier
configuration, TTFT percentiles, recomputed prefill tokens and onboarded blocks."""

from __future__ import annotations

import json

import pytest

from tandem.bench.component.kvbm import main
from tandem.engines.native.loader import random_weights, save_hf_dir
from tandem.engines.native.model_config import ModelConfig

TINY = ModelConfig(
    name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
    num_kv_heads=2, head_dim=16, vocab_size=512, context_length=512, tie_word_embeddings=True,
)  # fmt: skip

pytestmark = pytest.mark.timeout(60)


def test_bench_kvbm_compares_three_tier_configs(tmp_path, capsys):
    save_hf_dir(TINY, random_weights(TINY), str(tmp_path / "tiny"))
    out = tmp_path / "kvbm.json"
    argv = ["--model", str(tmp_path / "tiny"), "--num-threads", "1", "--block-size", "4",
            "--conversations", "4", "--turns", "3", "--user-tokens", "12", "--output-tokens", "4",
            "--host-ratio", "0.25", "--disk-dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    g1, g2, g3 = result["configs"]
    assert [c["name"] for c in (g1, g2, g3)] == ["G1", "G1+G2", "G1+G2+G3"]
    assert result["working_set_blocks"] >= 4 * result["g1_blocks"] - 4
    assert g1["prompt_tokens"] == g2["prompt_tokens"] == g3["prompt_tokens"]  # same outputs
    assert g1["onboarded_host_blocks"] == 0 and g2["onboarded_host_blocks"] > 0
    assert g3["onboarded_disk_blocks"] > 0
    assert g2["recomputed_tokens"] < g1["recomputed_tokens"]
    assert g3["recomputed_tokens"] < g1["recomputed_tokens"]
    assert all(c["ttft_p99_ms"] >= c["ttft_p50_ms"] > 0 for c in (g1, g2, g3))
    printed = capsys.readouterr().out
    assert "G1+G2+G3" in printed and "recomputed" in printed
