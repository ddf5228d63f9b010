"""Native embeddings over a tiny random model: mean pooling of the final-normed hidden states
equals a straightforward reference forward, a batch equals its inputs one at a time, the
engine takes no KV block, checks its inputs, and interleaves with generation."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from native_reference import reference_logits
from native_tiny import TINY, TINY_WEIGHTS, request, tiny_core

from tandem.engines.native.embedding import pooled_embeddings, token_groups
from tandem.engines.native.engine import NativeEngine
from tandem.engines.native.model import LlamaModel
from tandem.engines.native.quant_model import QuantLlamaModel
from tandem.errors import ContextLengthExceeded, InvalidRequest

pytestmark = pytest.mark.timeout(30)
INPUTS = [[5, 6, 7, 8, 9], [10], [11, 12, 13, 200, 3, 4, 50, 60, 70, 80, 90]]
# a final norm weight that is not all ones, so pooling must apply it
WEIGHTS = {**TINY_WEIGHTS, "model.norm.weight": torch.linspace(0.2, 2.0, TINY.hidden_size)}


def reference_embedding(ids: list[int]) -> torch.Tensor:
    """Mean of the reference's final-normed hidden states (an identity head), normalised."""
    identity = {**WEIGHTS, "lm_head.weight": torch.eye(TINY.hidden_size)}
    hidden = reference_logits(TINY, identity, ids)
    return torch.nn.functional.normalize(hidden.mean(0), dim=0)


def test_mean_pooling_matches_the_reference_and_a_batch_matches_singles() -> None:
    model = LlamaModel(TINY, WEIGHTS)
    batch = pooled_embeddings(model, INPUTS)
    assert batch.shape == (3, TINY.hidden_size) and batch.dtype == torch.float32
    assert torch.allclose(batch.norm(dim=1), torch.ones(3), atol=1e-6)
    for i, ids in enumerate(INPUTS):
        assert torch.allclose(batch[i], reference_embedding(ids), atol=1e-5)
        assert torch.allclose(batch[i], pooled_embeddings(model, [ids])[0], atol=1e-6)
    assert not torch.allclose(batch[0], batch[2], atol=1e-2)


def test_token_groups_bound_each_forward_and_keep_the_order() -> None:
    groups = token_groups(INPUTS, max_tokens=6)
    assert groups == [[INPUTS[0], INPUTS[1]], [INPUTS[2]]]  # a long input alone
    assert [x for g in token_groups(INPUTS, 1) for x in g] == INPUTS


async def test_engine_embeds_between_generation_steps_without_taking_blocks() -> None:
    core = tiny_core(max_num_batched_tokens=8)  # the inputs take two forwards
    engine = NativeEngine(core.config, core=core)
    info = await engine.start()
    assert info.embedding_dim == TINY.hidden_size
    try:
        free = core.block_manager.num_free_blocks

        async def generate() -> int:
            n = 0
            async for out in engine.generate(request("g", [1, 2, 3, 4, 5], max_tokens=12)):
                n += len(out.token_ids)
            return n

        gen = asyncio.create_task(generate())
        vectors = await engine.embed(INPUTS)
        assert await gen == 12
        assert isinstance(vectors, np.ndarray) and vectors.shape == (3, TINY.hidden_size)
        expected = torch.stack([pooled_embeddings(core.model, [ids])[0] for ids in INPUTS])
        assert np.allclose(vectors, expected.numpy(), atol=1e-6)
        assert core.block_manager.num_free_blocks == free
        assert not core.block_manager.tables  # nothing holds a block
        core.block_manager.check_integrity()
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    ("inputs", "error", "match"),
    [
        ([[1], []], InvalidRequest, r"input\[1\] is empty"),
        ([[1, 256]], InvalidRequest, r"input\[0\] has token ids outside \[0, 256\)"),
        ([[1] * 513], ContextLengthExceeded, r"input\[0\] has 513 tokens"),
    ],
)
async def test_engine_refuses_inputs_it_cannot_take(
    inputs: list[list[int]], error: type, match: str
) -> None:
    core = tiny_core()
    engine = NativeEngine(core.config, core=core)
    await engine.start()
    try:
        with pytest.raises(error, match=match):
            await engine.embed(inputs)
    finally:
        await engine.stop()


def test_quantized_weights_pool_the_same_way() -> None:
    fp32 = pooled_embeddings(LlamaModel(TINY, WEIGHTS), INPUTS)
    int8 = pooled_embeddings(QuantLlamaModel(TINY, WEIGHTS, weights_format="int8"), INPUTS)
    cosines = (fp32 * int8).sum(dim=1)
    assert bool((cosines > 0.99).all()), cosines


async def test_each_forward_is_a_prefill_step_for_the_planner() -> None:
    core = tiny_core(max_num_batched_tokens=8)
    engine = NativeEngine(core.config, core=core)
    await engine.start()
    try:
        engine.take_step_samples()
        await engine.embed(INPUTS)
        steps = engine.take_step_samples()
        groups = token_groups(INPUTS, 8)
        assert [s.num_prefill_tokens for s in steps] == [sum(map(len, g)) for g in groups]
        assert all(s.num_decode_kv_tokens == 0 and s.wall_ms > 0 for s in steps)
    finally:
        await engine.stop()
