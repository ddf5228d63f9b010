from __future__ import annotations

import asyncio

import msgspec
import pytest

from tandem.engines.base import engine_config_from_args, make_engine
from tandem.engines.mocker import perf_model
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.errors import EngineError, InvalidRequest
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
    decode_request,
    encode_request,
)
from tandem.protocols.kv_events import BlockStored
from tandem.runtime.flag_parser import parse_args

pytestmark = pytest.mark.timeout(10)


def _config(**kw: object) -> MockerConfig:
    base: dict[str, object] = dict(num_blocks=64, block_size=4, speedup_ratio=0, tokenizer=None)
    base.update(kw)
    return MockerConfig(**base)  # type: ignore[arg-type]


def _req(rid: str, tokens: list[int], max_tokens: int = 5) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=tokens, stop=StopConditions(max_tokens=max_tokens)
    )


async def _collect(engine: MockerEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(req)]


async def test_generate_streams_tokens_and_reports_cache_hits() -> None:
    engine = MockerEngine(_config())
    info = await engine.start()
    assert info.block_size == 4 and info.num_total_blocks == 64 and info.eos_token_ids == [2]
    first = await _collect(engine, _req("a", list(range(12)), max_tokens=6))
    assert sum(len(o.token_ids) for o in first) == 6 and first[-1].finish_reason == "length"
    assert first[0].num_cached_tokens == 0
    second = await _collect(engine, _req("b", list(range(12)), max_tokens=2))
    assert second[0].num_cached_tokens == 8
    assert engine.load().num_active_blocks == 0
    await engine.stop()


async def test_many_concurrent_requests_each_get_their_tokens() -> None:
    engine = MockerEngine(_config(num_blocks=4096, max_num_seqs=64))
    await engine.start()
    reqs = [_req(f"r{i}", [i % 7] * 20, max_tokens=10 + i % 5) for i in range(300)]
    results = await asyncio.gather(*(_collect(engine, r) for r in reqs))
    for req, outs in zip(reqs, results, strict=True):
        assert sum(len(o.token_ids) for o in outs) == req.stop.max_tokens
        assert outs[-1].finish_reason == "length"
    await engine.stop()


async def test_closing_the_stream_aborts_and_frees_blocks() -> None:
    engine = MockerEngine(_config())
    await engine.start()
    stream = engine.generate(_req("a", list(range(10)), max_tokens=1000))
    await anext(stream)
    assert engine.load().num_running == 1 and engine.load().num_active_blocks > 0
    await stream.aclose()
    assert engine.load().num_running == 0 and engine.load().num_active_blocks == 0
    engine.scheduler.check_integrity()
    await engine.stop()


async def test_abort_ends_stream_with_cancelled() -> None:
    engine = MockerEngine(_config())
    await engine.start()
    stream = engine.generate(_req("a", [1, 2, 3], max_tokens=1000))
    await anext(stream)
    await engine.abort("a")
    outs = [o async for o in stream]
    assert outs[-1].finish_reason == "cancelled"
    assert engine.load().num_active_blocks == 0
    await engine.stop()


async def test_stop_cancels_open_streams() -> None:
    engine = MockerEngine(_config())
    await engine.start()
    stream = engine.generate(_req("a", [1, 2, 3], max_tokens=100_000))
    await anext(stream)
    await engine.stop()
    outs = [o async for o in stream]
    assert outs[-1].finish_reason == "cancelled"
    with pytest.raises(EngineError):
        await anext(engine.generate(_req("b", [1])))


async def test_invalid_request_raises_on_first_iteration() -> None:
    engine = MockerEngine(_config())
    await engine.start()
    with pytest.raises(InvalidRequest):
        await anext(engine.generate(_req("a", [])))
    await engine.stop()


