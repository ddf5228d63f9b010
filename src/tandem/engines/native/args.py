"""Native engine flags (`tandem worker --engine native ...`, `tandem serve ...`).

Env (e.g. TANDEM_NUM_BLOCKS) and config-file values: `tandem.runtime.flag_parser`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from tandem.engines.lora import add_max_loras_arg
from tandem.engines.native.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    MAX_SPEC_TOKENS,
    SPEC_LENGTHS,
    SPEC_METHODS,
    WEIGHT_FORMATS,
    NativeConfig,
)
from tandem.engines.step_policy import BACKGROUND_STEP_SLACK, BACKGROUND_STEP_SLACK_HELP
from tandem.kvbm.args import add_kvbm_args, kvbm_config_from_args

# flag -> (type, default, help)
_FLAGS: dict[str, tuple[Callable[[str], Any], Any, str]] = {
    "--model": (str, None, "a .gguf file or HF safetensors dir (default: SmolLM2-135M GGUF)"),
    "--model-name": (str, None, "model name served (default: smollm2 / the file name)"),
    "--dtype": (str, "float32", f"weights and KV dtype: {', '.join(DTYPES)}"),
    "--weights": (
        str,
        "auto",
        f"weight format of the projections: auto, {', '.join(WEIGHT_FORMATS)} (int8/int4: "
        "weight-only quantized, C kernels built for this CPU; auto: int4 where those build "
        "and --dtype is float32 on --device cpu, else fp32)",
    ),
    "--device": (
        str,
        "cpu",
        "where weights, KV cache and step tensors live: cpu, cuda or cuda:N (the C kernels "
        "serve cpu; cuda runs the same model as torch ops)",
    ),
    "--kv-cache-dtype": (
        str,
        "auto",
        f"KV cache element type: {', '.join(KV_CACHE_DTYPES)} (auto: float16 for int8/int4 "
        "weights on --device cpu, half the bytes attention reads; else --dtype)",
    ),
    "--block-size": (int, 16, "tokens per KV block"),
    "--kv-cache-memory-gb": (float, 1.0, "KV cache budget in GiB (sets the block count)"),
    "--num-blocks": (int, None, "explicit KV block count (overrides --kv-cache-memory-gb)"),
    "--max-num-seqs": (int, 64, "most sequences in one batch"),
    "--max-num-batched-tokens": (int, 1024, "most tokens computed in one step"),
    "--background-step-slack": (float, BACKGROUND_STEP_SLACK, BACKGROUND_STEP_SLACK_HELP),
    "--max-model-len": (int, None, "longest prompt + output (default: the model's context)"),
    "--num-threads": (int, 2, "torch intra-op threads"),
    "--seed": (int, 0, "seed of the sampler for requests without their own seed"),
    "--mm-encoder": (str, "bridge", "vision encoder of image requests ('none': text only)"),
    "--mm-placeholder-token-id": (int, 16, "token id at image rows (SmolLM2: <empty_output>)"),
    "--spec-method": (
        str,
        "none",
        f"speculative decoding: {', '.join(SPEC_METHODS)} (ngram: prompt lookup, drafts from "
        "the sequence's own tokens, verified in one forward; greedy output unchanged; requests "
        "with penalties, logit_bias, logprobs or structured output decode without it)",
    ),
    "--spec-tokens": (
        int,
        4,
        f"most draft tokens a step with --spec-method ngram (1..{MAX_SPEC_TOKENS})",
    ),
    "--spec-length": (
        str,
        "adaptive",
        f"draft length: {', '.join(SPEC_LENGTHS)} (adaptive: 0..--spec-tokens, what pays by "
        "the sequence's recent acceptance and the step's measured cost per row; fixed: all "
        "--spec-tokens the match offers)",
    ),
    "--spec-ngram-min": (int, 2, "shortest recurring suffix that drafts (tokens)"),
    "--spec-ngram-max": (int, 4, "longest suffix matched first (tokens, >= --spec-ngram-min)"),
}


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("native engine")
    for flag, (type_, default, help_) in _FLAGS.items():
        extra = ["--num-gpu-blocks"] if flag == "--num-blocks" else []
        group.add_argument(flag, *extra, type=type_, default=default, help=help_)
    group.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    add_max_loras_arg(group)
    add_kvbm_args(parser)


def config_from_args(ns: argparse.Namespace) -> NativeConfig:
    from tandem.engines.native.quant import auto_weights  # torch: only when building one

    return NativeConfig(
        model=ns.model,
        served_model_name=ns.model_name,
        dtype=ns.dtype,
        weights=auto_weights(ns.dtype, ns.device) if ns.weights == "auto" else ns.weights,
        device=ns.device,
        kv_cache_dtype=ns.kv_cache_dtype,
        block_size=ns.block_size,
        kv_cache_memory_gb=ns.kv_cache_memory_gb,
        num_blocks=ns.num_blocks,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        background_step_slack=ns.background_step_slack,
        max_model_len=ns.max_model_len,
        num_threads=ns.num_threads,
        enable_prefix_caching=not ns.no_prefix_caching,
        seed=ns.seed,
        kvbm=kvbm_config_from_args(ns),
        mm_encoder=None if ns.mm_encoder == "none" else ns.mm_encoder,
        mm_placeholder_token_id=ns.mm_placeholder_token_id,
        spec_method=ns.spec_method,
        spec_tokens=ns.spec_tokens,
        spec_length=ns.spec_length,
        spec_ngram_min=ns.spec_ngram_min,
        spec_ngram_max=ns.spec_ngram_max,
        max_loras=ns.max_loras,
    )
