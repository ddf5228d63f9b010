"""A tiny random-weight llama for fast native-engine tests of scheduling and plumbing."""

from __future__ import annotations

import torch

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.loader import random_weights
from tandem.engines.native.model import LlamaModel
from tandem.engines.native.model_config import ModelConfig
from tandem.engines.native.quant_model import QuantLlamaModel
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions

TINY = ModelConfig(
    name="tiny",
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=256,
    rope_theta=10000.0,
    context_length=512,
    eos_token_ids=(2,),
    tie_word_embeddings=True,
)
TINY_WEIGHTS = random_weights(TINY, seed=0)
torch.set_num_threads(1)  # tiny tensors: OpenMP fan-out only costs on a shared box


def tiny_model(weights: str = "fp32") -> LlamaModel:
    if weights == "fp32":
        return LlamaModel(TINY, TINY_WEIGHTS)
    return QuantLlamaModel(TINY, dict(TINY_WEIGHTS), weights_format=weights)  # type: ignore[arg-type]


def tiny_core(**kw: object) -> EngineCore:
    defaults: dict[str, object] = {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64}
    config = NativeConfig(**{**defaults, **kw})  # type: ignore[arg-type]
    return EngineCore(config, tiny_model(config.weights))


def request(
    request_id: str, prompt: list[int], max_tokens: int = 8, **sampling: object
) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=request_id,
        model="tiny",
        token_ids=prompt,
        sampling=SamplingParams(**{"temperature": 0.0, **sampling}),  # type: ignore[arg-type]
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )
