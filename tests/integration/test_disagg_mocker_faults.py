"""Failure paths of disaggregation on mocker workers in one process (real TCP request plane
and transfer agents): pins expire, a stalled transfer times out within the bound and falls
back or fails clearly, aborts reach the other leg, and block accounting returns to zero."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.disagg_stack import start_stack
from tandem.disagg.config import DisaggRouteConfig, DisaggWorkerConfig
from tandem.disagg.params import DisaggParams
from tandem.disagg.worker_engine import DisaggEngine
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.errors import NoWorkersAvailable, TransferError
from tandem.protocols.engine import (
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
)
from tandem.transfer import decode_meta, encode_meta

pytestmark = pytest.mark.timeout(30)
FAST = ("shm", "tcp")  # nixl/mooncake start busy threads; not what these tests are about
WORKER = DisaggWorkerConfig(mode="decode", backends=FAST)
MOCKER = MockerConfig(num_blocks=256, block_size=4, speedup_ratio=0, tokenizer=None)


def mocker() -> MockerEngine:
    return MockerEngine(MOCKER)


def request(rid: str, n: int = 30, max_tokens: int = 8) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model=MOCKER.model_name,
        token_ids=list(range(100, 100 + n)),
        sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


async def aggregated_tokens(req: PreprocessedRequest) -> list[int]:
    engine = mocker()
    await engine.start()
    tokens = [t async for out in engine.generate(req) for t in out.token_ids]
    await engine.stop()
    return tokens


async def zero_blocks(engine: DisaggEngine, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.load().num_active_blocks and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)  # polls another thread's state (the agent's reaper)
    assert engine.load().num_active_blocks == 0
    engine.engine.scheduler.check_integrity()  # type: ignore[attr-defined]


async def collect(gen) -> tuple[list[int], object]:
    tokens, last = [], None
    async for out in gen:
        tokens += out.token_ids
        last = out
    return tokens, last


async def test_mocker_stack_both_flows_match_aggregated() -> None:
    want = await aggregated_tokens(request("a"))
    for flow in ("prefill-first", "decode-first"):
        async with AsyncExitStack() as stack:
            s = await start_stack(
                stack, mocker, worker=WORKER, route=DisaggRouteConfig(enabled=True, flow=flow)
            )
            tokens, reason = await s.generate(request(f"x-{flow}"))
            assert (tokens, reason) == (want, "length")
            for e in [*s.prefill, *s.decode]:
                await zero_blocks(e)


async def test_unclaimed_pins_expire_at_ttl() -> None:
    engine = DisaggEngine(
        mocker(), DisaggWorkerConfig(mode="prefill", pin_ttl_s=0.3, backends=FAST)
    )
    await engine.start()
    try:
        tokens, out = await collect(engine.generate(request("p")))
        assert len(tokens) == 1 and out.disagg_params is not None  # type: ignore[attr-defined]
        assert engine.load().num_active_blocks == 8  # ceil(30 / 4) prompt blocks pinned
        await zero_blocks(engine, timeout_s=3.0)
        assert engine.agent is not None and engine.agent.stats.num_expired == 1
    finally:
        await engine.stop()


@pytest.mark.parametrize("policy", ["local", "fail"])
async def test_stalled_transfer_times_out_within_bound(policy: str) -> None:
    """The prefill's agent accepts but never answers: the pull gives up after the timeout."""
    silent = socket.create_server(("127.0.0.1", 0))
    prefill = DisaggEngine(mocker(), DisaggWorkerConfig(mode="prefill", backends=FAST))
    cfg = DisaggWorkerConfig(
        mode="decode", transfer_timeout_s=0.5, on_transfer_failure=policy, backends=FAST
    )
    decode = DisaggEngine(mocker(), cfg)
    await prefill.start()
    await decode.start()
    try:
        first, out = await collect(prefill.generate(request("s")))
        params = DisaggParams.from_dict(out.disagg_params)  # type: ignore[attr-defined]
        meta = msgspec.structs.replace(decode_meta(params.meta), address=silent.getsockname())
        params.meta = encode_meta(meta)
        req = request("s")
        leg = msgspec.structs.replace(req, token_ids=req.token_ids + first,
                                      stop=msgspec.structs.replace(req.stop, max_tokens=7),
                                      disagg_params=params.to_dict())  # fmt: skip
        started = time.monotonic()
        if policy == "local":
            tokens, _ = await collect(decode.generate(leg))
            assert first + tokens == await aggregated_tokens(req)
            assert decode.decode is not None and decode.decode.num_fallbacks == 1
        else:
            with pytest.raises(TransferError, match=r"did not arrive.*timed out"):
                await collect(decode.generate(leg))
        assert time.monotonic() - started < 3.0
        await zero_blocks(decode)
        prefill.agent.cancel(meta.op_id)  # type: ignore[union-attr]  # nobody will claim it
        await zero_blocks(prefill)
    finally:
        silent.close()
        await prefill.stop()
        await decode.stop()


