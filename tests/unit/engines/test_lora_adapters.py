"""LoRA adapters without a real model (issue 32): every bad PEFT directory is an
InvalidRequest naming the problem; LoraSlots' LRU eviction never takes a busy adapter; the
native engine loads, serves, unloads (running requests finish) and refuses clearly."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
import torch
from native_tiny import TINY, request, tiny_core
from safetensors.torch import save_file

from tandem.engines.lora import LoraShape, LoraSlots, read_peft_adapter
from tandem.engines.native.adapters import lora_shape
from tandem.engines.native.engine import NativeEngine
from tandem.errors import InvalidRequest, ModelNotFound, Overloaded

pytestmark = pytest.mark.timeout(30)

SHAPE = lora_shape(TINY, "tiny")


def write_adapter(
    root: Path,
    *,
    rank: int = 4,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    config: dict | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    shape: LoraShape = SHAPE,
    seed: int = 0,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules),
           "base_model_name_or_path": "tiny", "bias": "none"}  # fmt: skip
    cfg.update(config or {})
    (root / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for i in range(shape.num_layers):
            for m in modules:
                d_in, d_out = shape.dims[m]
                group = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{i}.{group}.{m}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.1
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.1
    save_file(tensors, str(root / "adapter_model.safetensors"))
    return root


def test_reads_rank_scale_and_modules(tmp_path):
    w = read_peft_adapter(write_adapter(tmp_path / "a", rank=8), SHAPE, name="a")
    assert (w.rank, w.scale, w.modules) == (8, 2.0, ("q_proj", "v_proj"))
    assert len(w.a) == len(w.b) == 2 * TINY.num_layers
    rs = read_peft_adapter(
        write_adapter(tmp_path / "rs", rank=16, config={"use_rslora": True}), SHAPE
    )
    assert rs.scale == 32 / 4  # lora_alpha / sqrt(r)


def _corrupt(root: Path) -> None:
    (root / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")


BAD = {
    "not a directory": (lambda p: p / "nowhere", "not a directory"),
    "no config": (lambda p: (write_adapter(p), (p / "adapter_config.json").unlink())[0],
                  "no adapter_config.json"),
    "config not json": (lambda p: (write_adapter(p),
                                   (p / "adapter_config.json").write_text("{nope"))[0],
                        "not valid JSON"),
    "no weights": (lambda p: (write_adapter(p), (p / "adapter_model.safetensors").unlink())[0],
                   "no adapter_model.safetensors"),
    "corrupt weights": (lambda p: (write_adapter(p), _corrupt(p))[0], "corrupt"),
    "rank too big": (lambda p: write_adapter(p, config={"r": 1000}), r"r=1000; expected"),
    "rank mismatch": (lambda p: write_adapter(p, config={"r": 2}), r"needs \[2, 64\]"),
    "unknown module": (lambda p: write_adapter(p, config={"target_modules": ["q_proj", "lm_head"]}),
                       r"\['lm_head'\] not in base model 'tiny'"),
    "other base model": (lambda p: write_adapter(p, shape=LoraShape.llama(
        "big", num_layers=2, hidden=128, num_heads=4, num_kv_heads=2, head_dim=32, ffn=256)),
        r"needs \[4, 64\].*another base model"),
    "too many layers": (lambda p: write_adapter(p, shape=LoraShape.llama(
        "deep", num_layers=4, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn=128)),
        "is for layer 2; base model 'tiny' has 2 layers"),
    "dora": (lambda p: write_adapter(p, config={"use_dora": True}), "DoRA"),
    "bias": (lambda p: write_adapter(p, config={"bias": "all"}), "bias='all'"),
    "other peft type": (lambda p: write_adapter(p, config={"peft_type": "IA3"}), "LORA only"),
    "nan": (lambda p: write_adapter(p, tensors={
        "model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((4, 64), float("nan")),
        "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}), "NaN"),
    "a without b": (lambda p: write_adapter(p, tensors={
        "model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}),
        "layer 0 q_proj has no lora_B"),
    "foreign tensor": (lambda p: write_adapter(p, tensors={
        "base_model.model.lm_head.weight": torch.zeros(4, 4)}), "not a LoRA A/B weight"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_bad_adapter_is_an_invalid_request_naming_the_problem(tmp_path, case):
    make, message = BAD[case]
    with pytest.raises(InvalidRequest, match=message):
        read_peft_adapter(make(tmp_path / "x"), SHAPE, name="x")


def test_slots_evict_the_least_recently_used_idle_adapter():
    slots: LoraSlots[int] = LoraSlots(2)
    assert slots.add("a", 1) == [] and slots.add("b", 2) == []
    slots.use("a")  # b is now the least recently used
    assert slots.add("c", 3) == ["b"] and slots.names() == ["a", "c"]
    assert slots.add("d", 4, busy={"a"}) == ["c"]  # a is busy: c goes though more recent
    with pytest.raises(Overloaded, match="all 2 adapter slots"):
        slots.add("e", 5, busy={"a", "d"})
    assert slots.names() == ["a", "d"]  # nothing changed
    with pytest.raises(ModelNotFound, match="'zzz' is not loaded"):
        slots.use("zzz")
    with pytest.raises(ModelNotFound):
        slots.remove("zzz")
    with pytest.raises(InvalidRequest, match="--max-loras 0"):
        LoraSlots(0).add("a", 1)
    with pytest.raises(ValueError, match="max_loras=-1"):
        LoraSlots(-1)


def with_lora(req, name: str):
    return msgspec.structs.replace(req, lora_name=name)


async def collect(engine: NativeEngine, req) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(req):
        tokens += out.token_ids
    return tokens


async def test_native_engine_loads_serves_and_unloads(tmp_path):
    core = tiny_core(max_loras=2)
    engine = NativeEngine(core.config, core=core)
    await engine.start()
    assert engine.capabilities.lora
    a, b = write_adapter(tmp_path / "a", seed=1), write_adapter(tmp_path / "b", seed=2)
    loaded = await engine.load_lora("a", str(a))
    assert loaded.rank == 4 and loaded.load_s > 0
    assert (await engine.load_lora("a", str(a))).load_s == 0.0  # idempotent
    with pytest.raises(InvalidRequest, match="already loaded from"):
        await engine.load_lora("a", str(b))
    prompt = [5, 6, 7, 8, 9]
    base = await collect(engine, request("r0", prompt, max_tokens=8))
    with_a = await collect(engine, with_lora(request("r1", prompt, max_tokens=8), "a"))
    assert with_a != base
    with pytest.raises(ModelNotFound, match="LoRA adapter 'b' is not loaded"):
        await collect(engine, with_lora(request("r2", prompt, max_tokens=8), "b"))
    # unloading while a request runs: it finishes on the adapter it started with
    stream = engine.generate(with_lora(request("r3", prompt, max_tokens=8), "a"))
    first = await anext(stream)
    await engine.unload_lora("a")
    rest = [t async for out in stream for t in out.token_ids]
    assert first.token_ids + rest == with_a
    assert engine.loras() == []
    with pytest.raises(ModelNotFound):
        await engine.unload_lora("a")
    with pytest.raises(InvalidRequest, match="not a directory"):
        await engine.load_lora("c", str(tmp_path / "missing"))
    await engine.stop()


async def test_native_engine_with_max_loras_0_serves_none(tmp_path):
    core = tiny_core(max_loras=0)
    engine = NativeEngine(core.config, core=core)
    await engine.start()
    assert not engine.capabilities.lora
    with pytest.raises(InvalidRequest, match="--max-loras 0"):
        await engine.load_lora("a", str(write_adapter(tmp_path / "a")))
    await engine.stop()
    await asyncio.sleep(0)
