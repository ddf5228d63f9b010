"""`--device` for the native engine: the check at startup, and the torch code a CUDA device
runs, exercised here on the CPU where TANDEM_NATIVE_OPS=torch and TANDEM_QUANT_KERNELS=torch
force it. A guard fails every tensor factory a step calls without `device=` (on a GPU it
would make a CPU tensor); the step path makes host arrays into tensors with
`torch.as_tensor(..., device=)`, never `torch.from_numpy` (which the guard cannot see).
Tests run on every device this machine has."""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from native_reference import Reference
from native_tiny import TINY, TINY_WEIGHTS, request
from test_native_model import make_core, run
from torch.overrides import TorchFunctionMode

from tandem.cli import worker
from tandem.engines.native import quant
from tandem.engines.native.config import NativeConfig
from tandem.engines.native.embedding import pooled_embeddings
from tandem.engines.native.engine import build_model
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.kv_transfer import NativeKvHandoff
from tandem.engines.native.loader import load_model_weights
from tandem.engines.native.model import LlamaModel
from tandem.engines.native.quant_model import QuantLlamaModel
from tandem.errors import StartupError
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions
from tandem.runtime.flag_parser import parse_args

pytestmark = pytest.mark.timeout(300)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TORCH_PATHS = {"TANDEM_NATIVE_OPS": "torch", quant.KERNELS_ENV: "torch"}


# ---------------------------------------------------------------- the check at startup
def _worker_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker.add_arguments(parser, argv)
    return parse_args(parser, argv)


@pytest.mark.parametrize("source", ["flag", "env"])
def test_cuda_without_a_usable_gpu_stops_the_worker_at_startup(monkeypatch, source):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--engine", "native"]
    if source == "flag":
        argv += ["--device", "cuda"]
    else:
        monkeypatch.setenv("TANDEM_DEVICE", "cuda")
    args = _worker_args(argv)
    with pytest.raises(
        StartupError,
        match=r"bad configuration: device='cuda' but torch\.cuda\.is_available\(\) is False.*"
        r"expected --device cpu",
    ):
        asyncio.run(worker.serve(args))


@pytest.mark.parametrize("bad", ["tpu", "gpu", "CUDA", "cuda:x", "cpu:0", "cuda:"])
def test_unknown_device_names_what_is_expected(bad):
    with pytest.raises(ValueError, match=rf"device='{bad}'; expected one of: cpu, cuda, cuda:N"):
        NativeConfig(device=bad)


def test_cuda_index_must_name_a_present_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for ok in ("cuda", "cuda:0", "cuda:1"):
        assert NativeConfig(device=ok).device == ok
    with pytest.raises(ValueError, match=r"device='cuda:2' but this machine has 2 CUDA device"):
        NativeConfig(device="cuda:2")


# ---------------------------------------------------------------- the same code on any device
_FACTORIES = frozenset(
    {
        torch.tensor, torch.as_tensor, torch.empty, torch.zeros, torch.ones, torch.full,
        torch.arange, torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye,
        torch.empty_strided,
    }
)  # fmt: skip


