"""`tandem bench engine`: the native engine in each weight format (fp32, int8, int4) against
HF transformers on the same weights, and llama.cpp on the same GGUF when
`llama-cpp-python` is installed (--llamacpp).

Prints, in one run on the same model and thread count: prefill tokens/s at --prompt-len
tokens; decode tokens/s (aggregate) at each --concurrency, timed over the decode steps only
(llama.cpp too: n sequences in one batch a step); the kernels' instruction-set build and
why it was chosen; the weight-streaming bound of each format (its weight bytes / measured
memcpy GB/s) and how far its batch-1 step is from it. Repeats of every engine alternate, so
on a shared machine all meet the same load.
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from tandem.bench.component.engine_gemm import format_gemm, gemm_figures, projection_shapes
from tandem.bench.component.engine_spec import add_spec_args, format_spec, spec_result
from tandem.bench.component.entry import figures_main
from tandem.bench.component.llamacpp import LlamaCppRunner
from tandem.cbuild import select_isa
from tandem.engines.native.config import (
    KV_CACHE_DTYPES,
    WEIGHT_FORMATS,
    NativeConfig,
    check_device,
)
from tandem.engines.native.engine import build_model
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.loader import default_model_path, load_model_weights
from tandem.engines.native.model_config import ModelConfig
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions

if TYPE_CHECKING:  # transformers loads only when the HF baseline runs
    from transformers import LlamaForCausalLM


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem bench engine", description=__doc__)
    p.add_argument("--model", default=None, help="a .gguf or HF dir (default: SmolLM2 GGUF)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument(
        "--device",
        default="cpu",
        help="where the native engines and HF run: cpu, cuda, cuda:N (llama.cpp: cpu only)",
    )
    p.add_argument("--prompt-len", type=int, default=512, help="prefill benchmark length")
    p.add_argument("--decode-prompt-len", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens timed per sequence")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--repeats", type=int, default=3, help="timed repeats (median prefill, best decode)"
    )
    p.add_argument(
        "--weights",
        nargs="+",
        default=["fp32", "int8", "int4"],
        choices=WEIGHT_FORMATS,
        help="native weight formats to run",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the native engines' KV cache (auto: what `tandem serve` picks for each format)",
    )
    p.add_argument("--skip-hf", action="store_true", help="do not run the HF baseline")
    p.add_argument(
        "--llamacpp", action="store_true", help="also run llama.cpp (llama-cpp-python) on the GGUF"
    )
    p.add_argument("--json", default=None, help="also write the figures to this file")
    add_spec_args(p)
    g = p.add_argument_group("the GEMM alone")
    g.add_argument(
        "--gemm-only",
        action="store_true",
        help="only each projection's GEMM in GMAC/s per weight format and row count, with one "
        "core's instruction-issue ceilings (no engine runs)",
    )
    g.add_argument(
        "--gemm-rows", type=int, nargs="+", default=[1, 32, 512], help="row counts for --gemm-only"
    )
    args = p.parse_args(argv)
    if args.gemm_only and args.device != "cpu":
        p.error(f"--gemm-only measures the CPU kernels; got --device {args.device}")
    if any(m < 1 for m in args.gemm_rows):
        p.error(f"--gemm-rows must be >= 1; got {args.gemm_rows}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1; got {args.repeats}")
    return args


def _sync(device: str) -> None:
    """Wait for the device's queued work (a CUDA step returns before it ran)."""
    if device != "cpu":
        torch.cuda.synchronize(device)


def memcpy_gbps(num_bytes: int = 256 << 20, repeats: int = 5, device: str = "cpu") -> float:
    """Memory traffic of a large tensor copy on `device`, counted as STREAM does (bytes read
    + bytes written per second; best of `repeats`, after a first copy that faults the pages
    in)."""
    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return float(2 * num_bytes / best / 1e9)


def matvec_gbps(num_bytes: int = 256 << 20, repeats: int = 5, device: str = "cpu") -> float:
    """Weight bytes read per second by a large fp32 mat-vec (what a batch-1 step does)."""
    rows = num_bytes // 4 // 4096
    matrix = torch.ones(rows, 4096, device=device)
    vec = torch.ones(4096, device=device)
    torch.mv(matrix, vec)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(matrix, vec)
        _sync(device)
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


