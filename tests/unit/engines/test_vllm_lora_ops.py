"""`lora_ops.skip_base_tokens` (vLLM is not in this venv: `expand` is the indexing vLLM's CPU
LoRA op does, `weights[indices]`, where -1 picks the last adapter slot): rows of base-model
tokens (-1) keep their values, rows of adapter tokens get the op's own. The plugin on the real
vLLM: tests/e2e/test_vllm_serve.py (a base request batched with an adapter request)."""

from __future__ import annotations

import pytest
import torch

from tandem.engines.vllm import lora_ops


def expand(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor,
           indices: torch.Tensor, add_inputs: bool = True) -> None:  # fmt: skip
    outputs = torch.einsum("bi, boi -> bo", inputs, weights[indices])
    if add_inputs:
        output += outputs
    else:
        output[:] = outputs


@pytest.mark.parametrize("add_inputs", [True, False])
def test_base_tokens_keep_their_rows_in_a_mixed_batch(add_inputs: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    inputs, weights = torch.randn(4, 3, generator=gen), torch.randn(2, 5, 3, generator=gen)
    before = torch.randn(4, 5, generator=gen)
    indices = torch.tensor([0, -1, 1, -1])

    buggy = before.clone()
    expand(inputs, weights, buggy, indices, add_inputs)
    assert not torch.equal(buggy[1], before[1])  # vLLM's op: slot 1's update on a base token

    fixed = before.clone()
    lora_ops.skip_base_tokens(expand)(inputs, weights, fixed, indices, add_inputs)
    assert torch.equal(fixed[[1, 3]], before[[1, 3]])
    assert torch.equal(fixed[[0, 2]], buggy[[0, 2]])


def test_batches_without_base_tokens_or_only_base_tokens() -> None:
    inputs, weights = torch.ones(2, 3), torch.ones(2, 5, 3)
    out = torch.zeros(2, 5)
    lora_ops.skip_base_tokens(expand)(inputs, weights, out, torch.tensor([1, 0]))
    assert torch.equal(out, torch.full((2, 5), 3.0))  # the op's own
    out = torch.zeros(2, 5)
    lora_ops.skip_base_tokens(expand)(inputs, weights, out, torch.tensor([-1, -1]))
    assert torch.equal(out, torch.zeros(2, 5))  # nothing applied
