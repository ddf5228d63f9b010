"""`tandem bench lora`: the native engine's decode step with LoRA adapters (issue 32).

Per batch size (default 1, 8, 32) and number of distinct adapters in the batch (default 0 =
the base model alone, 1, 4, 8; the batch's sequences take them round-robin): the median
wall time of an engine step (`EngineCore.step`: schedule, forward, sample) while every
sequence decodes, and its ratio to the base step of the same batch size. The settings of one
batch size are measured interleaved, `--repeats` rounds, each setting's best median kept, so
all meet the same load. Adapters are made here (random, rank `--rank`, all seven projections,
nothing read from disk); targets of the issue: batch 32 with 8 adapters <= 1.3x the base
step, batch 1 <= 1.15x.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from tandem.bench.component.entry import figures_main
from tandem.config_check import check_range
from tandem.engines.lora import PEFT_MODULES, LoraWeights
from tandem.engines.native.adapters import NativeAdapter, lora_shape, prepare
from tandem.engines.native.config import WEIGHT_FORMATS, NativeConfig
from tandem.engines.native.engine import build_model
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.model import LlamaModel
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions

TARGETS = {(32, 8): 1.3, (1, 1): 1.15}  # (batch, adapters) -> most the step may cost vs base


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem bench lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="auto", help=f"auto, {', '.join(WEIGHT_FORMATS)}")
    p.add_argument("--batches", default="1,8,32", help="batch sizes (comma-separated)")
    p.add_argument("--adapters", default="1,4,8", help="distinct adapters per batch")
    p.add_argument("--rank", type=int, default=16, help="rank of every adapter")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of each sequence")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per setting")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (best kept)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    for name in ("rank", "prompt_len", "steps", "repeats", "num_threads"):
        check_range(name, getattr(args, name), low=1, high=4096)
    return args


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--{name}={text!r}; expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise SystemExit(f"--{name}={text!r}; expected integers >= 1")
    return values


def random_adapter(model: LlamaModel, name: str, rank: int, seed: int) -> NativeAdapter:
    """An adapter of every projection with random A and B (what a load gives, minus the file)."""
    shape = lora_shape(model.config, "bench")
    g = torch.Generator().manual_seed(seed)
    a, b = {}, {}
    for i in range(shape.num_layers):
        for m in PEFT_MODULES:
            d_in, d_out = shape.dims[m]
            a[(i, m)] = torch.randn(rank, d_in, generator=g) / d_in**0.5
            b[(i, m)] = torch.randn(d_out, rank, generator=g) * 0.01
    weights = LoraWeights(name=name, path="", rank=rank, scale=2.0, base_model=None,
                          modules=PEFT_MODULES, a=a, b=b)  # fmt: skip
    return prepare(weights, model)


def decode_step_ms(
    core: EngineCore, batch: int, names: list[str | None], args: argparse.Namespace
) -> float:
    """Median ms of a step while `batch` sequences (adapters `names` round-robin) decode."""
    for i in range(batch):
        prompt = [(7 * i + j) % 4000 + 100 for j in range(args.prompt_len)]
        core.add(PreprocessedRequest(
            request_id=f"b{i}", model="bench", token_ids=prompt,
            sampling=SamplingParams(temperature=0.0),
            stop=StopConditions(max_tokens=args.steps + 4, ignore_eos=True),
            lora_name=names[i % len(names)],
        ))  # fmt: skip
    while any(seq.num_output_tokens == 0 for seq in core.seqs.values()):
        core.step()  # prefills, off the clock
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - started) * 1000.0)
    for request_id in list(core.seqs):
        core.abort(request_id)
    while core.has_work():
        core.step()
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.engines.native.quant import auto_weights

    weights = auto_weights("float32", "cpu") if args.weights == "auto" else args.weights
    batches, counts = _ints(args.batches, "batches"), _ints(args.adapters, "adapters")
    max_seqs = max(batches)
    config = NativeConfig(
        weights=weights, num_threads=args.num_threads, max_num_seqs=max_seqs,
        max_num_batched_tokens=max(1024, max_seqs * args.prompt_len), max_loras=max(counts),
        max_model_len=args.prompt_len + args.steps + 8, enable_prefix_caching=False,
    )  # fmt: skip
    torch.set_num_threads(args.num_threads)
    model, _ = build_model(config)
    core = EngineCore(config, model)
    with torch.inference_mode():
        adapters = [random_adapter(model, f"a{i}", args.rank, i) for i in range(max(counts))]
    for adapter in adapters:
        core.add_lora(adapter)
    settings = [0, *counts]
    rows: list[dict[str, Any]] = []
    for batch in batches:
        best = {n: float("inf") for n in settings}
        for _ in range(args.repeats):
            for n in settings:
                names: list[str | None] = [a.name for a in adapters[:n]] if n else [None]
                best[n] = min(best[n], decode_step_ms(core, batch, names, args))
        for n in settings[1:]:
            ratio = best[n] / best[0]
            target = TARGETS.get((batch, n))
            rows.append({
                "batch": batch, "adapters": n, "base_ms": round(best[0], 3),
                "lora_ms": round(best[n], 3), "ratio": round(ratio, 3), "target": target,
                "met": None if target is None else ratio <= target,
            })  # fmt: skip
    return {"weights": weights, "rank": args.rank, "threads": args.num_threads,
            "prompt_len": args.prompt_len, "rows": rows}  # fmt: skip


def format_result(result: dict[str, Any]) -> str:
    lines = [
        f"native decode step with rank-{result['rank']} LoRA adapters "
        f"(weights {result['weights']}, {result['threads']} threads, prompt "
        f"{result['prompt_len']} tokens)",
        f"{'batch':>5} {'adapters':>8} {'base ms':>9} {'lora ms':>9} {'ratio':>6}  target",
    ]
    for r in result["rows"]:
        target = (
            "" if r["target"] is None else f"<= {r['target']} {'met' if r['met'] else 'MISSED'}"
        )
        lines.append(
            f"{r['batch']:>5} {r['adapters']:>8} {r['base_ms']:>9.2f} {r['lora_ms']:>9.2f} "
            f"{r['ratio']:>6.2f}  {target}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return figures_main(argv, parse_args, run, format_result)
