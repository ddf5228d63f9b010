"""`tandem bench engine` runs end to end (tiny model from a local HF dir) and reports every
figure it promises: every rate measured and positive, or reported unavailable."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import pytest
import torch

from tandem.bench.component.engine import (
    Baseline,
    HfBaseline,
    decode_figures,
    format_result,
    hf_model,
    main,
)
from tandem.bench.component.llamacpp import INSTALL_HINT, LlamaCppRunner
from tandem.cbuild import select_isa
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
    isa, why = select_isa()  # the kernels' build and why, as the engine logs it
    assert result["kernels"] == f"{isa} build, {why}" and f"native kernels: the {isa} build" in text
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


def test_hf_decode_window_times_the_decode_steps_only():
    """A stall outside the decode steps (the prefill, or a neighbour slowing it) never enters
    HF's window: it was once generate(1 + T) - generate(1), nan whenever the 1-token run was
    slowed more than the full one. The steps fed are generate's greedy tokens."""
    model = hf_model(TINY, random_weights(TINY), torch.float32)
    ids = [[5, 17, 99, 130, 42, 7, 64, 200]] * 2
    real = model.forward
    fed: list[list[int]] = []
    prefills = []

    def forward(*args, **kwargs):
        input_ids = kwargs["input_ids"]
        if input_ids.shape[1] > 1:
            prefills.append(1)
            if len(prefills) == 1:
                time.sleep(0.5)  # a stall in the first prefill only
        else:
            fed.append(input_ids[:, 0].tolist())
        return real(*args, **kwargs)

    model.forward = forward
    window = HfBaseline(model).decode_window_s(ids, 3)
    assert 0 < window < 0.5
    assert len(prefills) == 1 and len(fed) == 3
    model.forward = real
    out = model.generate(
        input_ids=torch.tensor(ids), max_new_tokens=4, do_sample=False, pad_token_id=0
    )
    assert [list(step) for step in zip(*out[:, 8:11].tolist(), strict=True)] == fed


class _OneSequence(Baseline):
    """A baseline that decodes one sequence only (as llama.cpp here), or gives `window`."""

    def __init__(self, window: float | None = 0.01) -> None:
        self.window = window

    def decode_window_s(self, ids: list[list[int]], new_tokens: int) -> float | None:
        return None if len(ids) > 1 else self.window


def test_an_engine_that_cannot_run_a_batch_is_reported_unavailable_never_nan(tmp_path):
    args = argparse.Namespace(decode_prompt_len=4, vocab_size=256, repeats=2, decode_tokens=3)
    rng = random.Random(0)
    assert decode_figures({}, {"one": _OneSequence()}, 1, args, rng) == {"one": 300.0}
    assert decode_figures({}, {"one": _OneSequence()}, 4, args, rng) == {"one": None}
    for bad in (float("nan"), 0.0, -0.002):
        with pytest.raises(RuntimeError, match=r"one: a decode window took .* expected a positive"):
            decode_figures({}, {"one": _OneSequence(bad)}, 1, args, rng)
    row = {"prefill_tok_s": 900.0, "decode_tok_s@1": 300.0, "decode_tok_s@4": None}
    result = {
        "model": "tiny", "dtype": "float32", "threads": 1, "memcpy_gbps": 10.0,
        "matvec_gbps": 8.0, "weight_bytes": {"native-int4": 1000},
        "bound_step_ms": {"native-int4": 1e-4},
        "engines": {"native-int4": {**row, "decode_tok_s@4": 1200.0}, "llama.cpp": row},
    }  # fmt: skip
    text = format_result(result)
    assert "n/a" in text.splitlines()[3] and "decode@4" not in text.split("/ llama.cpp:")[1]
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert (
        json.loads((tmp_path / "r.json").read_text())["engines"]["llama.cpp"]["decode_tok_s@4"]
        is None
    )


def test_llamacpp_without_llama_cpp_python_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match="pip install llama-cpp-python") as exc:
        LlamaCppRunner("model.gguf", threads=1, max_seqs=4, seq_len=64)
    assert str(exc.value) == INSTALL_HINT