async def test_client_gone_after_first_token_releases_prefill_pins_before_ttl() -> None:
    async with AsyncExitStack() as stack:
        s = await start_stack(
            stack, mocker, worker=DisaggWorkerConfig(mode="decode", pin_ttl_s=60, backends=FAST)
        )
        stream = s.streamer.stream(request("c", max_tokens=50), s.router)
        first = await anext(stream)
        assert len(first.token_ids) == 1
        await stream.aclose()  # the client disconnects before the decode leg started
        await zero_blocks(s.prefill[0], timeout_s=3.0)
        assert s.prefill[0].agent.stats.num_cancelled == 1  # type: ignore[union-attr]


async def test_decode_abort_while_waiting_for_push_reaches_prefill() -> None:
    prefill = DisaggEngine(
        mocker(), DisaggWorkerConfig(mode="prefill", transfer_timeout_s=5, backends=FAST)
    )
    decode = DisaggEngine(
        mocker(), DisaggWorkerConfig(mode="decode", transfer_timeout_s=5, backends=FAST)
    )
    await prefill.start()
    await decode.start()
    try:
        req = request("d")
        room = DisaggParams(mode="rendezvous", op_id="room-d", num_tokens=len(req.token_ids))
        leg = decode.generate(msgspec.structs.replace(req, disagg_params=room.to_dict()))
        waiting = asyncio.ensure_future(anext(leg))
        while decode.load().num_active_blocks == 0:  # noqa: ASYNC110 (rendezvous published)
            await asyncio.sleep(0.01)
        waiting.cancel()  # the decode leg is aborted
        await asyncio.gather(waiting, return_exceptions=True)
        await zero_blocks(decode)
        assert decode.agent is not None
        push = DisaggParams(mode="push", op_id="room-d", address=decode.agent.address)
        started = time.monotonic()
        with pytest.raises(TransferError):
            await collect(prefill.generate(msgspec.structs.replace(
                req, disagg_params=push.to_dict())))  # fmt: skip
        assert time.monotonic() - started < 3.0  # told at once, not after its 5 s timeout
        await zero_blocks(prefill)
    finally:
        await prefill.stop()
        await decode.stop()


async def test_no_prefill_worker_503_or_decode_fallback() -> None:
    for fallback in (False, True):
        async with AsyncExitStack() as stack:
            route = DisaggRouteConfig(enabled=True, decode_fallback=fallback)
            s = await start_stack(stack, mocker, num_prefill=0, worker=WORKER, route=route)
            if not fallback:
                with pytest.raises(
                    NoWorkersAvailable, match=r"no prefill worker.*--decode-fallback"
                ):
                    await s.generate(request("n"))
            else:
                assert await s.generate(request("n")) == (
                    await aggregated_tokens(request("n")),
                    "length",
                )


async def test_conditional_disagg_keeps_short_prompts_on_decode() -> None:
    async with AsyncExitStack() as stack:
        route = DisaggRouteConfig(enabled=True, min_prefill_tokens=20)
        s = await start_stack(stack, mocker, worker=WORKER, route=route)
        await s.generate(request("short", n=10))
        await s.generate(request("long", n=40))
        assert (s.streamer.num_local, s.streamer.num_remote) == (1, 1)
        assert s.prefill[0].agent.stats.num_created == 1  # type: ignore[union-attr]
