"""SmolLM2 through the native engine core: greedy tokens match an unpaged reference, and
stay the same alone vs batched, from the prefix cache vs computed, after preemption."""

from __future__ import annotations

import random

import pytest
import torch
from native_reference import Reference

from tandem.engines.native.config import WEIGHT_FORMATS, NativeConfig
from tandem.engines.native.engine import build_model
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.loader import load_model_weights
from tandem.engines.native.model import LlamaModel
from tandem.engines.native.model_config import ModelConfig
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions

pytestmark = [pytest.mark.native, pytest.mark.timeout(120)]

NUM_TOKENS = 32


@pytest.fixture(scope="module")
def fp32_weights() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    _, config, weights = load_model_weights()
    return config, weights


# Every check runs on each weight format. The quantized formats hold the GGUF's own Q4_1
# values (see test_native_quant), so the fp32 reference stays the judge of near-ties.
@pytest.fixture(scope="module", params=WEIGHT_FORMATS)
def smollm2(request, fp32_weights) -> tuple[LlamaModel, Reference]:
    torch.set_num_threads(1)  # the CI box is shared: OpenMP barriers under contention cost more
    config, weights = fp32_weights
    if request.param == "fp32":
        model = LlamaModel(config, weights, max_positions=1024)
    else:
        model, _ = build_model(NativeConfig(weights=request.param, max_model_len=1024))
    return model, Reference(config, weights)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(200, 40000) for _ in range(40)]
    out = [[rng.randrange(200, 40000) for _ in range(rng.randrange(3, 70))] for _ in range(6)]
    out += [shared + [rng.randrange(200, 40000) for _ in range(n)] for n in (5, 21)]
    return out


def greedy(i: int, prompt: list[int]) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"r{i}",
        model="smollm2",
        token_ids=prompt,
        sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=NUM_TOKENS, ignore_eos=True),
    )


def run(core: EngineCore, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Generate for all prompts at once; (tokens per prompt, cached tokens per prompt)."""
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        core.add(greedy(i, prompt))
        tokens[f"r{i}"] = []
    while core.has_work():
        for request_id, out in core.step():
            tokens[request_id] += out.token_ids
            if out.num_cached_tokens is not None:
                cached[request_id] = out.num_cached_tokens
        core.block_manager.check_integrity()
    assert core.block_manager.num_active_blocks == 0
    keys = [f"r{i}" for i in range(len(prompts))]
    return [tokens[k] for k in keys], [cached[k] for k in keys]


def make_core(model: LlamaModel, **kw: int) -> EngineCore:
    fmt = getattr(model, "weights_format", "fp32")
    config = NativeConfig(
        **{"num_blocks": 256, "max_num_batched_tokens": 256, "weights": fmt, **kw}
    )
    return EngineCore(config, model)


@pytest.fixture(scope="module")
def batched(smollm2, prompts) -> list[list[int]]:
    model, _ = smollm2
    outputs, cached = run(make_core(model), prompts)
    assert cached == [0] * len(prompts)  # admitted together: nothing computed to share yet
    return outputs


def test_greedy_batched_matches_unpaged_reference(smollm2, prompts, batched):
    _, ref = smollm2
    assert len(prompts) >= 8 and all(len(o) == NUM_TOKENS for o in batched)
    for prompt, output in zip(prompts, batched, strict=True):
        ref.check_greedy(prompt, output)


def test_alone_equals_batched(smollm2, prompts, batched):
    model, ref = smollm2
    core = make_core(model, enable_prefix_caching=False)
    for i in (0, 3, 7):
        (alone,), _ = run(core, [prompts[i]])
        ref.check_same(prompts[i], alone, batched[i])


def test_prefix_from_cache_equals_computed(smollm2, prompts, batched):
    model, ref = smollm2
    core = make_core(model)
    run(core, prompts[6:])
    events = core.take_events()
    assert events and core.block_manager.hash_to_block
    again, cached = run(core, prompts[6:])
    assert all(c >= 32 for c in cached), cached
    for prompt, a, b in zip(prompts[6:], again, batched[6:], strict=True):
        ref.check_same(prompt, a, b)


def test_preemption_and_recompute_keep_tokens(smollm2, prompts, batched):
    model, ref = smollm2
    core = make_core(model, num_blocks=24, max_num_batched_tokens=64)
    outputs, _ = run(core, prompts)
    assert core.scheduler.num_preemptions > 0
    for prompt, a, b in zip(prompts, outputs, batched, strict=True):
        ref.check_same(prompt, a, b)


def test_export_import_round_trip_is_exact(smollm2, prompts):
    model, _ = smollm2
    core = make_core(model, num_blocks=16)
    core.add(greedy(0, prompts[7][:48]))
    core.step()  # prefill: 3 full blocks computed
    table = list(core.block_manager.block_table(core.seqs["r0"]))
    exported = core.runner.export_blocks(table)
    wire = [t.numpy().tobytes() for t in exported]
    assert sum(map(len, wire)) == len(table) * core.runner.bytes_per_block
    spare = [b for b in range(16) if b not in table][: len(table)]
    data = [
        torch.frombuffer(bytearray(b), dtype=t.dtype).view(t.shape)
        for b, t in zip(wire, exported, strict=True)
    ]
    core.runner.import_blocks(spare, data)
    kv = core.runner.kv_cache
    assert torch.equal(kv[:, :, spare], kv[:, :, table])
    assert kv[:, :, table].abs().sum() > 0
