"""Conditional disaggregation when the prefill pool is busy (DESIGN.md §4): a prompt worth
splitting still stays on the decode worker when every prefill worker has
`max_prefill_queue` prefills in flight, or is over the prefill router's busy thresholds;
once the pool has room, prompts go to it again. Tokens equal the aggregated mocker's."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.disagg_stack import DisaggStack, start_stack
from tandem.disagg.config import DisaggRouteConfig, DisaggWorkerConfig
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
)
from tandem.router.config import RouterConfig

pytestmark = pytest.mark.timeout(30)
WORKER = DisaggWorkerConfig(mode="decode", backends=("shm", "tcp"))
MOCKER = MockerConfig(num_blocks=256, block_size=4, speedup_ratio=0, tokenizer=None)


class GatedMocker(MockerEngine):
    """A prefill worker's engine that holds every request until `gate` opens."""

    def __init__(self, gate: asyncio.Event) -> None:
        super().__init__(MOCKER)
        self.gate, self.entered = gate, asyncio.Event()

    async def generate(
        self, request: PreprocessedRequest, **kw: Any
    ) -> AsyncIterator[EngineOutput]:
        self.entered.set()
        await self.gate.wait()
        async for out in super().generate(request, **kw):
            yield out


def request(rid: str, n: int = 40) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model=MOCKER.model_name, token_ids=list(range(200 + len(rid), 200 + n)),
        sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=6, ignore_eos=True),
    )  # fmt: skip


async def aggregated(req: PreprocessedRequest) -> list[int]:
    engine = MockerEngine(MOCKER)
    await engine.start()
    tokens = [t async for out in engine.generate(req) for t in out.token_ids]
    await engine.stop()
    return tokens


def engines(gate: asyncio.Event) -> Callable[[], MockerEngine]:
    made: list[MockerEngine] = []

    def make() -> MockerEngine:  # start_stack builds the prefill workers first
        made.append(GatedMocker(gate) if not made else MockerEngine(MOCKER))
        return made[-1]

    return make


async def busy_then_free(s: DisaggStack, gate: asyncio.Event) -> None:
    held = asyncio.create_task(s.generate(request("held")))
    prefill_engine = s.prefill[0].engine
    assert isinstance(prefill_engine, GatedMocker)
    await asyncio.wait_for(prefill_engine.entered.wait(), 5)  # its prefill leg is in flight
    assert await s.generate(request("b")) == (await aggregated(request("b")), "length")
    assert (s.streamer.num_busy, s.streamer.num_local, s.streamer.num_remote) == (1, 1, 1)
    gate.set()
    assert await held == (await aggregated(request("held")), "length")
    assert await s.generate(request("c")) == (await aggregated(request("c")), "length")
    assert (s.streamer.num_busy, s.streamer.num_remote) == (1, 2)  # the pool has room again
    for engine in [*s.prefill, *s.decode]:
        for _ in range(300):
            if engine.load().num_active_blocks == 0:
                break
            await asyncio.sleep(0.01)  # the pins are released from the agent's threads
        assert engine.load().num_active_blocks == 0


@pytest.mark.parametrize("flow", ["prefill-first", "decode-first"])
async def test_full_prefill_queue_keeps_prefill_on_decode(flow: str) -> None:
    gate = asyncio.Event()
    async with AsyncExitStack() as stack:
        route = DisaggRouteConfig(enabled=True, flow=flow, max_prefill_queue=1)
        s = await start_stack(stack, engines(gate), worker=WORKER, route=route)
        await busy_then_free(s, gate)


async def test_prefill_router_busy_threshold_keeps_prefill_on_decode() -> None:
    gate = asyncio.Event()
    async with AsyncExitStack() as stack:
        s = await start_stack(
            stack, engines(gate), num_decode=2, worker=WORKER, policy="kv",
            router_config=RouterConfig(busy_prefill_tokens=10),  # one 40-token prefill: busy
        )  # fmt: skip
        await busy_then_free(s, gate)
