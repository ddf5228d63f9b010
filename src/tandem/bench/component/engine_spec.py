"""`tandem bench engine --spec-tokens K`: batch-1 greedy decode of the native engine with and
without prompt-lookup speculation (engines/native/speculation.py), on two workloads
(`spec_workloads.py`): answers that quote the prompt, where drafts are accepted, and free
chat, where they mostly are not (the cost of speculating for nothing).

Per weight format and workload: decode tokens/s without and with speculation (each prompt's
best of --repeats, the two modes interleaved so both meet the same load; the first token,
which the prefill gives, is outside the clock), the speed-up, whether every output was token-
identical, the acceptance rate and tokens per decoding step.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tandem.bench.component.spec_workloads import WORKLOADS, chat_prompts
from tandem.engines.native.config import NativeConfig
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
        "--spec-only",
        action="store_true",
        help="only the speculation figures (no prefill/decode table or baselines)",
    )


def _generate(core: EngineCore, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens of one request alone and the seconds of its decode steps."""
    core.add(
        PreprocessedRequest(
            request_id="spec",
            model="bench",
            token_ids=prompt,
            sampling=SamplingParams(temperature=0.0),
            stop=StopConditions(max_tokens=max_tokens),
        )
    )
    tokens: list[int] = []
    while not tokens:  # the prefill, off the clock
        for _, out in core.step():
            tokens += out.token_ids
    start = time.perf_counter()
    while core.has_work():
        for _, out in core.step():
            tokens += out.token_ids
    return tokens, time.perf_counter() - start


def spec_figures(
    models: dict[str, LlamaModel], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """{format: {workload: figures}} of batch-1 greedy decode, plain vs speculative."""
    source = tokenizer_spec(args.model or default_model_path())
    try:
        tokenizer = load_tokenizer(source or "")
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--spec-tokens needs the model's tokenizer ({source}): {exc}") from exc
    result: dict[str, dict[str, Any]] = {}
    for fmt, model in models.items():
        common = dict(weights=fmt, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
                      num_blocks=512, max_model_len=2048, enable_prefix_caching=False)  # fmt: skip
        plain = EngineCore(NativeConfig(**common), model)  # type: ignore[arg-type]
        spec = EngineCore(
            NativeConfig(
                **common,  # type: ignore[arg-type]
                spec_method="ngram",
                spec_tokens=args.spec_tokens,
                spec_ngram_min=args.spec_ngram_min,
                spec_ngram_max=args.spec_ngram_max,
            ),
            model,
        )
        assert spec.speculator is not None
        result[fmt] = {}
        for workload, tasks in WORKLOADS.items():
            spec.speculator.stats = SpecStats()
            tokens, plain_s, spec_s, identical = 0, 0.0, 0.0, True
            for prompt in chat_prompts(tokenizer, tasks):
                best = {"plain": float("inf"), "spec": float("inf")}
                outs: dict[str, list[int]] = {}
                for _ in range(args.repeats):
                    for mode, core in (("plain", plain), ("spec", spec)):
                        outs[mode], seconds = _generate(core, prompt, args.spec_max_tokens)
                        best[mode] = min(best[mode], seconds)
                tokens += len(outs["plain"]) - 1  # decode tokens (timed)
                plain_s, spec_s = plain_s + best["plain"], spec_s + best["spec"]
                identical = identical and outs["plain"] == outs["spec"]
            stats = spec.speculator.stats
            figures = {
                "tokens": tokens,
                "identical": identical,
                "plain_tok_s": tokens / plain_s,
                "spec_tok_s": tokens / spec_s,
                "acceptance_rate": stats.acceptance_rate,
                "tokens_per_step": stats.tokens_per_step,
                "draft_steps": stats.num_drafts / max(stats.num_decode_steps, 1),
            }
            result[fmt][workload] = figures
    return result


def spec_result(models: dict[str, LlamaModel], args: argparse.Namespace) -> dict[str, Any]:
    """The speculation keys of the bench's result ({} without --spec-tokens)."""
    if args.spec_tokens < 0:
        raise SystemExit(f"--spec-tokens={args.spec_tokens}; expected 0 (skip) or more")
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
        "spec_only": args.spec_only,
    }


def format_spec(r: dict[str, Any]) -> list[str]:
    spec = r.get("speculation")
    if not spec:
        return []
    lines = [
        f"speculation: prompt lookup, k={r['spec_tokens']}, n-gram "
        f"{r['spec_ngram'][0]}..{r['spec_ngram'][1]}, batch 1 greedy decode "
        f"({r['spec_max_tokens']} tokens a prompt)",
        f"{'':24}{'plain tok/s':>12}{'spec tok/s':>12}{'speed-up':>10}{'accepted':>10}"
        f"{'tok/step':>10}{'drafting':>10}  identical",
    ]
    for fmt, per_workload in spec.items():
        for workload, f in per_workload.items():
            lines.append(
                f"{'native-' + fmt + ' ' + workload:24}{f['plain_tok_s']:>12.1f}"
                f"{f['spec_tok_s']:>12.1f}{f['spec_tok_s'] / f['plain_tok_s']:>9.2f}x"
                f"{f['acceptance_rate']:>10.0%}{f['tokens_per_step']:>10.2f}"
                f"{f['draft_steps']:>10.0%}  {'yes' if f['identical'] else 'NO'}"
            )
    return lines