def hf_model(
    config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype
) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = {k: v for k, v in config.to_hf().items() if k != "architectures"}
    # Any: transformers types `.to` through a wrapper that mypy reads as taking a model
    model: Any = LlamaForCausalLM(LlamaConfig(**hf_config))
    model = model.to(dtype).eval()
    state = dict(weights)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=False)
    loaded: LlamaForCausalLM = model
    return loaded


@torch.inference_mode()
def hf_prefill_s(model: LlamaForCausalLM, args: argparse.Namespace, rng: random.Random) -> float:
    ids = torch.tensor([_prompt(rng, args.prompt_len, args.vocab_size)], device=args.device)
    start = time.perf_counter()
    model(ids)
    _sync(args.device)
    return time.perf_counter() - start


@torch.inference_mode()
def hf_decode_s(model: LlamaForCausalLM, ids: torch.Tensor, new_tokens: int) -> float:
    """Seconds of `new_tokens` greedy decode steps of the batch `ids` through HF's KV cache,
    timed as the native windows are: the steps only, the prefill (and the first token it
    gives) before the clock starts. The loop is `generate`'s without its per-step logits
    processors and stopping checks, so HF's figure is, if anything, flattered."""
    # transformers 5 names the KV cache `cache` (argument and output), 4.x `past_key_values`
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else None
    name = name or "past_key_values"
    out = model(input_ids=ids, use_cache=True)
    past, token = getattr(out, name), out.logits[:, -1:].argmax(-1)
    _sync(str(ids.device))
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = model(input_ids=token, use_cache=True, **{name: past})
        past, token = getattr(out, name), out.logits[:, -1:].argmax(-1)
    _sync(str(ids.device))
    return time.perf_counter() - start


class Baseline:
    """A non-native engine timed beside the native ones (HF transformers, llama.cpp)."""

    def prefill_s(self, args: argparse.Namespace, rng: random.Random) -> float:
        raise NotImplementedError

    def decode_window_s(self, ids: list[list[int]], new_tokens: int) -> float | None:
        """Seconds of new_tokens decode steps of the batch `ids`, prefill excluded; None
        where this engine does not run such a batch (reported as unavailable)."""
        raise NotImplementedError


class HfBaseline(Baseline):
    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model

    def prefill_s(self, args: argparse.Namespace, rng: random.Random) -> float:
        return float(hf_prefill_s(self.model, args, rng))

    def decode_window_s(self, ids: list[list[int]], new_tokens: int) -> float:
        return hf_decode_s(self.model, torch.tensor(ids, device=self.model.device), new_tokens)


class LlamaCppBaseline(Baseline):
    """llama.cpp through llama-cpp-python on the same GGUF: prefill, and decode at every
    concurrency (n sequences, one token each per llama_decode; `component/llamacpp.py`)."""

    def __init__(self, path: str, args: argparse.Namespace) -> None:
        seq_len = max(args.prompt_len, args.decode_prompt_len + args.decode_tokens + 2)
        self.runner = LlamaCppRunner(path, args.num_threads, max(args.concurrency), seq_len)

    def prefill_s(self, args: argparse.Namespace, rng: random.Random) -> float:
        prompt = _prompt(rng, args.prompt_len, args.vocab_size)
        self.runner.clear()
        start = time.perf_counter()
        self.runner.prefill(prompt)
        return time.perf_counter() - start

    def decode_window_s(self, ids: list[list[int]], new_tokens: int) -> float:
        start, end = self.runner.decode_steps(ids, new_tokens)
        return end - start


def prefill_figures(
    natives: dict[str, NativeBench],
    baselines: dict[str, Baseline],
    args: argparse.Namespace,
    rng: random.Random,
) -> dict[str, float]:
    """Median prefill tokens/s of each engine, repeats interleaved (first ones warm up)."""
    times: dict[str, list[float]] = {name: [] for name in (*natives, *baselines)}
    for i in range(args.repeats + 1):
        for name, native in natives.items():
            times[name].append(native.prefill_s(f"p{i}"))
        for name, base in baselines.items():
            times[name].append(base.prefill_s(args, rng))
    return {name: args.prompt_len / statistics.median(t[1:]) for name, t in times.items()}


