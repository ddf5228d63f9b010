"""`tandem bench engine`: the native engine against HF transformers on the same weights.

Prints, in one run on the same model, dtype and thread count: prefill tokens/s at
--prompt-len tokens; decode tokens/s (aggregate) at each --concurrency; the same for HF
transformers `generate`; the weight-streaming bound (weight bytes / measured memcpy GB/s)
and how far the native batch-1 step is from it. Native and HF repeats alternate, so on a
shared machine both engines meet the same background load.
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


class NativeBench:
    """Timed windows of the native engine; each call is one repeat (callers interleave)."""

    def __init__(self, core: EngineCore, args: argparse.Namespace, rng: random.Random) -> None:
        self.core, self.args, self.rng = core, args, rng
        self.threads_used: dict[int, int] = {}  # decode steps per thread count, this n

    def prefill_s(self, rid: str) -> float:
        a = self.args
        self.core.add(_request(rid, _prompt(self.rng, a.prompt_len, a.vocab_size), 1))
        start = time.perf_counter()
        while self.core.has_work():
            self.core.step()
        return time.perf_counter() - start

    def start_decode(self, n: int) -> None:
        """Admit n sequences, finish their prefill and one warm-up decode step."""
        a = self.args
        max_tokens = a.decode_tokens * a.repeats + 3
        for i in range(n):
            prompt = _prompt(self.rng, a.decode_prompt_len, a.vocab_size)
            self.core.add(_request(f"d{n}-{i}", prompt, max_tokens))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in self.core.seqs.values()):
            self.core.step()
        self.core.step()

    def decode_window_s(self) -> float:
        """Seconds for --decode-tokens steps; counts their steps by intra-op thread count
        (the engine picks per step: tandem.engines.native.thread_policy)."""
        self.core.runner.steps_by_threads.clear()
        start = time.perf_counter()
        for _ in range(self.args.decode_tokens):
            self.core.step()
        elapsed = time.perf_counter() - start
        for threads, steps in self.core.runner.steps_by_threads.items():
            self.threads_used[threads] = self.threads_used.get(threads, 0) + steps
        return elapsed

    def stop_decode(self) -> None:
        for rid in list(self.core.seqs):
            self.core.abort(rid)
        self.core.step()


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
def hf_prefill_s(model: Any, args: argparse.Namespace, rng: random.Random) -> float:
    ids = torch.tensor([_prompt(rng, args.prompt_len, args.vocab_size)])
    start = time.perf_counter()
    model(ids)
    return time.perf_counter() - start


@torch.inference_mode()
def hf_generate_s(model: Any, ids: torch.Tensor, new_tokens: int) -> float:
    """Wall time of `generate` producing exactly new_tokens greedy tokens for the batch."""
    start = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return time.perf_counter() - start


def prefill_figures(
    native: NativeBench, hf: Any, args: argparse.Namespace, rng: random.Random
) -> tuple[float, float | None]:
    """Median prefill tokens/s of each engine, repeats interleaved (first ones warm up)."""
    native_s: list[float] = []
    hf_s: list[float] = []
    for i in range(args.repeats + 1):
        native_s.append(native.prefill_s(f"p{i}"))
        if hf is not None:
            hf_s.append(hf_prefill_s(hf, args, rng))
    hf_tok_s = args.prompt_len / statistics.median(hf_s[1:]) if hf is not None else None
    return args.prompt_len / statistics.median(native_s[1:]), hf_tok_s


def decode_figures(
    native: NativeBench, hf: Any, n: int, args: argparse.Namespace, rng: random.Random
) -> tuple[float, float | None]:
    """Aggregate decode tokens/s at n sequences, prefill excluded, for each engine: the
    fastest of --repeats windows of --decode-tokens steps (a shared machine only ever slows
    a window down), native and HF windows interleaved so both meet the same load. HF's
    window is time(generate 1 + T tokens) - time(generate 1 token)."""
    native.start_decode(n)
    native.threads_used = {}
    ids = torch.tensor([_prompt(rng, args.decode_prompt_len, args.vocab_size) for _ in range(n)])
    if hf is not None:
        hf_generate_s(hf, ids, 2)  # warm-up
    native_best = hf_first = hf_full = float("inf")
    for _ in range(args.repeats):
        native_best = min(native_best, native.decode_window_s())
        if hf is not None:
            hf_first = min(hf_first, hf_generate_s(hf, ids, 1))
            hf_full = min(hf_full, hf_generate_s(hf, ids, 1 + args.decode_tokens))
    native.stop_decode()
    tokens = n * args.decode_tokens
    if hf is None:
        return tokens / native_best, None
    # a neighbour slowing every 1-token run more than a full one leaves no valid difference
    hf_tok_s = tokens / (hf_full - hf_first) if hf_full > hf_first else float("nan")
    return tokens / native_best, hf_tok_s


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
    result: dict[str, Any] = {
        "model": config.name,
        "dtype": args.dtype,
        "threads": args.num_threads,
        "weight_bytes": model.weight_bytes(),
    }
    bandwidth = [(memcpy_gbps(), matvec_gbps())]
    hf = None if args.skip_hf else hf_model(config, weights, dtype)
    native = NativeBench(core, args, rng)
    native_prefill, hf_prefill = prefill_figures(native, hf, args, rng)
    result["native"] = {"prefill_tok_s": native_prefill}
    if hf is not None:
        result["hf"] = {"prefill_tok_s": hf_prefill}
    for n in args.concurrency:
        native_tok_s, hf_tok_s = decode_figures(native, hf, n, args, rng)
        result["native"][f"decode_tok_s@{n}"] = native_tok_s
        result.setdefault("native_decode_steps_by_threads", {})[str(n)] = native.threads_used
        if hf is not None:
            result["hf"][f"decode_tok_s@{n}"] = hf_tok_s
        bandwidth.append((memcpy_gbps(), matvec_gbps()))
    add_bounds(result, max(b[0] for b in bandwidth), max(b[1] for b in bandwidth))
    return result


def add_bounds(result: dict[str, Any], gbps: float, mv_gbps: float) -> None:
    """The weight-streaming bounds from the best bandwidths seen (measured before the runs
    and after each concurrency: a busy neighbour only ever lowers one measurement)."""
    weight_bytes = result["weight_bytes"]
    result["memcpy_gbps"] = gbps
    result["bound_step_ms"] = weight_bytes / (gbps * 1e9) * 1e3
    result["matvec_gbps"] = mv_gbps
    result["matvec_bound_step_ms"] = weight_bytes / (mv_gbps * 1e9) * 1e3


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
    used = r.get("native_decode_steps_by_threads", {})
    if used:
        lines.append(
            "native decode steps by intra-op threads: "
            + "  ".join(f"@{n} {dict(sorted(v.items()))}" for n, v in used.items())
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
