"""`NativeConfig`: every knob of the native engine, validated once."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tandem.config_check import check_range
from tandem.engines.lora import DEFAULT_MAX_LORAS, MAX_LORAS_LIMIT
from tandem.engines.step_policy import BACKGROUND_STEP_SLACK, MAX_BACKGROUND_STEP_SLACK
from tandem.engines.vision import encoder_rows
from tandem.kvbm.base import KvbmConfig

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", *DTYPES)
WEIGHT_FORMATS = ("fp32", "int8", "int4")
SPEC_METHODS = ("none", "ngram")
SPEC_LENGTHS = ("adaptive", "fixed")  # how long a draft is (speculation.py)
MAX_SPEC_TOKENS = 32  # draft tokens a step; more rows than this cost more than they save
MAX_SPEC_NGRAM = 64
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True, slots=True, kw_only=True)
class NativeConfig:
    """model: a .gguf file, a HF safetensors dir, or None for the SmolLM2 GGUF.
    num_blocks: explicit KV block count; else derived from kv_cache_memory_gb.
    kvbm: host (G2) / disk (G3) tiers behind the KV pool (tandem.kvbm), None = device only."""

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "float32"
    weights: str = "fp32"  # projection weight format (int8 / int4: weight-only quantized)
    device: str = "cpu"  # where weights, KV cache and step tensors live: cpu, cuda, cuda:N
    kv_cache_dtype: str = "auto"  # the KV cache's elements (resolved_kv_dtype says what auto is)
    block_size: int = 16
    kv_cache_memory_gb: float = 1.0
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # how much longer outranked work may make a step (engines/step_policy.py)
    background_step_slack: float = BACKGROUND_STEP_SLACK
    max_model_len: int | None = None
    num_threads: int = 2
    enable_prefix_caching: bool = True
    seed: int = 0
    kvbm: KvbmConfig | None = None
    # images (DESIGN.md §10): the vision encoder whose rows this engine takes (None: text only)
    # and the token id the prompt holds at image rows (SmolLM2's <empty_output>)
    mm_encoder: str | None = "bridge"
    mm_placeholder_token_id: int = 16
    # prompt-lookup speculative decoding (speculation.py): "none" or "ngram"; up to k draft
    # tokens a step from the longest recurring suffix of ngram_min..ngram_max tokens, as many
    # as pay by the sequence's odds and the step's measured row cost ("adaptive") or all k
    # the match offers ("fixed")
    spec_method: str = "none"
    spec_tokens: int = 4
    spec_length: str = "adaptive"
    spec_ngram_min: int = 2
    spec_ngram_max: int = 4
    # LoRA adapters resident at once (tandem.engines.lora.LoraSlots); 0: serves none
    max_loras: int = DEFAULT_MAX_LORAS

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype='{self.dtype}'; expected one of: {', '.join(DTYPES)}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(
                f"weights='{self.weights}'; expected one of: {', '.join(WEIGHT_FORMATS)}"
            )
        if self.weights != "fp32" and self.dtype != "float32":
            raise ValueError(
                f"weights='{self.weights}' with dtype='{self.dtype}'; quantized weights "
                "compute in float32: use --dtype float32"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype='{self.kv_cache_dtype}'; expected one of: "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        check_device(self.device)
        check_range("block_size", self.block_size, low=1, high=1024)
        check_range("kv_cache_memory_gb", self.kv_cache_memory_gb, low=0, high=4096, low_open=True)
        if self.num_blocks is not None:
            check_range("num_blocks", self.num_blocks, low=1, high=10_000_000)
        check_range("max_num_seqs", self.max_num_seqs, low=1, high=65536)
        check_range("max_num_batched_tokens", self.max_num_batched_tokens, low=1, high=1 << 20)
        check_range(
            "background_step_slack", self.background_step_slack, low=0.0,
            high=MAX_BACKGROUND_STEP_SLACK,
        )  # fmt: skip
        if self.max_model_len is not None:
            check_range("max_model_len", self.max_model_len, low=1, high=1 << 22)
        check_range("num_threads", self.num_threads, low=1, high=1024)
        if self.mm_encoder is not None:
            encoder_rows(self.mm_encoder)  # ValueError naming the known encoders
        if self.spec_method not in SPEC_METHODS:
            raise ValueError(
                f"spec_method='{self.spec_method}'; expected one of: {', '.join(SPEC_METHODS)}"
            )
        check_range("spec_tokens", self.spec_tokens, low=1, high=MAX_SPEC_TOKENS)
        if self.spec_length not in SPEC_LENGTHS:
            raise ValueError(
                f"spec_length='{self.spec_length}'; expected one of: {', '.join(SPEC_LENGTHS)}"
            )
        check_range("spec_ngram_min", self.spec_ngram_min, low=1, high=MAX_SPEC_NGRAM)
        check_range(
            "spec_ngram_max",
            self.spec_ngram_max,
            low=self.spec_ngram_min,
            high=MAX_SPEC_NGRAM,
            note="(spec_ngram_min is the low end)",
        )
        check_range("max_loras", self.max_loras, low=0, high=MAX_LORAS_LIMIT, note="(0: no LoRA)")
        if self.kvbm is not None and not self.enable_prefix_caching:
            raise ValueError("kvbm tiers set with enable_prefix_caching=False; expected True")

    def resolved_kv_dtype(self) -> str:
        """The KV cache's dtype: `kv_cache_dtype`, or for 'auto' float16 where int8/int4
        weights run on the CPU (the C kernels read half the bytes a step's attention reads,
        and the quality gate measures it: mean KL to fp32 8.7e-7 (int4) and 9.2e-7 (int8)
        against 3.0e-7 and 4.4e-7 with an fp32 cache, every greedy token the same), else
        `dtype`. fp32 weights keep an fp32 cache: that engine is the reference the quantized
        ones are checked against."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        if self.weights != "fp32" and self.device == "cpu":
            return "float16"
        return self.dtype


def check_device(device: str) -> None:
    """Raise ValueError unless `device` is cpu, or a CUDA device this process can use: never
    a silent fall back to the CPU."""
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"device='{device}'; expected one of: cpu, cuda, cuda:N")
    if device == "cpu":
        return
    import torch  # only here: the config module stays cheap for processes without an engine

    if not torch.cuda.is_available():
        raise ValueError(
            f"device='{device}' but torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
            "expected --device cpu here, or a CUDA build of torch and a visible GPU"
        )
    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(
            f"device='{device}' but this machine has {count} CUDA device(s); "
            f"expected cuda or cuda:0..cuda:{count - 1}"
        )