def decode_figures(
    natives: dict[str, NativeBench],
    baselines: dict[str, Baseline],
    n: int,
    args: argparse.Namespace,
    rng: random.Random,
) -> dict[str, float | None]:
    """Aggregate decode tokens/s at n sequences, prefill excluded, for each engine: the
    fastest of --repeats windows of --decode-tokens steps (a shared machine only ever slows
    a window down), all engines' windows interleaved so they meet the same load. None for an
    engine that does not run n sequences; a window that is not a positive time is an error
    (a rate is never silently 0 or nan)."""
    for native in natives.values():
        native.start_decode(n)
        native.threads_used = {}
    ids = [_prompt(rng, args.decode_prompt_len, args.vocab_size) for _ in range(n)]
    runs = {name: base.decode_window_s(ids, 1) is not None for name, base in baselines.items()}
    best: dict[str, float] = {name: float("inf") for name in natives}
    best.update({name: float("inf") for name, ok in runs.items() if ok})
    for _ in range(args.repeats):
        for name, native in natives.items():
            best[name] = min(best[name], _window(name, native.decode_window_s()))
        for name, base in baselines.items():
            if runs[name]:
                best[name] = min(
                    best[name], _window(name, base.decode_window_s(ids, args.decode_tokens))
                )
    for native in natives.values():
        native.stop_decode()
    tokens = n * args.decode_tokens
    return {name: tokens / best[name] if name in best else None for name in (*natives, *baselines)}


def _window(name: str, seconds: float | None) -> float:
    if seconds is None or not seconds > 0 or seconds == float("inf"):
        raise RuntimeError(f"{name}: a decode window took {seconds} s; expected a positive time")
    return seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        check_device(args.device)
    except ValueError as exc:
        raise SystemExit(f"tandem bench engine: {exc}") from exc
    if args.llamacpp and args.device != "cpu":
        raise SystemExit(f"--llamacpp with --device {args.device}: llama.cpp runs here on cpu")
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    max_seqs = max(args.concurrency)
    rng = random.Random(0)
    natives: dict[str, NativeBench] = {}
    weight_bytes: dict[str, int] = {}
    kv_dtypes: dict[str, str] = {}
    config: ModelConfig | None = None
    for fmt in args.weights:
        engine_config = NativeConfig(
            model=args.model,
            dtype=args.dtype,
            weights=fmt,
            device=args.device,
            kv_cache_dtype=args.kv_cache_dtype,
            num_blocks=max(2048, max_seqs * 16),
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(args.prompt_len, 2048),
            max_model_len=4096,
            enable_prefix_caching=False,
        )
        model, _ = build_model(engine_config)
        config = model.config
        args.vocab_size = config.vocab_size
        name = f"native-{fmt}"
        natives[name] = NativeBench(EngineCore(engine_config, model), args, rng)
        weight_bytes[name] = model.weight_bytes()
        kv_dtypes[name] = str(model.kv_dtype).removeprefix("torch.")
    assert config is not None  # --weights takes one format at least (nargs="+")
    if args.gemm_only:
        gemm = gemm_figures(
            projection_shapes(config), args.weights, args.gemm_rows, args.num_threads, args.repeats
        )
        kernels = "{} build, {}".format(*select_isa())
        return {"model": config.name, "threads": args.num_threads, "kernels": kernels, **gemm}
    models = {name.removeprefix("native-"): b.core.model for name, b in natives.items()}
    spec = spec_result(models, args)
    if args.spec_only:
        return {"model": config.name, "device": args.device, "threads": args.num_threads, **spec}
    baselines: dict[str, Baseline] = {}
    if not args.skip_hf:
        _, hf_config, weights = load_model_weights(args.model)
        baselines["hf"] = HfBaseline(hf_model(hf_config, weights, dtype).to(args.device))
    if args.llamacpp:
        baselines["llama.cpp"] = LlamaCppBaseline(args.model or default_model_path(), args)
    result: dict[str, Any] = {
        "model": config.name,
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.num_threads,
        "kernels": "{} build, {}".format(*select_isa()) if args.device == "cpu" else None,
        "weight_bytes": weight_bytes,
        "kv_dtype": kv_dtypes,
        "engines": {name: {} for name in (*natives, *baselines)},
        **spec,
    }
    device = args.device
    bandwidth = [(memcpy_gbps(device=device), matvec_gbps(device=device))]
    for name, tok_s in prefill_figures(natives, baselines, args, rng).items():
        result["engines"][name]["prefill_tok_s"] = tok_s
    for n in args.concurrency:
        for name, rate in decode_figures(natives, baselines, n, args, rng).items():
            result["engines"][name][f"decode_tok_s@{n}"] = rate
        for name, native in natives.items():
            result.setdefault("decode_steps_by_threads", {}).setdefault(name, {})[str(n)] = (
                native.threads_used
            )
        bandwidth.append((memcpy_gbps(device=device), matvec_gbps(device=device)))
    add_bounds(result, max(b[0] for b in bandwidth), max(b[1] for b in bandwidth))
    return result


