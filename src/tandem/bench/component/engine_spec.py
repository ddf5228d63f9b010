"""`tandem bench engine --spec-tokens K`: batch-1 greedy decode of the native engine with and
without prompt-lookup speculation (engines/native/speculation.py), on two workloads
(`spec_workloads.py`): answers that quote the prompt, where drafts are accepted, and free
chat, where they mostly are not (the cost of speculating for nothing).

Per weight format and workload: decode tokens/s without speculation and with it at each draft
length policy of --spec-length (fixed k, and adaptive up to k), each prompt's best of
--repeats, the modes interleaved so all meet the same load (the first token, which the prefill
gives, is outside the clock); per policy the speed-up over plain, whether every output was
token-identical, the acceptance rate, tokens per decoding step and the share of steps that
drafted. With --spec-batch B (default 32) also B sequences at once, the quote and chat
prompts in turn: the step's aggregate decode tokens/s, where a verified row costs about what
a plain token does and drafts that do not hold cost throughput.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, fields
from typing import Any

from tandem.bench.component.spec_workloads import WORKLOADS, chat_prompts
from tandem.engines.native.config import SPEC_LENGTHS, NativeConfig
from tandem.engines.native.engine import tokenizer_spec
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.loader import default_model_path
from tandem.engines.native.model import LlamaModel
from tandem.engines.native.speculation import SpecStats
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions
from tandem.tokens.tokenizer import load_tokenizer


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation (prompt lookup)")
    g.add_argument(
        "--spec-tokens",
        type=int,
        default=0,
        help="draft tokens a step: also measure batch-1 decode with and without speculation "
        "on the quote and chat workloads (0: skip)",
    )
    g.add_argument("--spec-ngram-min", type=int, default=2)
    g.add_argument("--spec-ngram-max", type=int, default=4)
    g.add_argument("--spec-max-tokens", type=int, default=128, help="tokens generated per prompt")
    g.add_argument(
        "--spec-length",
        nargs="+",
        choices=SPEC_LENGTHS,
        default=list(SPEC_LENGTHS),
        help="draft length policies to measure beside plain decoding (the engine's "
        "--spec-length: adaptive up to k, or fixed k)",
    )
    g.add_argument(
        "--spec-batch",
        type=int,
        nargs="*",
        default=[32],
        help="also decode this many sequences at once (quote and chat prompts in turn), "
        "plain and speculative: aggregate tokens/s (none: batch 1 only)",
    )
    g.add_argument(
        "--spec-per-prompt",
        action="store_true",
        help="also each batch-1 prompt's figures (workload N: its Nth task, in "
        "bench/component/spec_workloads.py)",
    )
    g.add_argument(
        "--spec-only",
        action="store_true",
        help="only the speculation figures (no prefill/decode table or baselines)",
    )


def _generate_batch(
    core: EngineCore, prompts: list[list[int]], max_tokens: int
) -> tuple[dict[str, list[int]], int, float]:
    """Greedy tokens of the prompts decoding together, and the tokens and seconds of the steps
    after every one has its first token (the prefills, off the clock)."""
    for i, prompt in enumerate(prompts):
        core.add(
            PreprocessedRequest(
                request_id=f"b{i}",
                model="bench",
                token_ids=prompt,
                sampling=SamplingParams(temperature=0.0),
                stop=StopConditions(max_tokens=max_tokens),
            )
        )
    tokens: dict[str, list[int]] = {f"b{i}": [] for i in range(len(prompts))}
    while not all(tokens.values()):
        for rid, out in core.step():
            tokens[rid] += out.token_ids
    timed, start = 0, time.perf_counter()
    while core.has_work():
        for rid, out in core.step():
            tokens[rid] += out.token_ids
            timed += len(out.token_ids)
    return tokens, timed, time.perf_counter() - start


def spec_figures(
    models: dict[str, LlamaModel], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """{format: {workload: figures}} of greedy decode at batch 1 (each workload) and of
    --spec-batch sequences at once, plain and speculative at each --spec-length policy."""
    source = tokenizer_spec(args.model or default_model_path())
    try:
        tokenizer = load_tokenizer(source or "")
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--spec-tokens needs the model's tokenizer ({source}): {exc}") from exc
    batches = args.spec_batch
    prompts = {w: chat_prompts(tokenizer, tasks) for w, tasks in WORKLOADS.items()}
    mixed = [p for pair in zip(*prompts.values(), strict=True) for p in pair]
    longest = max(map(len, mixed)) + args.spec_max_tokens + args.spec_tokens + 1
    seats = max([1, *batches])
    result: dict[str, dict[str, Any]] = {}
    for fmt, model in models.items():
        common = dict(weights=fmt, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
                      num_blocks=seats * (-(-longest // 16) + 1), max_num_seqs=seats,
                      max_num_batched_tokens=seats * longest, max_model_len=2048,
                      enable_prefix_caching=False)  # fmt: skip
        cores = {"plain": EngineCore(NativeConfig(**common), model)}  # type: ignore[arg-type]
        for length in args.spec_length:
            cores[length] = EngineCore(
                NativeConfig(
                    **common,  # type: ignore[arg-type]
                    spec_method="ngram",
                    spec_tokens=args.spec_tokens,
                    spec_ngram_min=args.spec_ngram_min,
                    spec_ngram_max=args.spec_ngram_max,
                    spec_length=length,
                ),
                model,
            )
        result[fmt] = {}
        for workload, workload_prompts in prompts.items():
            total, each = _measure(cores, [[p] for p in workload_prompts], args)
            result[fmt][workload] = total
            if args.spec_per_prompt:
                for i, figures in enumerate(each, 1):
                    result[fmt][f"{workload} {i}"] = figures
        for b in batches:
            batch = [mixed[i % len(mixed)] for i in range(b)]
            result[fmt][f"mixed x{b}"], _ = _measure(cores, [batch], args)
    return result


def _measure(
    cores: dict[str, EngineCore], runs: list[list[list[int]]], args: argparse.Namespace
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Decode tokens/s of each core over `runs` (each: prompts decoding together), from each
    run's fastest of --repeats with the cores interleaved; per speculative core its figures.
    Returns the figures over all runs and those of each run."""
    lengths = [mode for mode in cores if mode != "plain"]
    per_run: list[_Run] = []
    for prompts in runs:
        for core in cores.values():
            if core.speculator is not None:
                core.speculator.stats = SpecStats()
        best: dict[str, tuple[float, int]] = {}
        outs: dict[str, dict[str, list[int]]] = {}
        for _ in range(args.repeats):
            for mode, core in cores.items():
                outs[mode], timed, elapsed = _generate_batch(core, prompts, args.spec_max_tokens)
                best[mode] = min(best.get(mode, (elapsed, timed)), (elapsed, timed))
        stats = {}
        for length in lengths:
            speculator = cores[length].speculator
            assert speculator is not None
            stats[length] = speculator.stats
        per_run.append(
            _Run(
                tokens={mode: timed for mode, (_, timed) in best.items()},
                seconds={mode: elapsed for mode, (elapsed, _) in best.items()},
                stats=stats,
                identical={length: outs[length] == outs["plain"] for length in lengths},
            )
        )
    return _Run.total(per_run, lengths).figures(), [run.figures() for run in per_run]


