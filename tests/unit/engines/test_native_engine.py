"""NativeEngine (the Engine protocol) over a tiny model: streaming, concurrency, abort,
KV events, stop, sampling options."""

from __future__ import annotations

import asyncio

import pytest
from native_tiny import request, tiny_core

from tandem.engines.native.args import add_args, config_from_args
from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.errors import ContextLengthExceeded, InvalidRequest
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.protocols.kv_events import BlockStored

pytestmark = pytest.mark.timeout(20)


async def started(**kw) -> NativeEngine:
    core = tiny_core(**kw)
    engine = NativeEngine(core.config, core=core)
    info = await engine.start()
    assert info.engine == "native" and info.num_total_blocks == core.num_blocks
    return engine


async def collect(engine: NativeEngine, req: PreprocessedRequest) -> tuple[list[int], str]:
    tokens: list[int] = []
    async for out in engine.generate(req):
        tokens += out.token_ids
        if out.finish_reason:
            return tokens, out.finish_reason
    raise AssertionError("stream ended without finish_reason")


async def test_concurrent_generate_matches_sequential():
    engine = await started()
    prompts = [[5 + i, 6, 7, 8, 9 + i] for i in range(6)]
    together = await asyncio.gather(
        *(collect(engine, request(f"r{i}", p, max_tokens=12)) for i, p in enumerate(prompts))
    )
    alone = [
        await collect(engine, request(f"s{i}", p, max_tokens=12)) for i, p in enumerate(prompts)
    ]
    assert together == alone
    assert all(reason == "length" and len(t) == 12 for t, reason in together)
    assert engine.load().num_active_blocks == 0
    await engine.stop()


async def test_abort_and_closing_the_stream_free_blocks():
    engine = await started()
    stream = engine.generate(request("a", [5, 6, 7], max_tokens=400))
    first = await anext(stream)
    assert first.token_ids and first.num_cached_tokens == 0
    await engine.abort("a")
    last = first
    async for out in stream:
        last = out
    assert last.finish_reason == "cancelled"
    stream = engine.generate(request("b", [5, 6, 7], max_tokens=400))
    await anext(stream)
    await stream.aclose()  # the consumer went away
    # the abort is queued before this request, so it is applied before this one runs
    await collect(engine, request("c", [8, 9], max_tokens=2))
    snapshot = engine.kv_snapshot()
    assert engine.load().num_active_blocks == 0 and engine.core.seqs == {}
    assert all(isinstance(e, BlockStored) for e in snapshot)
    await engine.stop()


async def test_kv_events_stream_and_stop():
    engine = await started()
    events = engine.kv_events()
    await collect(engine, request("a", list(range(3, 12)), max_tokens=3))
    batch = await asyncio.wait_for(anext(events), 5)
    assert isinstance(batch[0], BlockStored) and batch[0].block_size == 4
    pending = engine.generate(request("b", [5, 6], max_tokens=400))
    await anext(pending)
    await engine.stop()
    async for out in pending:
        assert out.finish_reason == "cancelled"


async def test_too_long_request_is_rejected():
    engine = await started(max_model_len=32)
    req = PreprocessedRequest(
        request_id="x", model="tiny", token_ids=[5] * 20, stop=StopConditions(max_tokens=20)
    )
    with pytest.raises(ContextLengthExceeded, match="exceeds"):
        await anext(engine.generate(req))
    await engine.stop()


async def test_seeded_sampling_is_reproducible_and_logprobs_are_returned():
    engine = await started()

    def sampled(rid: str, seed: int) -> PreprocessedRequest:
        return request(
            rid,
            [5, 6, 7],
            max_tokens=16,
            temperature=1.5,
            top_p=0.9,
            top_k=50,
            seed=seed,
            logprobs=3,
        )

    a, b, c = await asyncio.gather(
        collect(engine, sampled("a", 1)),
        collect(engine, sampled("b", 1)),
        collect(engine, sampled("c", 2)),
    )
    assert a == b and a != c
    outs = [o async for o in engine.generate(sampled("d", 1))]
    assert sum(len(o.logprobs or []) for o in outs) == 16
    top = [t for o in outs for t in (o.top_logprobs or [])]
    assert all(len(t) == 3 and t[0].logprob >= t[-1].logprob for t in top)
    await engine.stop()


