"""The native engine's C ops (kernels/ops.c) against their torch definitions, in every
instruction-set build this CPU executes (cbuild.runnable_isas)."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
import torch.nn.functional as F

from tandem.cbuild import runnable_isas, select_isa
from tandem.engines.native.attention import to_cache
from tandem.engines.native.ops import CpuOps, LoraRows, _load, build, cpu_ops, lora_table

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", params=runnable_isas())
def isa(request) -> str:
    """Every instruction-set build this CPU executes (the serving one among them)."""
    return str(request.param)


@pytest.fixture(scope="module")
def ops(isa) -> CpuOps:
    return CpuOps(_load(build(torch.float32, isa)), torch.float32)


@pytest.fixture(scope="module")
def ops16(isa) -> CpuOps:
    return CpuOps(_load(build(torch.float16, isa)), torch.float16)


def test_every_build_runs_its_own_path_and_the_serving_one_is_tested(ops, ops16, isa):
    assert ops.lib.to_has_avx2() == ops16.lib.to_has_avx2() == (isa != "scalar")
    assert select_isa()[0] in runnable_isas()
    found = cpu_ops(torch.float32)
    assert found is not None, "the C ops did not build on this machine (gcc missing?)"


def test_only_fp32_on_cpu_gets_the_c_ops():
    assert cpu_ops(torch.bfloat16) is None
    assert cpu_ops(torch.float32, "meta") is None
    assert cpu_ops(torch.float32, kv_dtype=torch.bfloat16) is None  # no C build for it
    assert cpu_ops(torch.float32, kv_dtype=torch.float16) is not None


def test_c_ops_refuse_a_cache_of_another_dtype(ops, ops16):
    qkv = torch.randn(1, 4 * 8)
    pos, slot = torch.tensor([0]), torch.tensor([0])
    cos = sin = torch.ones(1, 8)
    half = torch.zeros(4, 1, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        ops.rope_store(qkv, 2, 1, pos, cos, sin, slot, half, half)
    with pytest.raises(ValueError, match="float32"):
        ops16.rope_store(qkv, 2, 1, pos, cos, sin, slot, half.float(), half.float())


def test_fp16_cache_stores_rounded_values_and_attends_as_fp32_over_them(ops, ops16):
    """The fp16 build stores k/v rounded to nearest even (saturating at the fp16 maximum) and
    computes exactly what the fp32 build computes over those values widened back: the same
    bits from rope_store, decode and prefill attention."""
    torch.manual_seed(4)
    heads, kv_heads, d, bs, rows = 9, 3, 64, 16, 40
    stride = (heads + 2 * kv_heads) * d
    qkv = torch.randn(rows, stride) * 3
    qkv[5, heads * d + 7] = 1e6  # beyond fp16: stored as 65504, not inf
    qkv[6, heads * d + 9] = -1e6  # in the vector part of the store
    qkv[7, (heads + kv_heads) * d - 1] = float("nan")  # a NaN stays NaN
    cos, sin = torch.randn(64, d), torch.randn(64, d)
    pos, slots = torch.arange(rows), torch.randperm(64)[:rows]
    k16 = torch.zeros(64, kv_heads, d, dtype=torch.float16)
    v16 = torch.zeros_like(k16)
    k32, v32 = torch.zeros(64, kv_heads, d), torch.zeros(64, kv_heads, d)
    a, b = qkv.clone(), qkv.clone()
    ops16.rope_store(a, heads, kv_heads, pos, cos, sin, slots, k16, v16)
    ops.rope_store(b, heads, kv_heads, pos, cos, sin, slots, k32, v32)
    exact = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}
    torch.testing.assert_close(a, b, **exact)  # q and k rotated alike
    assert not k16.isinf().any() and bool(k16.isnan().any())  # NaN kept, no inf made
    torch.testing.assert_close(k16, to_cache(k32, torch.float16), **exact)  # the torch path's
    torch.testing.assert_close(k16, k32.clamp(-65504, 65504).half(), **exact)
    assert torch.equal(v16, v32.half())
    k16[k16.isnan()] = 0  # attention below over finite keys
    k32[k32.isnan()] = 0
    kw, vw = k16.float(), v16.float()  # what the fp16 build reads
    blocks = torch.randperm(4)
    tables = blocks.view(1, -1).expand(3, -1).contiguous()
    lens = torch.tensor([1, 33, 64])
    q = torch.randn(3, stride)
    out16, out32 = torch.empty(3, heads, d), torch.empty(3, heads, d)
    ops16.decode_attention(q, 3, heads, k16, v16, bs, tables, lens, 0.125, out16)
    ops.decode_attention(q, 3, heads, kw, vw, bs, tables, lens, 0.125, out32)
    assert torch.equal(out16, out32)
    p16, p32 = torch.empty(rows, heads, d), torch.empty(rows, heads, d)
    ops16.prefill_attention(qkv, heads, k16, v16, bs, blocks, 64, 0.125, p16)
    ops.prefill_attention(qkv, heads, kw, vw, bs, blocks, 64, 0.125, p32)
    assert torch.equal(p16, p32)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def test_rope_store_rotates_q_and_k_and_stores_k_and_v(ops):
    torch.manual_seed(0)
    heads, kv_heads, d, rows = 6, 2, 16, 5
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    cos, sin = torch.randn(40, d), torch.randn(40, d)
    positions, slots = torch.tensor([3, 39, 0, 7, 8]), torch.tensor([11, 2, 5, 0, 9])
    k_slots, v_slots = torch.zeros(12, kv_heads, d), torch.zeros(12, kv_heads, d)
    qk = qkv[:, : (heads + kv_heads) * d].view(rows, -1, d)
    expected = rotate_half(qk, cos[positions][:, None], sin[positions][:, None])
    v = qkv[:, (heads + kv_heads) * d :].view(rows, kv_heads, d).clone()
    ops.rope_store(qkv, heads, kv_heads, positions, cos, sin, slots, k_slots, v_slots)
    torch.testing.assert_close(qk, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_slots[slots], expected[:, heads:])
    assert torch.equal(v_slots[slots], v)
    untouched = [s for s in range(12) if s not in slots.tolist()]
    assert not k_slots[untouched].any() and not v_slots[untouched].any()


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 4), (8, 2), (10, 2)])
def test_decode_attention_reads_the_paged_cache_in_place(ops, block_size, heads, kv_heads):
    """Query groups of 3 (SmolLM2), 1, 2, 4 and 5 heads: the scores go three heads at a time."""
    torch.manual_seed(1)
    d, num_blocks = 64, 40
    ctx_lens = [1, 7, 8, 9, 33, 70]  # across the 8-key vector path and its scalar tail
    width = max(-(-n // block_size) for n in ctx_lens)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d)
    order = torch.randperm(num_blocks)  # scattered blocks, none shared
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(ctx_lens):
        count = -(-n // block_size)
        tables[i, :count] = order[used : used + count]
        used += count
    stride = (heads + 2 * kv_heads) * d
    qkv = torch.randn(len(ctx_lens), stride)
    out = torch.empty(len(ctx_lens), heads, d)
    scale = 1 / math.sqrt(d)
    ops.decode_attention(
        qkv,
        len(ctx_lens),
        heads,
        k_cache.view(-1, kv_heads, d),
        v_cache.view(-1, kv_heads, d),
        block_size,
        tables,
        torch.tensor(ctx_lens),
        scale,
        out,
    )
    for i, n in enumerate(ctx_lens):
        keys = k_cache[tables[i]].reshape(-1, kv_heads, d)[:n].transpose(0, 1)
        values = v_cache[tables[i]].reshape(-1, kv_heads, d)[:n].transpose(0, 1)
        q = qkv[i, : heads * d].view(heads, 1, d)
        expected = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], enable_gqa=True, scale=scale
        )[0, :, 0]
        torch.testing.assert_close(out[i], expected, atol=2e-5, rtol=1e-4)


def test_decode_attention_of_a_row_does_not_depend_on_its_batch(ops):
    torch.manual_seed(2)
    heads, kv_heads, d, bs = 4, 2, 32, 8
    k = torch.randn(64, kv_heads, d)
    v = torch.randn(64, kv_heads, d)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d)
    tables = torch.tensor([[3, 1, 0], [7, 6, 0], [2, 4, 5]])
    lens = torch.tensor([12, 9, 21])
    batched = torch.empty(3, heads, d)
    ops.decode_attention(qkv, 3, heads, k, v, bs, tables, lens, 0.5, batched)
    alone = torch.empty(1, heads, d)
    ops.decode_attention(qkv[2:], 1, heads, k, v, bs, tables[2:], lens[2:], 0.5, alone)
    assert torch.equal(alone[0], batched[2])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_attention_runs_of_sequences_cover_the_batch_whatever_the_threads(ops, threads):
    """Many sequences: each thread takes a run of whole sequences balanced by context length
    (and fetches the next one's rows early); every row still equals its result alone."""
    torch.manual_seed(3)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    lens = torch.tensor([300, 1, 17, 9, 128, 2, 64, 33, 250, 5, 70])
    width = int(-(-lens.max() // bs))
    num_blocks = int(sum(-(-n // bs) for n in lens.tolist()))
    k, v = torch.randn(num_blocks * bs, kv_heads, d), torch.randn(num_blocks * bs, kv_heads, d)
    order, tables, used = (
        torch.randperm(num_blocks),
        torch.zeros(len(lens), width, dtype=torch.long),
        0,
    )
    for i, n in enumerate(lens.tolist()):
        tables[i, : -(-n // bs)] = order[used : used + -(-n // bs)]
        used += -(-n // bs)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = torch.full((len(lens), heads, d), float("nan"))
        ops.decode_attention(qkv, len(lens), heads, k, v, bs, tables, lens, 0.125, batched)
        for i in range(len(lens)):
            alone = torch.empty(1, heads, d)
            part = slice(i, i + 1)
            ops.decode_attention(
                qkv[part], 1, heads, k, v, bs, tables[part], lens[part], 0.125, alone
            )
            assert torch.equal(alone[0], batched[i]), i
    finally:
        torch.set_num_threads(before)


def _prefill_case(seed: int, heads: int, kv_heads: int, d: int, bs: int, ctx: int, rows: int):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-ctx // bs) + 3
    k = torch.randn(num_blocks * bs, kv_heads, d, generator=gen)
    v = torch.randn(num_blocks * bs, kv_heads, d, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[: -(-ctx // bs)]
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
    return k, v, table, qkv


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "bs", "ctx", "rows"),
    [
        (9, 3, 64, 16, 70, 70),  # a fresh prefill: blocks of 4 rows x 3 heads, a tail block
        (9, 3, 64, 16, 300, 37),  # after a cached prefix of 263 tokens
        (4, 1, 32, 4, 19, 11),  # group 4: blocks of 3 rows
        (3, 3, 16, 8, 5, 5),  # no grouping
        (2, 2, 12, 4, 9, 4),  # d not a multiple of 8: the per-row path
    ],
)
def test_prefill_attention_is_causal_attention_over_the_paged_cache(
    ops, heads, kv_heads, d, bs, ctx, rows
):
    k, v, table, qkv = _prefill_case(5, heads, kv_heads, d, bs, ctx, rows)
    out = torch.empty(rows, heads, d)
    ops.prefill_attention(qkv, heads, k, v, bs, table, ctx, 0.3, out)
    keys = k.view(-1, bs, kv_heads, d)[table].reshape(-1, kv_heads, d)[:ctx].transpose(0, 1)
    values = v.view(-1, bs, kv_heads, d)[table].reshape(-1, kv_heads, d)[:ctx].transpose(0, 1)
    q = qkv[:, : heads * d].view(rows, heads, d).transpose(0, 1)
    mask = torch.ones(rows, ctx, dtype=torch.bool).tril(ctx - rows)  # row r sees ctx-rows+r+1
    expected = F.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=mask, enable_gqa=True, scale=0.3
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_prefill_attention_of_a_row_does_not_depend_on_its_chunk(ops):
    """Chunked prefill: a row gives the same bits whichever chunk (and row block) holds it."""
    heads, kv_heads, d, bs, ctx = 9, 3, 64, 16, 90
    k, v, table, qkv = _prefill_case(6, heads, kv_heads, d, bs, ctx, ctx)
    whole = torch.empty(ctx, heads, d)
    ops.prefill_attention(qkv, heads, k, v, bs, table, ctx, 0.125, whole)
    for start, end in ((0, 13), (13, 14), (14, 61), (61, 90)):
        part = torch.empty(end - start, heads, d)
        ops.prefill_attention(qkv[start:end], heads, k, v, bs, table, end, 0.125, part)
        assert torch.equal(part, whole[start:end]), (start, end)


def test_silu_mul_and_rms_norms(ops):
    torch.manual_seed(3)
    gate_up = torch.randn(5, 2 * 44) * 6  # 44: the vector path and a scalar tail per row
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0  # exp's clamped range
    got = ops.silu_mul(gate_up)
    expected = F.silu(gate_up[:, :44]) * gate_up[:, 44:]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    x = torch.randn(1, 576)
    eps = 1e-5
    want = 1 / math.sqrt(float((x.double() ** 2).mean()) + eps)
    assert ops.rms_scale(x, eps) == pytest.approx(want, rel=1e-6)
    rows = torch.randn(3, 576) * 3
    expected = rows * torch.rsqrt(rows.pow(2).mean(dim=1, keepdim=True) + eps)
    torch.testing.assert_close(ops.rms_normalize(rows, eps), expected, atol=1e-6, rtol=1e-5)


def test_lora_add_is_each_rows_low_rank_update(ops):
    """kernels/ops.c lora_rows (what the fused decoder adds after a projection, issue 32):
    y[t] += (x[t] / RMS(x[t]) A^T) B^T of row t's adapter, nothing for a base row (-1) or
    an adapter without that projection; ranks and widths off the vector width."""
    torch.manual_seed(5)
    n_in, n_out = 40, 50
    lows = [(torch.randn(r, n_in), torch.randn(r, n_out)) for r in (5, 17)]
    tables = [lora_table([[None] * 4, [None, None, low, None]]) for low in lows]
    tables.append(lora_table([[None] * 4, [lows[0], None, None, None]]))  # not projection 2
    slots = (ctypes.c_void_p * 3)(*(ctypes.addressof(t) for t in tables))
    row_slot = torch.tensor([0, -1, 1, 0, 2, 1], dtype=torch.int32)
    rows = LoraRows(row_slot, slots, adapts_gate_up=True)
    x, y0 = torch.randn(6, n_in) * 3, torch.randn(6, n_out)
    for eps in (None, 1e-5):
        y = y0.clone()
        ops.lora_add(rows, 1, 2, x, y, eps)
        xn = x if eps is None else x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + eps)
        expected = y0.clone()
        for t, slot in enumerate(row_slot.tolist()):
            if slot in (0, 1):
                a, b_t = lows[slot]
                expected[t] += (xn[t] @ a.t()) @ b_t
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)
        assert torch.equal(y[[1, 4]], y0[[1, 4]])
    with pytest.raises(ValueError, match="rank 300"):
        lora_table([[(torch.randn(300, 8), torch.randn(300, 8)), None, None, None]])


def test_glu_act_is_silu_mul_in_the_packed_glu_order(ops):
    """The activation after a gate/up LoRA update: per 32 columns 16 gate then their 16 up
    (quant.glu_rows), as the quantized glu kernel's own store computes it."""
    torch.manual_seed(6)
    g = torch.randn(3, 2 * 48) * 6
    tiles = g.view(3, 3, 2, 16)
    expected = (F.silu(tiles[:, :, 0]) * tiles[:, :, 1]).reshape(3, 48)
    torch.testing.assert_close(ops.glu_act(g), expected, atol=1e-6, rtol=1e-5)
