"""The mocker's mid-stream outputs sent straight from its step (Worker._direct_sink +
StreamContext.try_send), over memory discovery/events and the real TCP request plane: the
same streams as the generator path, in order, falling back when credit runs out, and a
cancel mid-stream still frees the request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from tests.support.eventually import eventually

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.protocols.discovery import Instance
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
    decode_output,
    encode,
)
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import Runtime, open_runtime
from tandem.runtime.tcp import StreamContext

pytestmark = pytest.mark.timeout(30)
NUM_TOKENS = 40
PROMPT_LEN = 13


class Spy:
    def __init__(self) -> None:
        self.sent: list[bool] = []  # try_send's answers, in call order


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """Records what StreamContext.try_send answered (so a test sees the direct path ran)."""
    stacks = Spy()
    real = StreamContext.try_send

    def counting(self: StreamContext, payload: bytes) -> bool:
        ok = real(self, payload)
        stacks.sent.append(ok)
        return ok

    monkeypatch.setattr(StreamContext, "try_send", counting)
    return stacks


async def _open(
    *, direct: bool, stream_window: int
) -> AsyncIterator[tuple[MockerEngine, Instance, Runtime, Worker]]:
    disc, bus = MemoryDiscovery(), MemoryEventBus()
    cfg = RuntimeConfig(namespace="t", stream_window=stream_window)
    engine = MockerEngine(MockerConfig(num_blocks=4096, block_size=4, speedup_ratio=0))
    if not direct:
        # the generator path only
        engine.capabilities = replace(engine.capabilities, accepts_direct_sink=False)
    async with (
        open_runtime(cfg, discovery=disc, events=bus) as worker_rt,
        open_runtime(cfg, discovery=disc, events=bus) as client_rt,
    ):
        worker = Worker(engine, worker_rt, WorkerConfig())
        instance = await worker.start()
        try:
            yield engine, instance, client_rt, worker
        finally:
            await worker.stop(grace_s=0)


def _payload(rid: str) -> bytes:
    return encode(
        PreprocessedRequest(
            request_id=rid,
            model="m",
            token_ids=[1 + i % 7 for i in range(PROMPT_LEN)],
            stop=StopConditions(max_tokens=NUM_TOKENS, ignore_eos=True),
        )
    )


async def _streams(direct: bool, stream_window: int, slow: bool) -> list[list[EngineOutput]]:
    """16 concurrent requests; `slow` readers yield to the loop between reads, so credit
    runs out while the step loop keeps going."""

    async def one(client: Runtime, instance: Instance, rid: str) -> list[EngineOutput]:
        outs = []
        async for payload in client.stream(instance, _payload(rid), request_id=rid):
            outs.append(decode_output(payload))
            if slow:
                for _ in range(3):
                    await asyncio.sleep(0)
        return outs

    gen = _open(direct=direct, stream_window=stream_window)
    engine, instance, client, worker = await anext(gen)
    try:
        streams = await asyncio.gather(*(one(client, instance, f"r{i}") for i in range(16)))
        # every prompt counted once in the worker's metrics, whichever path sent its first output
        assert worker.metrics.num_prompt_tokens == 16 * PROMPT_LEN
        return list(streams)
    finally:
        engine.scheduler.check_integrity()
        await gen.aclose()


def _tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize(("stream_window", "slow"), [(256, False), (2, True)])
async def test_direct_outputs_give_the_generator_paths_streams(
    spy: Spy, stream_window: int, slow: bool
) -> None:
    reference = await _streams(direct=False, stream_window=stream_window, slow=slow)
    assert spy.sent == []  # the generator path never sends directly
    direct = await _streams(direct=True, stream_window=stream_window, slow=slow)
    assert True in spy.sent, "the direct path was never taken"
    if stream_window == 2:
        assert False in spy.sent, "credit never ran out: the fallback went untested"
    for ref, got in zip(reference, direct, strict=True):
        assert _tokens(got) == _tokens(ref) and len(_tokens(got)) == NUM_TOKENS
        assert got[0].num_cached_tokens == 0  # the first output kept its prompt count
        assert [o.finish_reason for o in got].count("length") == 1
        assert got[-1].finish_reason == "length"  # ... and the last one its reason


async def test_cancel_mid_stream_frees_the_request(spy: Spy) -> None:
    gen = _open(direct=True, stream_window=256)
    engine, instance, client, _ = await anext(gen)
    try:
        payload = encode(
            PreprocessedRequest(
                request_id="long",
                model="m",
                token_ids=[3] * 9,
                stop=StopConditions(max_tokens=1_000_000, ignore_eos=True),
            )
        )
        stream = client.stream(instance, payload, request_id="long")
        for _ in range(50):  # well into the direct part of the stream
            await anext(stream)
        assert spy.sent.count(True) > 10
        await stream.aclose()
        await eventually(
            lambda: not engine.scheduler.has_work and not engine.load().num_active_blocks
        )
        engine.scheduler.check_integrity()
        assert "long" not in engine._streams
    finally:
        await gen.aclose()