@dataclass(slots=True)
class _Run:
    """What one run (or a sum of runs) measured: per mode the decode tokens on the clock and
    their seconds; per draft length policy its counters and whether every output matched."""

    tokens: dict[str, int]
    seconds: dict[str, float]
    stats: dict[str, SpecStats]
    identical: dict[str, bool]

    @classmethod
    def total(cls, runs: list[_Run], lengths: list[str]) -> _Run:
        modes = ["plain", *lengths]
        return cls(
            tokens={m: sum(r.tokens[m] for r in runs) for m in modes},
            seconds={m: sum(r.seconds[m] for r in runs) for m in modes},
            stats={
                length: SpecStats(
                    **{
                        f.name: sum(getattr(r.stats[length], f.name) for r in runs)
                        for f in fields(SpecStats)
                    }
                )
                for length in lengths
            },
            identical={length: all(r.identical[length] for r in runs) for length in lengths},
        )

    def figures(self) -> dict[str, Any]:
        by_length: dict[str, dict[str, Any]] = {}
        for length, stats in self.stats.items():
            by_length[length] = {
                "identical": self.identical[length],
                "spec_tok_s": self.tokens[length] / self.seconds[length],
                "acceptance_rate": stats.acceptance_rate,
                "tokens_per_step": stats.tokens_per_step,
                "draft_steps": stats.num_drafts / max(stats.num_decode_steps, 1),
            }
        return {
            "tokens": self.tokens["plain"],
            "plain_tok_s": self.tokens["plain"] / self.seconds["plain"],
            "lengths": by_length,
        }


def spec_result(models: dict[str, LlamaModel], args: argparse.Namespace) -> dict[str, Any]:
    """The speculation keys of the bench's result ({} without --spec-tokens)."""
    if args.spec_tokens < 0:
        raise SystemExit(f"--spec-tokens={args.spec_tokens}; expected 0 (skip) or more")
    if bad := [b for b in args.spec_batch if b < 2]:
        raise SystemExit(
            f"--spec-batch {bad[0]}: batch 1 is always measured (the workloads); expected 2 or "
            "more sequences at once"
        )
    if args.spec_only and not args.spec_tokens:
        raise SystemExit("--spec-only without --spec-tokens K: nothing to measure")
    if not args.spec_tokens:
        return {}
    try:
        figures = spec_figures(models, args)
    except ValueError as exc:  # NativeConfig's range checks on the --spec-* values
        raise SystemExit(f"tandem bench engine: {exc}") from exc
    return {
        "speculation": figures,
        "spec_tokens": args.spec_tokens,
        "spec_ngram": [args.spec_ngram_min, args.spec_ngram_max],
        "spec_max_tokens": args.spec_max_tokens,
        "spec_lengths": args.spec_length,
        "spec_batch": args.spec_batch,
        "spec_only": args.spec_only,
    }


def format_spec(r: dict[str, Any]) -> list[str]:
    spec = r.get("speculation")
    if not spec:
        return []
    lines = [
        f"speculation: prompt lookup, k={r['spec_tokens']}, n-gram "
        f"{r['spec_ngram'][0]}..{r['spec_ngram'][1]}, greedy decode at batch 1 (mixed xB: B "
        f"at once), {r['spec_max_tokens']} tokens a prompt; draft length fixed k, or adaptive "
        "up to k",
        f"{'':33}{'plain tok/s':>12}{'spec tok/s':>12}{'speed-up':>10}{'accepted':>10}"
        f"{'tok/step':>10}{'drafting':>10}  identical",
    ]
    for fmt, per_workload in spec.items():
        for workload, w in per_workload.items():
            for length, f in w["lengths"].items():
                lines.append(
                    f"{f'native-{fmt} {workload} {length}':33}{w['plain_tok_s']:>12.1f}"
                    f"{f['spec_tok_s']:>12.1f}{f['spec_tok_s'] / w['plain_tok_s']:>9.2f}x"
                    f"{f['acceptance_rate']:>10.0%}{f['tokens_per_step']:>10.2f}"
                    f"{f['draft_steps']:>10.0%}  {'yes' if f['identical'] else 'NO'}"
                )
    return lines