async def test_kv_events_and_snapshot_describe_cached_blocks() -> None:
    engine = MockerEngine(_config())
    await engine.start()
    events = engine.kv_events()
    await _collect(engine, _req("a", list(range(9)), max_tokens=1))
    batch = await asyncio.wait_for(anext(events), 5)
    stored = [h for e in batch if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(stored) == 2
    snap = [h for e in engine.kv_snapshot() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert snap == stored
    await engine.stop()
    assert [b async for b in events] == []  # ends after stop


async def test_speedup_ratio_scales_the_simulated_sleep() -> None:
    now = [0.0]
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    engine = MockerEngine(_config(speedup_ratio=4), clock=lambda: now[0], sleep=fake_sleep)
    await engine.start()
    await _collect(engine, _req("a", list(range(10)), max_tokens=2))
    expected = [
        perf_model.prefill_ms(10) / 4000,
        perf_model.decode_ms(3 / 64) / 4000,
    ]
    assert slept == pytest.approx(expected)
    await engine.stop()


async def test_speedup_zero_never_sleeps() -> None:
    async def forbidden(seconds: float) -> None:
        raise AssertionError("slept with speedup 0")

    engine = MockerEngine(_config(speedup_ratio=0), sleep=forbidden)
    await engine.start()
    outs = await _collect(engine, _req("a", [1, 2, 3], max_tokens=20))
    assert outs[-1].finish_reason == "length"
    await engine.stop()


async def test_registry_builds_mocker_from_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from tandem.engines.base import add_engine_args

    monkeypatch.setenv("TANDEM_NUM_BLOCKS", "128")
    parser = argparse.ArgumentParser()
    add_engine_args("mocker", parser)
    ns = parse_args(parser, ["--speedup-ratio", "0", "--block-size", "16", "--tokenizer", "none"])
    engine = make_engine("mocker", engine_config_from_args("mocker", ns))
    assert isinstance(engine, MockerEngine)
    cfg = engine.config
    assert (cfg.num_blocks, cfg.block_size, cfg.speedup_ratio, cfg.tokenizer) == (128, 16, 0, None)
    default = make_engine("mocker", engine_config_from_args("mocker", parse_args(parser, [])))
    assert isinstance(default, MockerEngine)
    tokenizer = default.config.tokenizer
    assert tokenizer is not None and tokenizer.startswith("gguf:") and tokenizer.endswith(".gguf")
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        engine_config_from_args("nope", ns)
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        make_engine("nope", engine.config)
    with pytest.raises(TypeError, match="engine 'native' is built from a NativeConfig"):
        make_engine("native", engine.config)


async def test_a_dead_step_loop_fails_streams_refuses_new_requests_and_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = MockerEngine(_config())
    await engine.start()
    waiter = asyncio.ensure_future(engine.wait_failed())
    await _collect(engine, _req("ok", [1, 2, 3], max_tokens=2))
    assert not waiter.done()

    def broken() -> None:
        raise RuntimeError("scheduler state is broken")

    monkeypatch.setattr(engine.scheduler, "step", broken)
    outs = await _collect(engine, _req("a", [1, 2, 3]))
    assert outs[-1].finish_reason == "cancelled" and "scheduler state is broken" in outs[-1].error
    assert await asyncio.wait_for(waiter, 5) == (
        "mocker engine failed: RuntimeError: scheduler state is broken"
    )
    with pytest.raises(EngineError, match="serves nothing more"):  # it used to hang forever
        await asyncio.wait_for(_collect(engine, _req("late", [1, 2, 3])), 5)
    await engine.stop()


async def test_a_migrated_greedy_request_continues_the_same_tokens() -> None:
    """A stream migrated after k tokens (prompt + those k, `continued_after`) gives the tokens
    the undisturbed stream would have given next, as a greedy real engine does."""
    engine = MockerEngine(_config(eos_token_ids=[]))
    await engine.start()
    req = PreprocessedRequest(
        request_id="m", model="m", token_ids=list(range(10, 30)),
        sampling=SamplingParams(temperature=0.0), stop=StopConditions(max_tokens=12),
    )  # fmt: skip
    whole = [t for o in await _collect(engine, req) for t in o.token_ids]
    for k in (1, 5, 11):
        moved = msgspec.structs.replace(req.continued_after(whole[:k]), request_id=f"m-{k}")
        rest = [t for o in await _collect(engine, moved) for t in o.token_ids]
        assert whole[:k] + rest == whole, k
        # as a worker receives it: the prompt still in its u32 buffer, not a list
        wire = decode_request(encode_request(moved), materialize=False)
        wire = msgspec.structs.replace(wire, request_id=f"w-{k}")
        rest = [t for o in await _collect(engine, wire) for t in o.token_ids]
        assert whole[:k] + rest == whole, k
    await engine.stop()
