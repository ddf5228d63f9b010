"""int8 / int4 weight-only quantized projections of the native engine: the kernels against
an fp64 reference in every instruction-set build this CPU executes (cbuild.runnable_isas:
AVX-512 VNNI, AVX-512, AVX2, scalar; the one this machine serves with among them), the
screened greedy head in each, the GGUF blocks loaded packed against gguf's own
dequantization, and the quality check on SmolLM2."""

from __future__ import annotations

import pytest
import torch

from tandem import cbuild
from tandem.engines.native import quant, quant_screen
from tandem.engines.native.attention import AttentionMetadata, PrefillSpan, SingleDecode
from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import build_model
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.loader import default_model_path
from tandem.engines.native.model import LlamaModel
from tandem.engines.native.ops import CpuOps
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions
from tandem.tokens.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(300)

FORMATS = ("int8", "int4")


VARIANTS = tuple(cbuild.runnable_isas())  # every build this CPU executes, widest first
SERVING = cbuild.select_isa()[0]  # the build this machine serves with (TANDEM_NATIVE_ISA or widest)
ROW_COUNTS = (1, 2, 3, 4, 5, 8, 13, 32, 64, 512)


@pytest.fixture(scope="module")
def libs():
    return {v: quant.load_library(quant.build(v)) for v in VARIANTS}


