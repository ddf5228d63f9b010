"""The progress watchdog in EngineStreamer, over a fake request plane: a frozen worker's
streams move to another worker, the frozen worker gets no new requests until it answers a
probe, and a busy worker's queued request is not mistaken for a frozen one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from tests.support.eventually import eventually
from tests.support.instances import backend_instance
from tests.support.payloads import AwaitedPayloads

from tandem.errors import NoWorkersAvailable
from tandem.frontend.migration import EngineStreamer
from tandem.frontend.watchdog import StallConfig, StreamStalled
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
    decode_request,
    encode,
)
from tandem.router.config import RouterConfig
from tandem.router.policy_router import RoundRobinRouter
from tandem.router.source import StaticInstanceSet

pytestmark = pytest.mark.timeout(20)
STALL = StallConfig(
    first_token_timeout_s=0.2, stall_timeout_s=0.1, probe_interval_s=0.05, probe_timeout_s=0.1
)


class FakeWorkers:
    """A request plane: address -> behaviour. A frozen address never answers; others stream
    `max_tokens` tokens, one per `step_s` (after `first_delay_s`)."""

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Event] = {}  # cleared while the address is frozen
        self.first_delay_s: dict[str, float] = {}
        self.step_s = 0.005
        self.requests: list[tuple[str, str]] = []  # (address, request_id)
        self.answering: dict[str, bool] = {}  # address -> whether it answers a PING
        self.dropped: list[str] = []  # addresses whose pooled connection was dropped

    def stream(
        self, address: str, path: str, payload: bytes, *, request_id: str, **_: object
    ) -> AwaitedPayloads:
        self.requests.append((address, request_id))
        return AwaitedPayloads(self._serve(address, decode_request(payload)))

    def running(self, address: str) -> asyncio.Event:
        if address not in self._running:
            self._running[address] = asyncio.Event()
            self._running[address].set()
        return self._running[address]

    def freeze(self, address: str) -> None:
        self.running(address).clear()

    def thaw_all(self) -> None:
        for event in self._running.values():
            event.set()

    async def _serve(self, address: str, request: PreprocessedRequest) -> AsyncIterator[bytes]:
        """Continues after the prompt's generated tokens (a migrated request's prompt holds
        them), so a whole answer is 0, 1, 2, ... however often it moved."""
        await self.running(address).wait()
        await asyncio.sleep(self.first_delay_s.get(address, 0.0))
        n = request.stop.max_tokens
        start = len(request.token_ids) - 3
        for i in range(start, start + n):
            await self.running(address).wait()
            await asyncio.sleep(self.step_s)
            yield encode(
                EngineOutput(token_ids=[i], finish_reason="length" if i == start + n - 1 else None)
            )

    def peer_silent_s(self, address: str) -> float | None:
        return 0.0

    async def answers(self, address: str, within_s: float) -> bool:
        return self.answering.get(address, True)

    def drop(self, address: str, reason: str) -> None:
        self.dropped.append(address)

    async def close(self) -> None:
        pass


def _request(rid: str, max_tokens: int = 40) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=max_tokens)
    )


def _setup(migration_limit: int = 3) -> tuple[FakeWorkers, EngineStreamer, RoundRobinRouter]:
    workers = FakeWorkers()
    streamer = EngineStreamer(
        workers, "tandem.backend.generate", migration_limit=migration_limit, stall=STALL
    )
    instances = StaticInstanceSet([backend_instance(0), backend_instance(1)])
    return workers, streamer, RoundRobinRouter(RouterConfig(), instances=instances)


async def _tokens(
    streamer: EngineStreamer, router: RoundRobinRouter, rid: str, max_tokens: int = 40
) -> list[int]:
    outputs = streamer.stream(_request(rid, max_tokens), router)
    return [t async for out in outputs for t in out.token_ids]


async def test_frozen_worker_streams_migrate_and_it_returns_after_a_probe() -> None:
    workers, streamer, router = _setup()
    w0 = "127.0.0.1:9000"
    streams = [asyncio.create_task(_tokens(streamer, router, f"r{i}")) for i in range(4)]
    await eventually(lambda: len(workers.requests) == 4)
    workers.freeze(w0)  # SIGSTOP: alive, connected, silent
    results = await asyncio.wait_for(asyncio.gather(*streams), 5)
    assert all(r == list(range(40)) for r in results)  # one unbroken stream each
    assert streamer.health is not None and set(streamer.health.suspects) == {"w0"}
    assert w0 in workers.dropped  # probed and served again over a fresh connection

    before = len([r for a, r in workers.requests if a == w0 and not r.startswith("probe")])
    assert await _tokens(streamer, router, "later") == list(range(40))
    routed_w0 = [r for a, r in workers.requests if a == w0 and not r.startswith("probe")]
    assert len(routed_w0) == before  # no new request for the frozen worker

    workers.thaw_all()  # SIGCONT: the next probe answers
    await eventually(lambda: not streamer.health.suspects, timeout_s=3)
    assert any(r.startswith("probe") for a, r in workers.requests if a == w0)
    await streamer.close()


async def test_without_migration_a_stalled_stream_fails_clearly() -> None:
    workers, streamer, router = _setup(migration_limit=0)
    workers.freeze("127.0.0.1:9000")
    workers.freeze("127.0.0.1:9001")
    with pytest.raises(NoWorkersAvailable):  # both stalled before any output: 503
        await asyncio.wait_for(_tokens(streamer, router, "r"), 5)
    workers.thaw_all()
    await eventually(lambda: not streamer.health.suspects, timeout_s=3)

    outputs = streamer.stream(_request("r2", max_tokens=200), router)
    await anext(outputs)
    workers.freeze(workers.requests[-1][0])
    with pytest.raises(StreamStalled, match=r"no next output within 0\.1 s"):
        async for _ in outputs:
            pass
    await streamer.close()


async def test_busy_worker_queued_request_is_not_abandoned() -> None:
    """No first token for longer than first_token_timeout_s, but the worker streams tokens
    for another request meanwhile: the queued request waits instead of moving."""
    workers, streamer, router = _setup(migration_limit=0)
    busy = asyncio.create_task(_tokens(streamer, router, "busy", 200))  # w0: >= 1 s of tokens
    await eventually(lambda: len(workers.requests) == 1)
    workers.first_delay_s["127.0.0.1:9000"] = 0.5  # queued behind it: 0.5 s to first token
    router._counter = 0  # round robin: the next request goes to w0 as well
    assert await _tokens(streamer, router, "queued") == list(range(40))
    assert workers.requests[-1] == ("127.0.0.1:9000", "queued")
    assert await busy == list(range(200))
    assert streamer.health is not None and not streamer.health.suspects
    await streamer.close()


async def test_streams_waiting_for_a_first_token_leave_a_worker_found_stalled_at_once() -> None:
    """One stream finds the worker stalled (no next token); a request queued there for its
    first token does not sit out its own, longer limit."""
    workers = FakeWorkers()
    slow_first = StallConfig(first_token_timeout_s=10.0, stall_timeout_s=0.1)
    streamer = EngineStreamer(workers, "p", migration_limit=3, stall=slow_first)
    instances = StaticInstanceSet([backend_instance(0), backend_instance(1)])
    router = RoundRobinRouter(RouterConfig(), instances=instances)
    running = asyncio.create_task(_tokens(streamer, router, "running", 100))
    await eventually(lambda: len(workers.requests) == 1)
    workers.first_delay_s["127.0.0.1:9000"] = 30.0  # a new request there waits for a token
    router._counter = 0
    queued = asyncio.create_task(_tokens(streamer, router, "queued"))
    await eventually(lambda: len(workers.requests) == 2)
    workers.freeze("127.0.0.1:9000")
    results = await asyncio.wait_for(asyncio.gather(running, queued), 3)  # not 10 s
    assert results == [list(range(100)), list(range(40))]
    await streamer.close()


LONG_STALL = StallConfig(first_token_timeout_s=30.0, stall_timeout_s=30.0)


async def test_streams_of_a_silent_worker_that_left_discovery_migrate_at_once() -> None:
    """Its lease expired (host lost, process frozen): no 30 s stall wait, and it is not kept
    out as a suspect when it registers again."""
    workers = FakeWorkers()
    streamer = EngineStreamer(workers, "p", migration_limit=3, stall=LONG_STALL)
    instances = StaticInstanceSet([backend_instance(0), backend_instance(1)])
    router = RoundRobinRouter(RouterConfig(), instances=instances)
    w0 = "127.0.0.1:9000"
    streams = [asyncio.create_task(_tokens(streamer, router, f"r{i}", 100)) for i in range(4)]
    await eventually(lambda: len(workers.requests) == 4)
    workers.freeze(w0)
    workers.answering[w0] = False  # no PONG
    await asyncio.sleep(0.05)
    assert await streamer.worker_left("w0", w0)
    results = await asyncio.wait_for(asyncio.gather(*streams), 3)  # not 30 s
    assert all(r == list(range(100)) for r in results)
    assert workers.dropped == [w0]
    assert streamer.health is not None and not streamer.health.suspects
    await streamer.close()


async def test_streams_of_a_draining_worker_that_left_discovery_finish_there() -> None:
    """It unregistered to shut down gracefully and still answers: its streams stay."""
    workers, streamer, router = _setup(migration_limit=0)
    streams = [asyncio.create_task(_tokens(streamer, router, f"r{i}", 60)) for i in range(2)]
    await eventually(lambda: len(workers.requests) == 2)
    assert not await streamer.worker_left("w0", "127.0.0.1:9000")  # it answers: draining
    assert await asyncio.wait_for(asyncio.gather(*streams), 5) == [list(range(60))] * 2
    assert workers.dropped == [] and len(workers.requests) == 2  # nothing moved
    await streamer.close()
