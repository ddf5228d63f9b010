"""The mocker's simulated LoRA adapters: slots with LRU eviction of idle adapters, a load time
that holds the step loop, requests that wait for their adapter's load."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from tests.support.sim_time import SimTime

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.errors import InvalidRequest, ModelNotFound
from tandem.protocols.engine import EngineOutput, PreprocessedRequest, StopConditions

pytestmark = pytest.mark.timeout(20)


def adapter_dir(root: Path, name: str, rank: int = 16) -> str:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    return str(path)


def engine(t: SimTime | None = None, **kw: object) -> MockerEngine:
    base: dict[str, object] = dict(
        num_blocks=256, block_size=4, speedup_ratio=1.0, tokenizer=None, max_loras=2
    )
    base.update(kw)
    config = MockerConfig(**base)  # type: ignore[arg-type]
    if t is None:
        return MockerEngine(config)
    return MockerEngine(config, clock=t.clock, sleep=t.sleep)


def req(rid: str, lora: str | None, max_tokens: int = 3) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="m",
        token_ids=list(range(8)),
        stop=StopConditions(max_tokens=max_tokens),
        lora_name=lora,
    )


async def collect(e: MockerEngine, r: PreprocessedRequest) -> list[EngineOutput]:
    return [out async for out in e.generate(r)]


async def test_load_takes_the_simulated_time_and_stalls_the_step_loop(tmp_path: Path) -> None:
    t = SimTime()
    e = engine(t, lora_load_ms=250.0, speedup_ratio=2.0)
    info = await e.start()
    assert info.max_loras == 2 and e.capabilities.lora
    # a base-model request running while the load happens waits for it: the step loop is held
    base = asyncio.create_task(collect(e, req("base", None, max_tokens=2)))
    await asyncio.sleep(0)
    loaded = await e.load_lora("a", adapter_dir(tmp_path, "a", rank=8))
    assert loaded.rank == 8 and e.loras() == ["a"]
    assert t.now >= 0.125  # 250 ms / speedup 2
    outs = await base
    assert outs[-1].finish_reason == "length"
    again = await e.load_lora("a", str(tmp_path / "a"))
    assert again.load_s == 0.0  # resident: nothing to do
    assert e.adapters.num_loads == 1
    await e.stop()


async def test_request_waits_for_its_adapter_to_load(tmp_path: Path) -> None:
    e = engine(lora_load_ms=200.0)  # real clock: the request must not run before the load
    await e.start()
    load = asyncio.create_task(e.load_lora("a", adapter_dir(tmp_path, "a")))
    await asyncio.sleep(0.01)
    assert e.loras() == []  # still loading
    outs = await collect(e, req("r", "a"))
    assert load.done() and outs[-1].finish_reason == "length"
    await e.stop()


async def test_lru_eviction_of_idle_adapters_under_the_slot_limit(tmp_path: Path) -> None:
    e = engine(SimTime(), max_loras=2)
    await e.start()
    for name in ("a", "b"):
        await e.load_lora(name, adapter_dir(tmp_path, name))
    await collect(e, req("use-a", "a"))  # a is now the most recently used
    await e.load_lora("c", adapter_dir(tmp_path, "c"))
    assert sorted(e.loras()) == ["a", "c"]  # b, least recently used, was evicted
    assert e.adapters.num_evictions == 1
    with pytest.raises(ModelNotFound, match="'b'"):
        await collect(e, req("use-b", "b"))
    await e.stop()


async def test_an_adapter_in_use_is_never_evicted(tmp_path: Path) -> None:
    t = SimTime()
    e = engine(t, max_loras=1)
    await e.start()
    await e.load_lora("a", adapter_dir(tmp_path, "a"))
    long = e.generate(req("long", "a", max_tokens=50))
    first = await anext(long)  # running, holding adapter a
    assert first.token_ids
    load_b = asyncio.create_task(e.load_lora("b", adapter_dir(tmp_path, "b")))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not load_b.done() and e.loras() == ["a"]  # b waits for a slot
    async for _ in long:
        pass
    assert (await load_b).name == "b" and e.loras() == ["b"]
    await e.stop()


async def test_bad_adapters_and_unload(tmp_path: Path) -> None:
    e = engine(SimTime())
    await e.start()
    with pytest.raises(InvalidRequest, match=r"no adapter_config\.json"):
        await e.load_lora("x", str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"r": "sixteen"}')
    with pytest.raises(InvalidRequest, match="r='sixteen'"):
        await e.load_lora("x", str(bad))
    await e.load_lora("a", adapter_dir(tmp_path, "a"))
    with pytest.raises(InvalidRequest, match="unload it before"):
        await e.load_lora("a", adapter_dir(tmp_path, "a2"))
    await e.unload_lora("a")
    assert e.loras() == []
    with pytest.raises(ModelNotFound):
        await e.unload_lora("a")
    none = engine(SimTime(), max_loras=0)
    assert not none.capabilities.lora
    await none.start()
    with pytest.raises(InvalidRequest, match="--max-loras 0"):
        await none.load_lora("a", str(tmp_path / "a"))
    await none.stop()
    await e.stop()
