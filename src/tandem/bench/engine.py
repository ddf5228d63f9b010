"""`tandem bench engine`: the native engine against HF transformers on the same weights.

Prints, in one run on the same model, dtype and thread count: prefill tokens/s at
--prompt-len tokens; decode tokens/s (aggregate) at each --concurrency; the same for HF
transformers `generate`; the weight-streaming bound (weight bytes / measured memcpy GB/s)
and how far the native batch-1 step is from it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.loader import load_model_weights
from tandem.engines.native.model import LlamaModel
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem bench engine", description=__doc__)
    p.add_argument("--model", default=None, help="a .gguf or HF dir (default: SmolLM2 GGUF)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=512, help="prefill benchmark length")
    p.add_argument("--decode-prompt-len", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens timed per sequence")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--repeats", type=int, default=3, help="timed repeats (median prefill, best decode)"
    )
    p.add_argument("--skip-hf", action="store_true", help="do not run the HF baseline")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p.parse_args(argv)


def memcpy_gbps(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Memory traffic of a large tensor copy, counted as STREAM does (bytes read + bytes
    written per second; best of `repeats`, after a first copy that faults the pages in)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return float(2 * num_bytes / best / 1e9)


def matvec_gbps(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Weight bytes read per second by a large fp32 mat-vec (what a batch-1 step does)."""
    rows = num_bytes // 4 // 4096
    matrix = torch.ones(rows, 4096)
    vec = torch.ones(4096)
    torch.mv(matrix, vec)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(matrix, vec)
        best = min(best, time.perf_counter() - start)
    return float(rows * 4096 * 4 / best / 1e9)