def rounded_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The activations a build multiplies, in fp64: fp32 ones as they are (bits 32), or, for
    the VNNI build (bits 15), each group of 32 rounded to integers of `bits` bits times its
    scale max|x| / (2^(bits-1) - 1), ties to even (kernels/quant.c)."""
    if bits == 32:
        return x.double()
    top = 2 ** (bits - 1) - 1
    g = x.float().view(x.shape[0], -1, quant.GROUP)
    s = g.abs().amax(-1, keepdim=True) / top
    q = torch.where(s > 0, torch.round(g / s), torch.zeros_like(g)).clamp(-top, top)
    return (q.double() * s.double()).view(x.shape)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(1537, 576), (77, 64), (33, 1536)])
def test_kernel_matches_fp64_reference(libs, fmt, variant, n, k):
    gen = torch.Generator().manual_seed(n + k)
    source = quant.convert(torch.randn(n, k, generator=gen), fmt)
    w, dense = quant.pack(source, libs[variant]), quant.dequantize(source).double()
    col_scale = torch.rand(k, generator=gen) + 0.5
    for rows in ROW_COUNTS:
        x, residual = torch.randn(rows, k, generator=gen), torch.randn(rows, n, generator=gen)
        y = quant.matmul(w, x, residual, alpha=0.7, col_scale=col_scale, lib=libs[variant])
        xa = rounded_activations(0.7 * (x * col_scale), quant.activation_bits(libs[variant]))
        ref = xa @ dense.T + residual.double()
        err = (y.double() - ref).abs().max().item()
        assert err < 2e-6 * k**0.5 * ref.abs().max().item(), (rows, err)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_bit_identical_whatever_batch_they_ride_in(libs, fmt, variant):
    """A row's output does not depend on the row count nor on its position (exactness of
    batching, chunked prefill): every path of a build does the same arithmetic per row."""
    gen = torch.Generator().manual_seed(1)
    lib = libs[variant]
    n, k = 99, 576
    w = quant.pack(quant.convert(torch.randn(n, k, generator=gen), fmt), lib)
    x, res = torch.randn(600, k, generator=gen), torch.randn(600, n, generator=gen)
    col_scale = torch.rand(k, generator=gen) + 0.5
    together = quant.matmul(w, x, res, alpha=0.5, col_scale=col_scale, lib=lib)
    for rows in ROW_COUNTS:
        for start in (0, 7, 600 - rows):
            part = slice(start, start + rows)
            alone = quant.matmul(w, x[part], res[part], alpha=0.5, col_scale=col_scale, lib=lib)
            assert torch.equal(alone, together[part]), (rows, start)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_glu_projection_is_silu_of_gate_times_up_bit_for_bit(libs, fmt, variant):
    """glu=True (gate/up rows interleaved by `glu_rows`) gives exactly what the separate
    projection and ops.silu_mul give: each column's sums are the same, and the activation is
    the same operations (kernels/vmath.h) in every build; rows stay batch-independent."""
    from tandem.engines.native.ops import cpu_ops

    gen = torch.Generator().manual_seed(7)
    lib, ffn, k = libs[variant], 96, 576
    source = quant.convert(torch.randn(2 * ffn, k, generator=gen) * 0.1, fmt)
    plain, fused = quant.pack(source, lib), quant.pack(quant.glu_rows(source), lib)
    col_scale = torch.rand(k, generator=gen) + 0.5
    x = torch.randn(64, k, generator=gen)
    together = quant.matmul(fused, x, alpha=0.5, col_scale=col_scale, glu=True, lib=lib)
    gate_up = quant.matmul(plain, x, alpha=0.5, col_scale=col_scale, lib=lib)
    ops = cpu_ops(torch.float32)
    assert ops is not None
    assert together.shape == (64, ffn)
    assert torch.equal(together, ops.silu_mul(gate_up))
    for rows in (1, 3, 13):
        alone = quant.matmul(
            fused, x[5 : 5 + rows], alpha=0.5, col_scale=col_scale, glu=True, lib=lib
        )
        assert torch.equal(alone, together[5 : 5 + rows]), rows
    with pytest.raises(ValueError, match="glu needs N a multiple of 32"):
        quant.matmul(quant.pack(quant.convert(torch.randn(48, k), fmt), lib), x, glu=True, lib=lib)
    with pytest.raises(ValueError, match="a glu weight needs a multiple of 32 rows"):
        quant.glu_rows(quant.convert(torch.randn(48, k), fmt))


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_rms_norm_normalizes_each_row_alone(libs, variant):
    """norm_eps divides each row by its RMS inside the kernel: the result is the projection
    of the normalized rows (to fp32 rounding of the factor), and a row's result does not
    depend on what it is batched with."""
    gen = torch.Generator().manual_seed(3)
    lib, n, k, eps = libs[variant], 77, 576, 1e-5
    w = quant.pack(quant.convert(torch.randn(n, k, generator=gen), "int4"), lib)
    col_scale = torch.rand(k, generator=gen) + 0.5
    x = torch.randn(40, k, generator=gen) * torch.rand(40, 1, generator=gen) * 10
    res = torch.randn(40, n, generator=gen)
    y = quant.matmul(w, x, res, col_scale=col_scale, norm_eps=eps, lib=lib)
    normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    ref = quant.matmul(w, normed.float(), res, col_scale=col_scale, lib=lib)
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    for start, rows in ((0, 1), (9, 4), (20, 20)):
        alone = quant.matmul(
            w, x[start : start + rows], res[start : start + rows], col_scale=col_scale,
            norm_eps=eps, lib=lib,
        )  # fmt: skip
        assert torch.equal(alone, y[start : start + rows]), (start, rows)


def test_quant_linear_glu_and_norm_agree_on_the_c_and_torch_paths(monkeypatch):
    gen = torch.Generator().manual_seed(11)
    w = quant.quantize_q4(torch.randn(64, 96, generator=gen))
    col_scale = torch.rand(96, generator=gen) + 0.5
    x = torch.randn(5, 96, generator=gen)
    c_path = quant.QuantLinear(w, col_scale=col_scale, glu=True)
    monkeypatch.setenv(quant.KERNELS_ENV, "torch")
    torch_path = quant.QuantLinear(w, col_scale=col_scale, glu=True)
    assert c_path.out_features == torch_path.out_features == 32
    a, b = c_path(x, norm_eps=1e-5), torch_path(x, norm_eps=1e-5)
    assert a.shape == b.shape == (5, 32)
    # the C build may round activations (15 bits on VNNI, 13 on AVX2): agreement to that rounding
    assert torch.allclose(a, b, rtol=1e-3, atol=1e-3 * b.abs().max().item())
    with pytest.raises(ValueError, match="no residual"):
        torch_path(x, torch.zeros(5, 32))
    with pytest.raises(ValueError, match="a glu weight needs a multiple of 32 rows"):
        quant.QuantLinear(quant.quantize_q4(torch.randn(48, 96)), glu=True)
    # the fp32 Linear honours norm_eps too (the forwards normalize before it instead)
    from tandem.engines.native.linear import Linear

    dense = Linear(quant.dequantize(w), pack=False)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(dense(x, norm_eps=1e-5), dense(normed), rtol=1e-5, atol=1e-5)


@pytest.fixture(params=VARIANTS)
def isa(request, monkeypatch) -> str:
    """Each build this CPU executes, forced as TANDEM_NATIVE_ISA forces it (quant.kernels()
    and everything built on it then run that build)."""
    monkeypatch.setenv(cbuild.ISA_ENV, request.param)
    assert cbuild.select_isa()[0] == request.param
    return str(request.param)


def screened(
    n: int, k: int, fmt: str, seed: int
) -> tuple[quant.QuantLinear, quant_screen.ArgmaxScreen]:
    """A projection and its screen in the build quant.kernels() picks (the screen on, also
    where it does not serve by default)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[n // 2] = w[1]  # equal columns: equal logits, the first must win
    w[n - 1] = w[1]
    weight = quant.convert(w, fmt)
    linear = quant.QuantLinear(weight, col_scale=torch.rand(k, generator=g) + 0.5)
    return linear, quant_screen.ArgmaxScreen(linear, weight, enabled=True)


# every build on small heads; SmolLM2's head size (~8 s to build a screen) where the screen
# serves (VNNI); test_screen_of_smollm2s_head_in_every_build has that size in every build
SCREEN_CASES = [
    *((v, n, k) for v in VARIANTS for n, k in [(1000, 576), (33, 64), (31, 64), (64, 96)]),
    *([("avx512vnni", 49152, 576)] if "avx512vnni" in VARIANTS else []),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("isa", "n", "k"), SCREEN_CASES, indirect=["isa"])
def test_screened_argmax_is_the_full_logits_argmax(isa, fmt, n, k):
    """Rows of every kind (random, a row that is a small negative multiple of another so its
    logits are all near zero, zero rows, rows whose logits are all negative over a padded
    last tile) pick exactly the column `linear(x).max(-1)` picks, for 1..33 rows (one VR
    block and odd remainders)."""
    linear, screen = screened(n, k, fmt, seed=n + k)
    assert screen.available
    g = torch.Generator().manual_seed(7)
    for rows in (1, 2, 3, 5, 8, 33):
        x = torch.randn(rows, k, generator=g) * 3
        if rows > 2:
            x[rows // 2] = x[0] * -0.01
            x[1] = 0.0
        full = linear(x)
        assert screen(x) == full.max(-1).indices.tolist(), rows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [33, 63, 1000])
def test_screened_argmax_ignores_the_padding_of_the_last_tile(isa, fmt, n):
    """Positive weights and negative rows: every logit is negative, so the zero columns that
    pad the last tile to 32 would win if the screen looked at them."""
    g = torch.Generator().manual_seed(n)
    weight = quant.convert(torch.rand(n, 64, generator=g) + 0.1, fmt)
    linear = quant.QuantLinear(weight)
    screen = quant_screen.ArgmaxScreen(linear, weight, enabled=True)
    x = -torch.rand(4, 64, generator=g) - 0.5
    full = linear(x)
    assert bool((full < 0).all())
    assert screen(x) == full.max(-1).indices.tolist()
    assert all(0 <= p < n for p in screen(x) or [])


@pytest.mark.parametrize("fmt", FORMATS)
def test_screened_argmax_prefers_the_first_of_equal_columns(isa, fmt):
    """Columns 1, n/2 and n-1 hold the same weights, so their logits are equal; a row along
    them makes that the maximum, and the pick must be column 1, as torch's max picks."""
    n, k = 1000, 576
    linear, screen = screened(n, k, fmt, seed=11)
    assert linear.col_scale is not None
    column = torch.randn(n, k, generator=torch.Generator().manual_seed(11))[1]  # screened's w[1]
    along = torch.randn(2, k, generator=torch.Generator().manual_seed(2)) * 0.01
    along += column / linear.col_scale
    full = linear(along)
    assert full[:, 1].tolist() == full[:, n // 2].tolist() == full[:, n - 1].tolist()
    assert full.max(-1).indices.tolist() == [1, 1]
    assert screen(along) == [1, 1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3e38])
def test_screened_argmax_on_non_finite_rows_matches_or_defers(isa, bad):
    """A NaN, inf or huge activation: the screen answers what the full kernel answers, or
    None (a NaN logit: the head then takes the full logits, as QuantHead.greedy does)."""
    linear, screen = screened(1000, 576, "int8", seed=5)
    x = torch.randn(4, 576)
    x[2, 5] = bad
    picks = screen(x)
    full = linear(x)
    if bool(full.isnan().any()):
        assert picks is None
    else:
        assert picks == full.max(-1).indices.tolist()


def test_builds_use_the_vectors_they_were_compiled_for(libs):
    """Each build runs the path it is named for: its vector width, and integer activations
    (15 bits on the VNNI build, 13 on the AVX2 one); the build this machine serves with is
    among those tested."""
    expected = {"avx512vnni": (512, 15), "avx512": (512, 32), "avx2": (256, 13), "scalar": (0, 32)}
    assert set(expected) == set(cbuild.ISAS)
    for isa, lib in libs.items():
        assert (lib.tq_isa(), quant.activation_bits(lib)) == expected[isa], isa
    assert SERVING in libs and "scalar" in libs
    assert len({quant.build(isa) for isa in VARIANTS}) == len(VARIANTS)  # one library each
    assert all(f"tq-{isa}-" in quant.build(isa).name for isa in VARIANTS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_head_serves_the_screen_on_vnni_and_the_full_logits_elsewhere(isa, fmt):
    """What QuantHead.greedy runs in each build: the screen on the VNNI build (measured faster
    there), the full logits' argmax on the fp32 builds (their screen is slower than their
    full head), and the same picks either way."""
    from tandem.engines.native.quant_model import QuantHead

    g = torch.Generator().manual_seed(5)
    weight = quant.convert(torch.randn(1000, 576, generator=g) * 0.05, fmt)
    head = QuantHead(quant.QuantLinear(weight), weight)
    assert head.screen.available == (isa == "avx512vnni")
    assert (head.screen.num_bytes > 0) == head.screen.available
    x = torch.randn(9, 576, generator=g)
    calls = []
    real = head.logits
    head.logits = lambda x: calls.append(1) or real(x)  # type: ignore[method-assign]
    picks = head.greedy(x)
    assert picks == real(x).max(-1).indices.tolist()
    assert len(calls) == (0 if head.screen.available else 1)


def test_q4_converts_to_int8_exactly():
    w4 = quant.quantize_q4(torch.randn(32, 96))
    # d / 17 * (17 q) rounds once more than d * q: equal to the last bit or two
    err = (quant.dequantize(quant.q4_to_q8(w4)) - quant.dequantize(w4)).abs().max()
    assert err < 1e-6


def test_gguf_blocks_load_packed_equal_to_ggufs_own_dequantization():
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(default_model_path())
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in ("Q4_1", "Q8_0") or kind in seen:
            continue
        seen.add(kind)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        packed = quant.from_gguf_blocks(tensor.data, kind, shape)
        expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(shape))
        assert torch.equal(quant.dequantize(packed), expected.float()), kind
    assert seen == {"Q4_1", "Q8_0"}


# ---------------------------------------------------------------- quality on SmolLM2
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning Python.",
    "Describe a cat in two sentences.",
]
NUM_TOKENS = 24
# The fp32 engine serves the GGUF's Q4_1 weights dequantized, and both quantized formats
# hold exactly those values (int8 is asymmetric: q8 = 17 q4), so what differs is the order
# of the fp32 additions (~1e-6 relative on a logit) and, on a VNNI build, the activations
# rounded to 15 bits per group of 32 (measured: mean KL 3e-7, every token the same), and
# the fp16 KV cache `auto` gives quantized weights (with it: 8.7e-7 int4, 9.2e-7 int8).
# Agreement must then be near-total and the KL divergence orders of magnitude under what a
# real re-rounding costs (measured: symmetric int8 weights or 8-bit activations gave KL
# 1.5e-3 to 5e-3 and 70-77 % agreement). The bound 1e-4 leaves room for near-ties only.
MAX_MEAN_KL = 1e-4
MIN_AGREEMENT = 0.95


