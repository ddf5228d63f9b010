"""NativeEngine under hostile sampling values and failing steps (tiny model): a temperature
too small to divide by is greedy, a step that raises fails only its own requests, values the
sampler cannot honour are refused up front, and a step loop that dies says so."""

from __future__ import annotations

import asyncio

import pytest
from native_tiny import request, tiny_core

from tandem.engines.native.engine import NativeEngine
from tandem.engines.native.engine_core import MAX_FAILED_STEPS
from tandem.errors import EngineError, InvalidRequest
from tandem.protocols.engine import EngineOutput, PreprocessedRequest, StopConditions

pytestmark = pytest.mark.timeout(20)


async def started(**kw: object) -> NativeEngine:
    core = tiny_core(**kw)
    engine = NativeEngine(core.config, core=core)
    await engine.start()
    return engine


async def outputs(engine: NativeEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(req)]


def tokens_of(outs: list[EngineOutput]) -> list[int]:
    return [t for out in outs for t in out.token_ids]


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-8])
async def test_a_tiny_temperature_is_greedy_and_the_engine_keeps_serving(temperature):
    engine = await started()
    greedy = tokens_of(await outputs(engine, request("g", [5, 6, 7], max_tokens=6)))
    tiny = await outputs(
        engine, request("t", [5, 6, 7], max_tokens=6, temperature=temperature, top_k=40, seed=3)
    )
    assert tiny[-1].finish_reason == "length" and tokens_of(tiny) == greedy
    after = await outputs(engine, request("after", [5, 6, 7], max_tokens=6, temperature=1.0))
    assert after[-1].finish_reason == "length" and len(tokens_of(after)) == 6
    await engine.stop()


async def test_a_step_that_raises_fails_only_its_requests_and_frees_their_blocks(monkeypatch):
    engine = await started()
    runner = engine.core.runner
    real_run = runner.run

    def run(batch, block_manager):
        if any(s.request_id == "bad" for s in batch.seqs):
            raise RuntimeError("probability tensor contains either `inf`, `nan`")
        return real_run(batch, block_manager)

    monkeypatch.setattr(runner, "run", run)
    failed = await outputs(engine, request("bad", [5, 6, 7], max_tokens=4))
    assert [o.finish_reason for o in failed] == ["error"]
    assert "engine step failed: RuntimeError: probability tensor" in (failed[0].error or "")
    core = engine.core
    core.block_manager.check_integrity()
    assert core.seqs == {} and engine.load().num_active_blocks == 0
    ok = await outputs(engine, request("ok", [5, 6, 7], max_tokens=4))
    assert ok[-1].finish_reason == "length" and len(tokens_of(ok)) == 4
    await engine.stop()


async def test_a_failing_step_spares_requests_waiting_for_later_steps(monkeypatch):
    engine = await started(max_num_seqs=1)  # one request per step: "good" waits for "bad"
    runner = engine.core.runner
    real_run = runner.run

    def run(batch, block_manager):
        if any(s.request_id == "bad" and s.num_output_tokens == 2 for s in batch.seqs):
            raise ValueError("boom in the middle of a stream")
        return real_run(batch, block_manager)

    monkeypatch.setattr(runner, "run", run)
    bad, good = await asyncio.gather(
        outputs(engine, request("bad", [8, 9], max_tokens=5)),
        outputs(engine, request("good", [5, 6, 7], max_tokens=5)),
    )
    assert good[-1].finish_reason == "length" and len(tokens_of(good)) == 5
    assert bad[-1].finish_reason == "error" and len(tokens_of(bad)) == 2
    engine.core.block_manager.check_integrity()
    await engine.stop()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_k": -5}, "top_k=-5"),
        ({"logprobs": 10**6}, "logprobs=1000000"),
    ],
)
async def test_sampling_values_the_sampler_cannot_honour_are_refused(change, message):
    engine = await started()
    with pytest.raises(InvalidRequest, match=message):
        await anext(engine.generate(request("x", [5, 6, 7], **change)))
    assert (await outputs(engine, request("ok", [5, 6, 7], max_tokens=2)))[-1].finish_reason
    await engine.stop()


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (StopConditions(max_tokens=4, stop_token_ids=[2**40], min_tokens=1), "stop_token_ids"),
        (StopConditions(max_tokens=4, stop_token_ids=[-3]), "stop_token_ids"),
        (StopConditions(max_tokens=4, stop_token_ids=list(range(256)), min_tokens=2), "bans"),
    ],
)
async def test_stop_ids_outside_the_vocabulary_or_banning_it_all_are_refused(stop, message):
    engine = await started()
    req = request("x", [5, 6, 7])
    req.stop = stop
    with pytest.raises(InvalidRequest, match=message):
        await anext(engine.generate(req))
    req = request("eos", [5, 6, 7])
    req.eos_token_ids = [999]
    with pytest.raises(InvalidRequest, match="eos_token_ids"):
        await anext(engine.generate(req))
    assert (await outputs(engine, request("ok", [5, 6, 7], max_tokens=2)))[-1].finish_reason
    await engine.stop()