def _prompt(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """Random ids clear of the special tokens at the start of the vocabulary."""
    low = min(100, vocab_size // 2)
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def _request(rid: str, prompt: list[int], max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="bench",
        token_ids=prompt,
        sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


def native_prefill(core: EngineCore, args: argparse.Namespace, rng: random.Random) -> float:
    times = []
    for i in range(args.repeats + 1):
        core.add(_request(f"p{i}", _prompt(rng, args.prompt_len, args.vocab_size), 1))
        start = time.perf_counter()
        while core.has_work():
            core.step()
        times.append(time.perf_counter() - start)
    return float(args.prompt_len / statistics.median(times[1:]))  # the first warms up


def native_decode(core: EngineCore, n: int, args: argparse.Namespace, rng: random.Random) -> float:
    """Aggregate decode tokens/s of n sequences, prefill excluded: the fastest of
    --repeats windows of --decode-tokens steps (a shared machine only ever slows us)."""
    max_tokens = args.decode_tokens * args.repeats + 3
    for i in range(n):
        core.add(
            _request(f"d{n}-{i}", _prompt(rng, args.decode_prompt_len, args.vocab_size), max_tokens)
        )
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in core.seqs.values()):
        core.step()
    core.step()  # warm-up decode step
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.decode_tokens):
            core.step()
        best = min(best, time.perf_counter() - start)
    for rid in list(core.seqs):
        core.abort(rid)
    core.step()
    return float(n * args.decode_tokens / best)


def hf_model(config: Any, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = {k: v for k, v in config.to_hf().items() if k != "architectures"}
    model: Any = LlamaForCausalLM(LlamaConfig(**hf_config))
    model = model.to(dtype).eval()
    state = dict(weights)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=False)
    return model


@torch.inference_mode()
def hf_prefill(model: Any, args: argparse.Namespace, rng: random.Random) -> float:
    times = []
    for _ in range(args.repeats + 1):
        ids = torch.tensor([_prompt(rng, args.prompt_len, args.vocab_size)])
        start = time.perf_counter()
        model(ids)
        times.append(time.perf_counter() - start)
    return float(args.prompt_len / statistics.median(times[1:]))


@torch.inference_mode()
def hf_decode(model: Any, n: int, args: argparse.Namespace, rng: random.Random) -> float:
    """Aggregate decode tokens/s of `generate` at batch n: time(1+T tokens) - time(1 token)."""
    ids = torch.tensor([_prompt(rng, args.decode_prompt_len, args.vocab_size) for _ in range(n)])
    mask = torch.ones_like(ids)

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start

    timed(2)  # warm-up
    first = min(timed(1) for _ in range(args.repeats))
    decode_s = min(timed(1 + args.decode_tokens) for _ in range(args.repeats)) - first
    return float(n * args.decode_tokens / decode_s)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    _, config, weights = load_model_weights(args.model)
    args.vocab_size = config.vocab_size
    model = LlamaModel(config, weights, dtype=dtype, max_positions=4096)
    max_seqs = max(args.concurrency)
    core = EngineCore(
        NativeConfig(
            dtype=args.dtype,
            num_blocks=max(2048, max_seqs * 16),
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(args.prompt_len, 2048),
            enable_prefix_caching=False,
        ),
        model,
    )
    rng = random.Random(0)
    gbps, mv_gbps = memcpy_gbps(), matvec_gbps()
    result: dict[str, Any] = {
        "model": config.name,
        "dtype": args.dtype,
        "threads": args.num_threads,
        "weight_bytes": model.weight_bytes(),
        "memcpy_gbps": gbps,
        "bound_step_ms": model.weight_bytes() / (gbps * 1e9) * 1e3,
        "matvec_gbps": mv_gbps,
        "matvec_bound_step_ms": model.weight_bytes() / (mv_gbps * 1e9) * 1e3,
        "native": {"prefill_tok_s": native_prefill(core, args, rng)},
    }
    for n in args.concurrency:
        result["native"][f"decode_tok_s@{n}"] = native_decode(core, n, args, rng)
    if not args.skip_hf:
        hf = hf_model(config, weights, dtype)
        result["hf"] = {"prefill_tok_s": hf_prefill(hf, args, rng)}
        for n in args.concurrency:
            result["hf"][f"decode_tok_s@{n}"] = hf_decode(hf, n, args, rng)
    return result


def format_result(r: dict[str, Any]) -> str:
    lines = [
        f"model {r['model']}  dtype {r['dtype']}  threads {r['threads']}",
        f"weights {r['weight_bytes'] / 1e6:.0f} MB  memcpy {r['memcpy_gbps']:.1f} GB/s  "
        f"weight-streaming bound {r['bound_step_ms']:.1f} ms/step",
        f"mat-vec read {r['matvec_gbps']:.1f} GB/s: bound {r['matvec_bound_step_ms']:.1f} ms/step",
        f"{'':10}{'prefill tok/s':>15}"
        + "".join(f"{'decode@' + k.split('@')[1]:>13}" for k in r["native"] if "@" in k),
    ]
    for name in ("native", "hf"):
        if name in r:
            row = r[name]
            lines.append(
                f"{name:10}{row['prefill_tok_s']:>15.0f}"
                + "".join(f"{v:>13.1f}" for k, v in row.items() if "@" in k)
            )
    native = r["native"]
    if "decode_tok_s@1" in native:
        step_ms = 1e3 / native["decode_tok_s@1"]
        lines.append(
            f"native batch-1 step {step_ms:.1f} ms = {step_ms / r['bound_step_ms']:.2f}x the "
            f"memcpy bound, {step_ms / r['matvec_bound_step_ms']:.2f}x the mat-vec bound"
        )
        if "hf" in r:
            ratio = native["decode_tok_s@1"] / r["hf"]["decode_tok_s@1"]
            lines.append(f"native/hf batch-1 decode {ratio:.2f}x")
        top = max((k for k in native if "@" in k), key=lambda k: int(k.split("@")[1]))
        lines.append(f"native {top} / own batch-1: {native[top] / native['decode_tok_s@1']:.1f}x")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    result = run(args)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