async def test_stop_token_and_min_tokens():
    engine = await started()
    greedy, _ = await collect(engine, request("g", [5, 6, 7], max_tokens=8))
    stop_at = greedy[2]
    req = request("s", [5, 6, 7], max_tokens=8)
    req.stop.stop_token_ids = [stop_at]
    tokens, reason = await collect(engine, req)
    assert reason == "stop" and tokens == greedy[: greedy.index(stop_at) + 1]
    req = request("m", [5, 6, 7], max_tokens=8)
    req.stop = StopConditions(max_tokens=8, stop_token_ids=[stop_at], min_tokens=8)
    tokens, reason = await collect(engine, req)
    assert reason == "length" and stop_at not in tokens
    await engine.stop()


def test_args_build_a_config(monkeypatch):
    import argparse

    monkeypatch.setenv("TANDEM_NUM_BLOCKS", "77")
    parser = argparse.ArgumentParser()
    add_args(parser)
    from tandem.runtime.flag_parser import parse_args

    config = config_from_args(parse_args(parser, ["--block-size", "32", "--dtype", "float32"]))
    assert config == NativeConfig(block_size=32, num_blocks=77, weights="int4")  # auto, here
    with pytest.raises(ValueError, match="block_size=0"):
        NativeConfig(block_size=0)
    with pytest.raises(ValueError, match="dtype='int4'"):
        NativeConfig(dtype="int4")


def test_kv_cache_dtype_flag_and_what_auto_picks():
    import argparse

    parser = argparse.ArgumentParser()
    add_args(parser)
    from tandem.runtime.flag_parser import parse_args

    ns = parse_args(parser, ["--kv-cache-dtype", "float32", "--weights", "int4"])
    assert config_from_args(ns).resolved_kv_dtype() == "float32"
    assert NativeConfig(weights="int4").resolved_kv_dtype() == "float16"  # auto
    assert NativeConfig(weights="int8").resolved_kv_dtype() == "float16"
    assert NativeConfig(weights="fp32").resolved_kv_dtype() == "float32"  # the reference
    assert NativeConfig(dtype="bfloat16").resolved_kv_dtype() == "bfloat16"
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8'.*auto, float32"):
        NativeConfig(kv_cache_dtype="fp8")


async def test_duplicate_request_id_is_rejected_without_disturbing_the_first():
    engine = await started()
    # long enough that the first is surely still running when the duplicate arrives (a short one
    # could finish, its outputs merged into one chunk, before the second generate() call)
    first = engine.generate(request("same", [5, 6, 7], max_tokens=200))
    outs = [await anext(first)]
    with pytest.raises(InvalidRequest, match="already running"):
        await anext(engine.generate(request("same", [8, 9], max_tokens=6)))
    outs += [out async for out in first]
    assert outs[-1].finish_reason == "length"
    assert sum(len(out.token_ids) for out in outs) == 200
    assert engine.load().num_active_blocks == 0
    await engine.stop()


async def test_steps_are_reported_for_the_planner():
    engine = await started()
    await collect(engine, request("p", [5, 6, 7, 8, 9, 10], max_tokens=4))
    steps = engine.take_step_samples()
    assert steps[0].num_prefill_tokens == 6 and steps[0].num_decode_kv_tokens == 0
    # then decodes over a growing context: 7, 8, 9 tokens attended
    assert [s.num_decode_kv_tokens for s in steps[1:]] == [7, 8, 9]
    assert all(s.wall_ms > 0 for s in steps)
    assert engine.take_step_samples() == []
    await engine.stop()