async def test_a_dead_step_loop_fails_open_streams_refuses_new_ones_and_reports(monkeypatch):
    engine = await started()
    stream = engine.generate(request("open", [5, 6, 7], max_tokens=400))
    first = await anext(stream)
    assert first.token_ids

    def schedule():
        raise RuntimeError("scheduler state is broken")

    monkeypatch.setattr(engine.core.scheduler, "schedule", schedule)
    rest = [out async for out in stream]
    assert rest[-1].finish_reason == "cancelled"  # as on stop: the Worker answers PeerGone
    assert "scheduler state is broken" in rest[-1].error
    reason = await asyncio.wait_for(engine.wait_failed(), 5)
    assert reason == "native engine failed: RuntimeError: scheduler state is broken"
    with pytest.raises(EngineError, match="serves nothing more"):
        await anext(engine.generate(request("late", [5, 6, 7])))
    await engine.stop()


async def test_wait_failed_does_not_return_while_the_engine_works():
    engine = await started()
    waiter = asyncio.ensure_future(engine.wait_failed())
    await outputs(engine, request("a", [5, 6, 7], max_tokens=3))
    assert not waiter.done()
    waiter.cancel()
    await engine.stop()


async def test_steps_that_keep_failing_declare_the_engine_dead(monkeypatch):
    engine = await started()
    runner = engine.core.runner
    real_run = runner.run
    failing = {"on": True}

    def run(batch, block_manager):
        if failing["on"]:
            raise RuntimeError("out of memory")
        return real_run(batch, block_manager)

    monkeypatch.setattr(runner, "run", run)
    for i in range(MAX_FAILED_STEPS - 1):  # one request per step, each fails alone
        outs = await outputs(engine, request(f"f{i}", [5, 6, 7]))
        assert outs[-1].finish_reason == "error" and "out of memory" in outs[-1].error
    failing["on"] = False
    ok = await outputs(engine, request("ok", [5, 6, 7], max_tokens=2))
    assert ok[-1].finish_reason == "length"  # a good step resets the count
    failing["on"] = True
    for i in range(MAX_FAILED_STEPS - 1):
        outs = await outputs(engine, request(f"g{i}", [5, 6, 7]))
        assert outs[-1].finish_reason == "error"
    last = await outputs(engine, request("last", [5, 6, 7]))  # its failure kills the engine
    assert last[-1].finish_reason == "cancelled" and "steps failed in a row" in last[-1].error
    reason = await asyncio.wait_for(engine.wait_failed(), 5)
    assert f"{MAX_FAILED_STEPS} steps failed in a row" in reason and "out of memory" in reason
    with pytest.raises(EngineError, match="serves nothing more"):
        await anext(engine.generate(request("late", [5, 6, 7])))
    await engine.stop()