def test_bench_engine_speculation_reports_both_modes_on_both_workloads(
    tmp_path, capsys, monkeypatch
):
    """--spec-tokens: plain vs speculative batch-1 decode on the quote and chat workloads,
    at each draft length policy: speed-up, acceptance, tokens per step and token identity (a
    tiny random model: the figures' plumbing; SmolLM2's own are in the README)."""
    from tandem.bench.component import engine_spec

    save_hf_dir(TINY, random_weights(TINY), str(tmp_path / "tiny"))
    monkeypatch.setattr(engine_spec, "load_tokenizer", lambda source: None)
    monkeypatch.setattr(  # the tiny model has no tokenizer: prompts that repeat themselves
        engine_spec, "chat_prompts", lambda tok, tasks: [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    )
    out_json = tmp_path / "r.json"
    argv = ["--model", str(tmp_path / "tiny"), "--weights", "fp32", "int4", "--repeats", "1"]
    argv += ["--num-threads", "1", "--spec-tokens", "3", "--spec-max-tokens", "12"]
    assert main([*argv, "--spec-only", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "speculation: prompt lookup, k=3, n-gram 2..4" in text
    result = json.loads(out_json.read_text())
    for fmt in ("fp32", "int4"):
        for workload in ("quote", "chat"):
            w = result["speculation"][fmt][workload]
            assert w["plain_tok_s"] > 0 and set(w["lengths"]) == {"adaptive", "fixed"}
            for length, f in w["lengths"].items():
                assert f["identical"] and f["spec_tok_s"] > 0 and f["tokens_per_step"] >= 1
                assert f"native-{fmt} {workload} {length}" in text
    assert "quote 1" not in result["speculation"]["int4"]  # per prompt only when asked
    batch = result["speculation"]["int4"]["mixed x32"]  # --spec-batch's default
    assert batch["tokens"] > 0 and all(f["identical"] for f in batch["lengths"].values())
    argv_fixed = [*argv, "--spec-only", "--spec-length", "fixed", "--spec-per-prompt"]
    assert main([*argv_fixed, "--spec-batch", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    only = json.loads(out_json.read_text())["speculation"]["int4"]
    assert list(only) == ["quote", "quote 1", "chat", "chat 1"]  # no batch: --spec-batch none
    assert list(only["quote"]["lengths"]) == ["fixed"] and "native-int4 quote 1 fixed" in text
    # one prompt a workload: its own figures are the workload's
    assert only["quote 1"] == only["quote"]
    with pytest.raises(SystemExit, match="--spec-batch 1: batch 1 is always measured"):
        main([*argv, "--spec-only", "--spec-batch", "8", "1"])
    with pytest.raises(SystemExit, match="--spec-tokens=-1; expected 0"):
        main([*argv[:-4], "--spec-tokens", "-1"])
    with pytest.raises(SystemExit, match="spec_ngram_max=1 out of range"):
        main([*argv, "--spec-only", "--spec-ngram-max", "1"])


def test_bench_engine_gemm_only_reports_each_projection_and_the_issue_ceilings(tmp_path, capsys):
    """--gemm-only: every projection of the model, in every format asked for, at every row
    count, by wall time and per core; one core's issue ceilings where the build has them
    (the AVX2 one: fp32 FMA and both integer steps); no engine runs."""
    save_hf_dir(TINY, random_weights(TINY), str(tmp_path / "tiny"))
    out_json = tmp_path / "g.json"
    argv = ["--model", str(tmp_path / "tiny"), "--gemm-only", "--gemm-rows", "1", "8"]
    argv += ["--weights", "fp32", "int4", "--repeats", "1", "--num-threads", "1"]
    assert main([*argv, "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert "engines" not in result and "GEMM alone on 1 thread(s)" in text
    shapes = {"qkv": [128, 64], "o": [64, 64], "gate_up": [256, 64], "down": [64, 128]}
    assert result["gemm_shapes"] == {**shapes, "head": [256, 64]}
    for key in ("gemm_gmacs", "gemm_core_gmacs"):
        assert set(result[key]) == {"fp32", "int4"}
        for per in result[key].values():
            assert set(per) == {*shapes, "head"}
            assert all(set(rows) == {"1", "8"} and min(rows.values()) > 0 for rows in per.values())
    ceilings = result["issue_gmacs"]
    if select_isa()[0] == "avx2":
        assert len(ceilings) == 3 and min(ceilings.values()) > 0 and "issue ceiling" in text
    with pytest.raises(SystemExit):
        main([*argv, "--gemm-rows", "0"])
    assert "--gemm-rows must be >= 1" in capsys.readouterr().err
