"""Decode-first with an early first token: the client gets the prefill's first token
before the KV has moved; the push carries the token so the decode resumes after it (tokens
equal the aggregated run); a decode that prefilled itself and chose another first token is
replaced by a continuation after the client's token; block accounting returns to zero."""

from __future__ import annotations

import asyncio
import sys
import threading
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.disagg_stack import DisaggStack, start_stack
from tandem.disagg.config import DisaggRouteConfig, DisaggWorkerConfig
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions

pytestmark = pytest.mark.timeout(30)
WORKER = DisaggWorkerConfig(mode="decode", backends=("shm", "tcp"))
ROUTE = DisaggRouteConfig(enabled=True, flow="decode-first")
MOCKER = MockerConfig(num_blocks=256, block_size=4, speedup_ratio=0, tokenizer=None)


def request(rid: str, n: int = 30, max_tokens: int = 8) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model=MOCKER.model_name, token_ids=list(range(100, 100 + n)),
        sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )  # fmt: skip


async def aggregated(req: PreprocessedRequest, config: MockerConfig = MOCKER) -> list[int]:
    engine = MockerEngine(config)
    await engine.start()
    tokens = [t async for out in engine.generate(req) for t in out.token_ids]
    await engine.stop()
    return tokens


async def zero_blocks(s: DisaggStack) -> None:
    for engine in [*s.prefill, *s.decode]:
        for _ in range(300):
            if engine.load().num_active_blocks == 0:
                break
            await asyncio.sleep(0.01)  # released from the agents' threads
        assert engine.load().num_active_blocks == 0
        engine.engine.scheduler.check_integrity()  # type: ignore[attr-defined]


def hold_pushes(s: DisaggStack) -> threading.Event:
    """The prefill's pushes wait (in their transfer thread) until the event is set."""
    agent: Any = s.prefill[0].agent
    gate, push = threading.Event(), agent.push

    def held(*args: Any, **kw: Any) -> Any:
        assert gate.wait(10), "the push was never released"
        return push(*args, **kw)

    agent.push = held
    return gate


async def test_first_token_reaches_the_client_before_the_kv_moves() -> None:
    want = await aggregated(request("e"))
    async with AsyncExitStack() as stack:
        s = await start_stack(stack, lambda: MockerEngine(MOCKER), worker=WORKER, route=ROUTE)
        gate = hold_pushes(s)
        stream = s.streamer.stream(request("e"), s.router)
        first = await asyncio.wait_for(anext(stream), 5)
        decode_agent: Any = s.decode[0].agent
        assert first.token_ids == want[:1] and first.finish_reason is None
        assert decode_agent.stats.num_complete == 0  # nothing was pushed yet
        gate.set()
        tokens = list(first.token_ids)
        async for out in stream:
            tokens += out.token_ids
        assert tokens == want
        side: Any = s.decode[0].decode
        assert (side.num_resumed_after_first, side.num_fallbacks) == (1, 0)
        assert decode_agent.stats.num_complete == 1 and s.streamer.num_rejoined == 0
        await zero_blocks(s)


async def test_request_ending_at_its_first_token_frees_the_rendezvous() -> None:
    async with AsyncExitStack() as stack:
        s = await start_stack(stack, lambda: MockerEngine(MOCKER), worker=WORKER, route=ROUTE)
        tokens, reason = await s.generate(request("one", max_tokens=1))
        assert (tokens, reason) == ((await aggregated(request("one", max_tokens=1))), "length")
        await zero_blocks(s)
        decode_agent: Any = s.decode[0].agent
        assert decode_agent.stats.num_complete == 0  # no KV moved for a one-token answer


async def test_decode_that_chose_another_first_token_is_continued_after_the_clients() -> None:
    """The prefill's blocks do not fit the decode's (block size 8 vs 4), so the push fails
    and the decode prefills itself; its engine (another vocabulary) picks another first
    token than the one the client already has."""
    other = MockerConfig(num_blocks=256, block_size=8, speedup_ratio=0, tokenizer=None,
                         vocab_size=30000)  # fmt: skip
    made: list[MockerEngine] = []

    def make() -> MockerEngine:  # the prefill worker is built first
        made.append(MockerEngine(other if not made else MOCKER))
        return made[-1]

    async with AsyncExitStack() as stack:
        s = await start_stack(stack, make, worker=WORKER, route=ROUTE)
        stream = s.streamer.stream(request("x"), s.router)
        tokens: list[int] = []
        reason = None
        async for out in stream:
            tokens += out.token_ids
            reason = out.finish_reason
        assert len(tokens) == 8 and reason == "length"
        prefill_token = (await aggregated(request("x"), other))[0]
        assert tokens[0] == prefill_token != (await aggregated(request("x")))[0]
        assert s.streamer.num_rejoined == 1
        side: Any = s.decode[0].decode
        assert side.num_fallbacks == 1
        await zero_blocks(s)
