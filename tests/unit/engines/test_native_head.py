"""The bf16-screened greedy head picks the fp32 argmax, near-ties below bf16 resolution
included; the batch-1 decode step computes what the general forward computes, whether the
sequence's blocks are consecutive (read in place) or scattered (gathered)."""

from __future__ import annotations

import pytest
import torch
from native_tiny import TINY, TINY_WEIGHTS

from tandem.engines.native.attention import AttentionMetadata, PrefillSpan, SingleDecode
from tandem.engines.native.head import SCREEN_MAX_ROWS, OutputHead
from tandem.engines.native.model import LlamaModel


def test_screened_greedy_is_the_fp32_argmax_even_below_bf16_resolution():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 96, generator=gen)
    # rows that bf16 cannot tell apart: their fp32 logits differ by ~1e-4 relative
    weight[100:140] = weight[99] + 1e-4 * torch.randn(40, 96, generator=gen)
    head = OutputHead(weight, pack=False, screen=True)
    assert head.low is not None
    x = torch.randn(64, 96, generator=gen)
    x[:32] = weight[99] * (1 + torch.rand(32, 1, generator=gen))  # aim at the near-tied rows
    expected = torch.mm(x, weight.t()).max(dim=1).indices.tolist()
    chunks = [x[i : i + SCREEN_MAX_ROWS] for i in range(0, len(x), SCREEN_MAX_ROWS)]
    assert [t for chunk in chunks for t in head.greedy(chunk)] == expected
    assert head.greedy(x[5:6]) == expected[5:6]
    assert head.greedy(x) == expected  # more rows than screened: the fp32 head
    assert any(99 < e < 140 for e in expected[:32])  # the near-tied rows really compete


def test_unscreened_head_matches_logits_argmax():
    weight = torch.randn(512, 32, generator=torch.Generator().manual_seed(1))
    head = OutputHead(weight, pack=False, screen=False)
    x = torch.randn(3, 32)
    assert head.low is None
    assert head.greedy(x) == head.logits(x).max(dim=1).indices.tolist()


@pytest.mark.parametrize("ops", ["c", "torch"])
@pytest.mark.parametrize("scattered", [False, True])
@torch.inference_mode()
def test_decode_one_equals_the_general_forward(scattered, ops):
    model = LlamaModel(TINY, TINY_WEIGHTS, pack_weights=False)
    if ops == "torch":
        model._cpu_ops = None  # what CUDA and a machine without the C ops run
    else:
        assert model._cpu_ops is not None
    block_size, prompt = 4, [5, 17, 99, 3, 200, 41, 7, 9, 120]
    table = [7, 2, 5] if scattered else [3, 4, 5]
    n = len(prompt)
    pos = torch.arange(n)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
    cache = model.new_kv_cache(8, block_size)
    meta = AttentionMetadata(
        slot_mapping=slots[: n - 1],
        cos=model.cos[pos[: n - 1]].unsqueeze(1),
        sin=model.sin[pos[: n - 1]].unsqueeze(1),
        prefills=[
            PrefillSpan(
                start=0, end=n - 1, ctx_len=n - 1, context_blocks=torch.tensor(table), mask=None
            )
        ],
    )
    model.hidden(torch.tensor(prompt[:-1]), meta, cache, torch.tensor([n - 2]))
    general_cache = cache.clone()
    step = SingleDecode(slot=int(slots[-1]), ctx_len=n, rope=model.rope_matrix(n - 1))
    if scattered:
        step.blocks = torch.tensor(table)
    else:
        step.first_slot = table[0] * block_size
    got = model.decode_one(prompt[-1], step, cache)
    decode_meta = AttentionMetadata(
        slot_mapping=slots[-1:],
        cos=model.cos[n - 1 : n].unsqueeze(1),
        sin=model.sin[n - 1 : n].unsqueeze(1),
        num_decode=1,
        decode_blocks=torch.tensor(table),
        decode_mask=(torch.arange(len(table) * block_size) < n)[None, None, None, :],
        positions=pos[-1:],
        decode_lens=torch.tensor([n]),
    )
    expected = model.hidden(
        torch.tensor(prompt[-1:]), decode_meta, general_cache, torch.tensor([0])
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # batch-1 norms scale inside the projection (alpha): K/V differ by rounding only
    torch.testing.assert_close(cache, general_cache, atol=1e-5, rtol=1e-5)