@pytest.fixture(scope="module")
def models() -> dict[str, LlamaModel]:
    torch.set_num_threads(1)
    return {
        fmt: build_model(NativeConfig(weights=fmt, max_model_len=512))[0]
        for fmt in ("fp32", *FORMATS)
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = load_tokenizer("gguf:" + default_model_path())
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return [tok.encode(chat.format(q), add_special_tokens=False) for q in QUESTIONS]


def greedy(model: LlamaModel, fmt: str, prompts: list[list[int]]) -> list[list[int]]:
    core = EngineCore(NativeConfig(weights=fmt, num_blocks=128, num_threads=1), model)
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        core.add(
            PreprocessedRequest(
                request_id=f"r{i}",
                model="m",
                token_ids=prompt,
                sampling=SamplingParams(temperature=0.0),
                stop=StopConditions(max_tokens=NUM_TOKENS),
            )
        )
        out[f"r{i}"] = []
    while core.has_work():
        for request_id, chunk in core.step():
            out[request_id] += chunk.token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


def logits(model: LlamaModel, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Teacher-forced next-token logits at every position (one prefill)."""
    return model.head.logits(hidden(model, token_ids, block_size))


def hidden(model: LlamaModel, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Teacher-forced final hidden states (the head's input) at every position."""
    n, num_blocks = len(token_ids), -(-len(token_ids) // block_size)
    pos = torch.arange(n)
    meta = AttentionMetadata(
        slot_mapping=pos,
        cos=model.cos[pos].unsqueeze(1),
        sin=model.sin[pos].unsqueeze(1),
        prefills=[
            PrefillSpan(
                start=0, end=n, ctx_len=n, context_blocks=torch.arange(num_blocks), mask=None
            )
        ],
    )
    with torch.inference_mode():
        cache = model.new_kv_cache(num_blocks, block_size)
        return model.hidden(torch.tensor(token_ids), meta, cache, pos)


@pytest.mark.native
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_engine_agrees_with_fp32(models, prompts, fmt):
    ref = greedy(models["fp32"], "fp32", prompts)
    out = greedy(models[fmt], fmt, prompts)
    agree = total = 0
    kls = []
    for prompt, a, b in zip(prompts, ref, out, strict=True):
        same = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        agree, total = agree + min(same, len(a)), total + len(a)
        ids = prompt + a[:-1]
        lp = torch.log_softmax(logits(models["fp32"], ids)[len(prompt) - 1 :], -1)
        lq = torch.log_softmax(logits(models[fmt], ids)[len(prompt) - 1 :], -1)
        kls.append(float((lp.exp() * (lp - lq)).sum(-1).mean()))
    assert agree / total >= MIN_AGREEMENT, (agree, total, ref, out)
    assert sum(kls) / len(kls) < MAX_MEAN_KL, kls
    assert models[fmt].weight_bytes() < models["fp32"].weight_bytes() / 2.5


@pytest.mark.native
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_head_greedy_is_the_argmax_of_its_logits(models, prompts, fmt, monkeypatch):
    """SmolLM2's head (49152 columns) on real hidden states: the head's greedy pick (the
    screen where it serves) is the argmax of its full logits at every position, in batches of
    every size."""
    model = models[fmt]
    x = torch.cat([hidden(model, p) for p in prompts])
    assert model.head.screen.available == (quant.activation_bits() == 15)
    expected = model.head.logits(x).max(-1).indices.tolist()
    for rows in (1, 2, 7, 32, len(x)):
        got = [t for i in range(0, len(x), rows) for t in model.head.greedy(x[i : i + rows])]
        assert got == expected, rows


@pytest.mark.native
def test_screen_of_smollm2s_head_in_every_build(models, prompts, monkeypatch):
    """In every build this CPU executes, the screen (forced on) over SmolLM2's head (int8 in
    both formats) picks the argmax of that build's full logits on real hidden states."""
    from tandem.engines.native.loader import load_quant_weights

    model = models["int8"]
    head_q8 = quant.convert(
        load_quant_weights(None, "int8")[2]["model.embed_tokens.weight"], "int8"
    )
    x = torch.cat([hidden(model, p) for p in prompts])[:48]
    for isa in VARIANTS:
        monkeypatch.setenv(cbuild.ISA_ENV, isa)
        linear = quant.QuantLinear(head_q8, col_scale=model.final_norm)
        screen = quant_screen.ArgmaxScreen(linear, head_q8, enabled=True)
        expected = linear(x).max(-1).indices.tolist()
        for rows in (1, 7, len(x)):
            got = [t for i in range(0, len(x), rows) for t in screen(x[i : i + rows]) or []]
            assert got == expected, (isa, rows)


def test_weights_auto_is_int4_where_the_kernels_build(monkeypatch):
    import argparse

    from tandem.engines.native.args import add_args, config_from_args

    parser = argparse.ArgumentParser()
    add_args(parser)
    assert config_from_args(parser.parse_args([])).weights == "int4"
    assert config_from_args(parser.parse_args(["--weights", "fp32"])).weights == "fp32"
    assert quant.auto_weights("bfloat16") == "fp32"  # the kernels are fp32-activation only
    assert quant.auto_weights("float32", "cuda") == "fp32"  # the torch path: correct, slow

    def no_compiler() -> None:
        raise quant.QuantKernelError("building the int8/int4 kernels: gcc: not found")

    monkeypatch.setattr(quant, "kernels", no_compiler)
    assert config_from_args(parser.parse_args([])).weights == "fp32"


# ---------------------------------------------------------------- torch path (any device)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(1537, 576), (77, 64)])
def test_torch_path_equals_dequantized_matmul(fmt, n, k):
    """The path a CUDA device runs (and the CPU under TANDEM_QUANT_KERNELS=torch) is
    x @ dequantize(W)^T with the activation scaling and residual of the C kernels."""
    gen = torch.Generator().manual_seed(n * k)
    w = quant.convert(torch.randn(n, k, generator=gen), fmt)
    dense = quant.dequantize(w)
    # both compute d * q + m per element (an fma here, so equal); allow one rounding of the
    # operands for a platform whose torch or C build does not fuse it
    err = (quant.dequantize_torch(w) - dense).abs().max().item()
    assert err <= 1e-6 * dense.abs().max().item(), err
    col_scale = torch.rand(k, generator=gen) + 0.5
    for rows in (1, 3, 64):
        x, residual = torch.randn(rows, k, generator=gen), torch.randn(rows, n, generator=gen)
        y = quant.matmul_torch(w, x, residual, alpha=0.7, col_scale=col_scale)
        ref = (0.7 * x.double() * col_scale.double()) @ dense.double().T + residual.double()
        err = (y.double() - ref).abs().max().item()
        assert err < 2e-6 * k**0.5 * ref.abs().max().item(), (rows, err)
        plain = quant.matmul_torch(w, x)
        assert torch.allclose(plain, x @ dense.T, rtol=1e-5, atol=1e-5)


def test_quant_linear_takes_the_torch_path_off_the_cpu_or_when_told(monkeypatch):
    w = quant.quantize_q4(torch.randn(64, 96))
    assert isinstance(quant.QuantLinear(w).weight, quant.PackedWeight)  # CPU default: C
    monkeypatch.setenv(quant.KERNELS_ENV, "torch")
    forced = quant.QuantLinear(w)
    assert forced.weight is w and forced.in_features == 96
    x = torch.randn(2, 96)
    assert torch.allclose(forced(x), x @ quant.dequantize(w).T, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(quant.KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="TANDEM_QUANT_KERNELS='cuda'; expected one of: c, torch"):
        quant.QuantLinear(w)
    monkeypatch.delenv(quant.KERNELS_ENV)
    # a device the C kernels cannot read (meta: shapes only) never reaches them
    meta = quant.Q4Weight(*(t.to("meta") for t in w))
    on_meta = quant.QuantLinear(meta, col_scale=torch.ones(96, device="meta"))
    assert on_meta.weight is meta
    y = on_meta(torch.empty(3, 96, device="meta"), torch.empty(3, 64, device="meta"), alpha=0.5)
    assert y.device.type == "meta" and tuple(y.shape) == (3, 64)


def _mixed_step(model: LlamaModel, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill two sequences (one step, two spans), then one step of both decoding beside a
    third sequence's prefill chunk, then a batch-1 decode of the first: the hidden states of
    each step and the cache, with every layer in one C call or layer by layer."""
    bs, gen = 16, torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 49152, (n,), generator=gen) for n in (37, 20, 23)]
    tables = [[5, 2, 9], [0, 7], [3, 1]]  # scattered blocks
    model.fuse_layers = fused
    try:
        with torch.inference_mode():
            cache = model.new_kv_cache(10, bs)

            def slots(t: int, positions: range) -> list[int]:
                return [tables[t][p // bs] * bs + p % bs for p in positions]

            def span(t: int, start: int, first: int, n: int) -> PrefillSpan:
                blocks = torch.tensor(tables[t][: -(-(first + n) // bs)])
                return PrefillSpan(
                    start=start, end=start + n, ctx_len=first + n, context_blocks=blocks, mask=None
                )

            pos = torch.tensor([*range(36), *range(20)])
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots(0, range(36)) + slots(1, range(20))),
                cos=model.cos[pos].unsqueeze(1), sin=model.sin[pos].unsqueeze(1),
                prefills=[span(0, 0, 0, 36), span(1, 36, 0, 20)], positions=pos,
            )  # fmt: skip
            x = torch.cat([ids[0][:36], ids[1]])
            first = model.hidden(x, meta, cache, torch.tensor([35, 55]))
            pos = torch.tensor([36, 20, *range(23)])
            width = 3
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots(0, range(36, 37)) + slots(1, range(20, 21))
                                          + slots(2, range(23))),
                cos=model.cos[pos].unsqueeze(1), sin=model.sin[pos].unsqueeze(1),
                num_decode=2, prefills=[span(2, 2, 0, 23)], positions=pos,
                decode_blocks=torch.tensor(tables[0] + tables[1] + [0] * (width - 2)),
                decode_lens=torch.tensor([37, 21]),
            )  # fmt: skip
            x = torch.cat([ids[0][36:], torch.tensor([11]), ids[2]])
            second = model.hidden(x, meta, cache, torch.tensor([0, 1, 24]))
            step = SingleDecode(
                slot=tables[0][37 // bs] * bs + 37 % bs, ctx_len=38, table=tables[0]
            )
            third = model.decode_one(123, step, cache)
    finally:
        model.fuse_layers = True
    return torch.cat([first, second, third]), cache


@pytest.mark.native
@pytest.mark.parametrize("fmt", FORMATS)
def test_decoder_in_one_c_call_equals_the_layer_by_layer_calls(models, fmt, monkeypatch):
    model = models[fmt]
    calls = []
    real = CpuOps.decoder
    monkeypatch.setattr(CpuOps, "decoder", lambda *a, **k: calls.append(1) or real(*a, **k))
    embed = model.embed.clone()
    h_fused, cache_fused = _mixed_step(model, fused=True)
    assert len(calls) == 3, "a quantized model on the CPU runs all its layers in one call"
    h_layers, cache_layers = _mixed_step(model, fused=False)
    assert len(calls) == 3
    assert torch.equal(h_fused, h_layers)
    assert torch.equal(cache_fused, cache_layers)
    assert torch.equal(model.embed, embed), "the batch-1 step must not write into the embedding"
    assert models["fp32"]._plan is None  # fp32 projections are not C quantized kernels
