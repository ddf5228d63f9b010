"""`tandem bench engine` runs end to end (tiny model from a local HF dir) and reports every
figure it promises."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.bench.engine import main
from tandem.engines.native.loader import random_weights, save_hf_dir
from tandem.engines.native.model_config import ModelConfig

TINY = ModelConfig(
    name="tiny",
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=256,
    context_length=512,
    tie_word_embeddings=True,
)

pytestmark = pytest.mark.timeout(60)


def test_bench_engine_reports_every_format_hf_and_bounds(tmp_path, capsys):
    save_hf_dir(TINY, random_weights(TINY), str(tmp_path / "tiny"))
    out_json = tmp_path / "r.json"
    argv = [
        "--model",
        str(tmp_path / "tiny"),
        "--prompt-len",
        "32",
        "--decode-prompt-len",
        "8",
        "--decode-tokens",
        "3",
        "--concurrency",
        "1",
        "4",
        "--repeats",
        "1",
        "--num-threads",
        "1",
        "--device",
        "cpu",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "memcpy bound" in text
    assert "native-int4 / hf: prefill" in text and "native-int4 / native-fp32: prefill" in text
    assert "decode@4" in text.split("native-int4 / native-fp32:")[1]
    result = json.loads(out_json.read_text())
    assert result["device"] == "cpu" and "device cpu" in text
    natives = ("native-fp32", "native-int8", "native-int4")
    assert set(result["engines"]) == {*natives, "hf"}
    for row in result["engines"].values():
        assert set(row) == {"prefill_tok_s", "decode_tok_s@1", "decode_tok_s@4"}
        assert all(v > 0 for v in row.values())
    weights = result["weight_bytes"]
    assert weights["native-int4"] < weights["native-int8"] < weights["native-fp32"]
    assert all(result["bound_step_ms"][n] > 0 for n in natives)


def test_bench_engine_refuses_a_device_it_cannot_use():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match=r"device='cuda' but torch\.cuda\.is_available"):
        main(["--device", "cuda", "--skip-hf"])
    with pytest.raises(SystemExit, match="device='tpu'; expected one of"):
        main(["--device", "tpu", "--skip-hf"])