def add_bounds(result: dict[str, Any], gbps: float, mv_gbps: float) -> None:
    """Each native format's weight-streaming bound from the best bandwidths seen (measured
    before the runs and after each concurrency: a busy neighbour only lowers one)."""
    result["memcpy_gbps"] = gbps
    result["matvec_gbps"] = mv_gbps
    result["bound_step_ms"] = {
        name: b / (gbps * 1e9) * 1e3 for name, b in result["weight_bytes"].items()
    }


def format_result(r: dict[str, Any]) -> str:
    if r.get("spec_only"):
        return "\n".join(format_spec(r))
    if "gemm_gmacs" in r:
        return "\n".join(
            [f"model {r['model']}  native kernels: the {r['kernels']}", *format_gemm(r)]
        )
    engines = r["engines"]
    keys = [k for k in next(iter(engines.values())) if "@" in k]
    lines = [
        f"model {r['model']}  device {r.get('device', 'cpu')}  dtype {r['dtype']}  "
        f"threads {r['threads']}  "
        f"memcpy {r['memcpy_gbps']:.1f} GB/s  fp32 mat-vec read {r['matvec_gbps']:.1f} GB/s",
        *([f"native kernels: the {r['kernels']}"] if r.get("kernels") else []),
        f"{'':14}{'prefill tok/s':>15}"
        + "".join(f"{'decode@' + k.split('@')[1]:>13}" for k in keys),
    ]
    for name, row in engines.items():
        lines.append(
            f"{name:14}{row['prefill_tok_s']:>15.0f}"
            + "".join(f"{'n/a' if row[k] is None else f'{row[k]:.1f}':>13}" for k in keys)
        )
    anchors = [a for a in ("llama.cpp", "hf") if a in engines]
    columns = ["prefill_tok_s", *keys]
    for name, weight_bytes in r["weight_bytes"].items():
        row = engines[name]
        line = f"{name}: weights {weight_bytes / 1e6:.0f} MB"
        if name in r.get("kv_dtype", {}):
            line += f", KV cache {r['kv_dtype'][name]}"
        if row.get("decode_tok_s@1") is not None:
            step_ms = 1e3 / row["decode_tok_s@1"]
            bound = r["bound_step_ms"][name]
            line += f", batch-1 step {step_ms:.1f} ms = {step_ms / bound:.2f}x its memcpy bound"
            line += f" ({bound:.1f} ms)"
        lines.append(line)
        # every column as a ratio to each anchor of the same run (and to fp32 for int8/int4)
        for a in [*anchors, *(["native-fp32"] if name != "native-fp32" else [])]:
            if a not in engines:
                continue
            base = engines[a]
            ratios = "  ".join(
                f"{c.replace('_tok_s', '')} {row[c] / base[c]:.2f}x"
                for c in columns
                if base.get(c) and row.get(c) is not None
            )
            lines.append(f"  {name} / {a}: {ratios}")
    used = r.get("decode_steps_by_threads", {})
    for name, per_n in used.items():
        lines.append(
            f"{name} decode steps by intra-op threads: "
            + "  ".join(f"@{n} {dict(sorted(v.items()))}" for n, v in per_n.items())
        )
    return "\n".join(lines + format_spec(r))


def main(argv: list[str]) -> int:
    return figures_main(argv, parse_args, run, format_result)