class RequireDevice(TorchFunctionMode):
    """Fails a tensor factory called without `device=`: the CPU would be right here by
    accident, and on a GPU the step would mix devices."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            raise AssertionError(f"torch.{func.__name__} called without device= on the step path")
        return func(*args, **kwargs)


@pytest.fixture
def torch_paths(monkeypatch) -> Iterator[None]:
    """The C ops and the C quantized kernels off: the models built now run what CUDA runs."""
    for name, value in TORCH_PATHS.items():
        monkeypatch.setenv(name, value)
    yield


def _tiny(weights: str, device: str | None) -> LlamaModel:
    kw: dict[str, Any] = {} if device is None else {"device": device}
    if weights == "fp32":
        return LlamaModel(TINY, TINY_WEIGHTS, **kw)
    return QuantLlamaModel(TINY, dict(TINY_WEIGHTS), weights_format=weights, **kw)  # type: ignore[arg-type]


def _requests(tag: str) -> list[PreprocessedRequest]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 256) for _ in range(10)]
    sampling: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 0.0, "logprobs": 3},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 11},
        {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.5,
         "presence_penalty": 0.2, "logit_bias": {7: 4.0}},
    ]  # fmt: skip
    out = []
    for i, params in enumerate(sampling):
        prompt = shared + [rng.randrange(3, 256) for _ in range(3 + 5 * i)]
        stop = StopConditions(max_tokens=6, ignore_eos=True, min_tokens=2, stop_token_ids=[9])
        out.append(
            PreprocessedRequest(
                request_id=f"{tag}{i}",
                model="tiny",
                token_ids=prompt,
                sampling=SamplingParams(**params),
                stop=stop,
            )
        )
    return out


def _serve(core: EngineCore) -> dict[str, tuple[list[int], list[float], str | None]]:
    """Two waves (the second hits the first's cached prefix), batched and alone; then a
    round trip of KV blocks and an embedding. Returns tokens, logprobs, finish per request."""
    out: dict[str, tuple[list[int], list[float], str | None]] = {}
    for wave in ("a", "b"):
        for req in _requests(wave):
            core.add(req)
            out[req.request_id] = ([], [], None)
        while core.has_work():
            for rid, o in core.step():
                assert o.finish_reason != "error", o.error
                tokens, logprobs, _ = out[rid]
                out[rid] = (tokens + o.token_ids, logprobs + (o.logprobs or []), o.finish_reason)
    runner = core.runner
    exported = runner.export_blocks([0, 1])
    assert all(t.device.type == "cpu" for t in exported)  # host copies (transfers, tiers)
    runner.import_blocks([2, 3], exported)
    assert torch.equal(runner.kv_cache[:, :, 2:4], runner.kv_cache[:, :, 0:2])
    emb = pooled_embeddings(core.model, [[5, 6, 7], [8, 9]])
    out["embedding"] = (emb.flatten().tolist(), [], str(emb.device))
    return out


@pytest.mark.parametrize("weights", ["fp32", "int4"])
@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_a_named_device_creates_every_tensor_there(torch_paths, device, weights):
    config = NativeConfig(device=device, num_blocks=64, block_size=4, max_num_batched_tokens=64)
    core = EngineCore(config, _tiny(weights, device))
    assert core.runner.kv_cache.device.type == device
    assert core.model.c_ops(core.runner.kv_cache) is None  # the torch ops serve the step
    with RequireDevice():
        on_device = _serve(core)
    assert len(on_device) == 9 and on_device["embedding"][2] == "cpu"
    assert all(2 <= len(t) <= 6 for rid, (t, _, _) in on_device.items() if rid != "embedding")
    if device == "cpu":  # the explicit device is the default one: the same run, bit for bit
        default = EngineCore(NativeConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64),
                             _tiny(weights, None))  # fmt: skip
        assert _serve(default) == on_device


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_engine_steps_on_a_device_that_is_not_the_cpu(weights):
    """The whole step on `meta` (shapes only, no data): no C call, no numpy view, no Python
    scalar read back from the device on the way (a batch-1 decode takes the flat-batch
    forward there), and most ops refuse CPU operands. Only the token pick is stubbed: it is
    the one read back that needs values."""
    model = _tiny(weights, "meta")
    model.head.greedy = lambda x: [5] * x.shape[0]  # type: ignore[method-assign]
    core = EngineCore(NativeConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64), model)
    prompts = [list(range(10, 20 + 3 * i)) for i in range(3)]
    for wave in ([0, 1, 2], [0]):  # batched prefill + decode; then alone, from cached blocks
        for i in wave:
            core.add(request(f"{len(wave)}-{i}", prompts[i], max_tokens=4))
        while core.has_work():
            for _, out in core.step():
                assert out.finish_reason != "error", out.error
    assert core.runner.kv_cache.device.type == "meta"
    assert core.block_manager.num_active_blocks == 0


def test_guard_catches_a_tensor_made_without_its_device():
    with RequireDevice(), pytest.raises(AssertionError, match=r"torch\.arange called without"):
        torch.arange(3)
    with RequireDevice():
        assert torch.arange(3, device="cpu").tolist() == [0, 1, 2]


# ---------------------------------------------------------------- SmolLM2 on the torch path
NUM_AGREE = 0.95


@pytest.fixture(scope="module")
def smollm2_int4() -> dict[str, LlamaModel]:
    """int4 SmolLM2 on the C kernels and C ops (the CPU default) and on the torch path."""
    torch.set_num_threads(1)
    config = NativeConfig(weights="int4", max_model_len=1024, device="cpu")
    models = {"c": build_model(config)[0]}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in TORCH_PATHS.items():
            mp.setenv(name, value)
        models["torch"] = build_model(config)[0]
    return models


@pytest.fixture(scope="module")
def reference() -> Reference:
    _, config, weights = load_model_weights()
    return Reference(config, weights)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(200, 40000) for _ in range(40)]
    out = [[rng.randrange(200, 40000) for _ in range(rng.randrange(3, 70))] for _ in range(4)]
    return out + [shared + [rng.randrange(200, 40000) for _ in range(n)] for n in (5, 21)]


@pytest.mark.native
def test_torch_path_is_exact_within_itself_and_agrees_with_the_c_path(
    smollm2_int4, reference, prompts
):
    model = smollm2_int4["torch"]
    layer = model.layers[0]
    assert not isinstance(layer.qkv.weight, quant.PackedWeight)  # type: ignore[attr-defined]
    assert model.c_ops(model.new_kv_cache(1, 16)) is None
    batched, _ = run(make_core(model), prompts)
    alone_core = make_core(model, enable_prefix_caching=False)
    for i in (0, 5):
        (alone,), _ = run(alone_core, [prompts[i]])
        reference.check_same(prompts[i], alone, batched[i])
    c_path, _ = run(make_core(smollm2_int4["c"]), prompts)
    agree = total = 0
    for a, b in zip(c_path, batched, strict=True):
        same = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        agree, total = agree + same, total + len(a)
    assert agree / total >= NUM_AGREE, (agree, total, c_path, batched)


def test_disaggregated_transfer_refuses_a_kv_cache_off_the_host():
    """The transfer agent serves a host shared-memory region as the cache: an engine whose
    cache lives on a GPU must fail at start, not copy blocks into memory nobody reads."""
    core = EngineCore(NativeConfig(num_blocks=8, block_size=4), _tiny("fp32", "cpu"))
    handoff = NativeKvHandoff(SimpleNamespace(core=core))  # type: ignore[arg-type]
    core.runner.kv_cache = core.runner.kv_cache.to("meta")  # stands for a GPU's cache
    with pytest.raises(ValueError, match=r"needs the KV cache in host memory.*--device cpu"):
        handoff.adopt_kv_cache(torch.empty(core.runner.kv_cache.shape))
