"""Worker + MockerEngine over memory discovery/events and the real TCP request plane."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from tandem import errors
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.protocols import kv_events as kv
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
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(15)
BS = 4


@dataclass
class Stack:
    worker: Worker
    engine: MockerEngine
    instance: Instance
    client: Runtime
    discovery: MemoryDiscovery
    events: MemoryEventBus


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    disc, bus = MemoryDiscovery(), MemoryEventBus()
    cfg = RuntimeConfig(namespace="t")
    # speedup 10: a decode step takes ~0.6 ms, so a long request stays in flight for seconds
    engine = MockerEngine(
        MockerConfig(num_blocks=1024, block_size=BS, speedup_ratio=10, tokenizer=None)
    )
    async with (
        open_runtime(cfg, discovery=disc, events=bus) as worker_rt,
        open_runtime(cfg, discovery=disc, events=bus) as client_rt,
    ):
        worker = Worker(engine, worker_rt, WorkerConfig(event_buffer_size=4, metrics_period_s=0.2))
        instance = await worker.start()
        yield Stack(worker, engine, instance, client_rt, disc, bus)
        await worker.stop(grace_s=0)


def _req(rid: str, tokens: list[int], max_tokens: int, **kw: object) -> bytes:
    return encode(
        PreprocessedRequest(
            request_id=rid,
            model="smollm2",
            token_ids=tokens,
            stop=StopConditions(max_tokens=max_tokens),
            **kw,  # type: ignore[arg-type]
        )
    )


async def _generate(s: Stack, rid: str, tokens: list[int], max_tokens: int) -> list[EngineOutput]:
    stream = s.client.stream(s.instance, _req(rid, tokens, max_tokens), request_id=rid)
    return [decode_output(p) async for p in stream]


async def _kv_state(s: Stack, after: int | None) -> list[kv.KvEventBatch]:
    path = f"t.{s.worker.config.component}.kv_state"
    payload = kv.encode(kv.KvStateRequest(after_event_id=after))
    stream = s.client.client.stream(s.instance.address, path, payload, request_id="state")
    return [kv.decode_batch(p) async for p in stream]


async def _next_load(sub: object, pred: object) -> kv.LoadMetrics:
    async with asyncio.timeout(5):
        async for _, payload in sub:  # type: ignore[attr-defined]
            load = kv.decode_load(payload)
            if pred(load):  # type: ignore[operator]
                return load
    raise AssertionError("load metrics subscription ended")


async def test_registers_instance_with_model_card(stack: Stack) -> None:
    [inst] = await stack.discovery.list_instances("t.backend.generate")
    assert inst.instance_id == stack.worker.instance_id == stack.instance.instance_id
    assert inst.address == stack.worker.runtime.server.address
    card = inst.model
    assert card is not None
    assert (card.name, card.block_size, card.num_total_blocks, card.eos_token_ids) == (
        "smollm2",
        BS,
        1024,
        [2],
    )


async def test_generate_streams_and_publishes_consecutive_kv_events(stack: Stack) -> None:
    sub = await stack.events.subscribe("t.backend.kv_events")
    prompt = list(range(10))
    outs = await _generate(stack, "a", prompt, 6)
    assert sum(len(o.token_ids) for o in outs) == 6 and outs[-1].finish_reason == "length"
    assert outs[0].num_cached_tokens == 0
    again = await _generate(stack, "b", prompt, 1)
    assert again[0].num_cached_tokens == 8  # two full prompt blocks reused
    computed = prompt + [t for o in outs for t in o.token_ids][:-1]
    stored: list[int] = []
    ids: list[int] = []
    async with asyncio.timeout(5):
        async for _, payload in sub:
            batch = kv.decode_batch(payload)
            assert batch.worker_id == stack.worker.instance_id
            ids.append(batch.event_id)
            stored += [
                h for e in batch.events if isinstance(e, kv.BlockStored) for h in e.block_hashes
            ]
            if len(stored) >= len(computed) // BS:
                break
    assert ids == list(range(1, len(ids) + 1))
    assert stored == sequence_hashes(computed, BS)


async def test_client_cancel_aborts_and_frees_blocks(stack: Stack) -> None:
    loads = await stack.events.subscribe("t.backend.load_metrics")
    stream = stack.client.stream(
        stack.instance, _req("long", [1] * 9, 1_000_000), request_id="long"
    )
    first = decode_output(await anext(stream))
    assert first.token_ids
    await _next_load(loads, lambda m: m.num_running == 1)
    await stream.aclose()
    freed = await _next_load(loads, lambda m: m.num_running == 0)
    assert freed.num_active_blocks == 0 and freed.worker_id == stack.worker.instance_id
    stack.engine.scheduler.check_integrity()


async def test_deadline_ends_the_request_and_frees_blocks(stack: Stack) -> None:
    loads = await stack.events.subscribe("t.backend.load_metrics")
    rid = "late"
    stream = stack.client.stream(
        stack.instance, _req(rid, [3] * 9, 1_000_000), request_id=rid, deadline_s=time.time() + 0.2
    )
    with pytest.raises(errors.DeadlineExceeded):
        async for _ in stream:
            pass
    await _next_load(loads, lambda m: m.num_running == 0 and m.num_active_blocks == 0)


async def test_invalid_request_reaches_the_client(stack: Stack) -> None:
    with pytest.raises(errors.InvalidRequest, match="empty"):
        await _generate(stack, "empty", [], 5)
    with pytest.raises(errors.InvalidRequest, match="PreprocessedRequest"):
        [_ async for _ in stack.client.stream(stack.instance, b"\x01", request_id="junk")]


async def test_kv_state_replays_after_an_id_or_sends_the_whole_set(stack: Stack) -> None:
    for i in range(3):
        await _generate(stack, f"r{i}", [i] * 8 + [9], 1)  # 2 stored blocks each, 1 batch
    last = stack.worker.kv_events.event_id
    assert last == 3
    replay = await _kv_state(stack, 1)
    assert [b.event_id for b in replay] == [2, 3]
    assert await _kv_state(stack, 3) == []
    [future] = await _kv_state(stack, 99)  # ids this worker never had: whole set
    assert future.event_id == 3 and isinstance(future.events[0], kv.AllBlocksCleared)
    [full] = await _kv_state(stack, None)
    assert full.event_id == 3 and isinstance(full.events[0], kv.AllBlocksCleared)
    hashes = {h for e in full.events if isinstance(e, kv.BlockStored) for h in e.block_hashes}
    assert hashes == {h for i in range(3) for h in sequence_hashes([i] * 8 + [9], BS)}
    for i in range(3, 6):  # buffer holds 4 batches: id 1 falls out
        await _generate(stack, f"r{i}", [i] * 8 + [9], 1)
    [too_old] = await _kv_state(stack, 1)
    assert too_old.event_id == 6 and isinstance(too_old.events[0], kv.AllBlocksCleared)


async def test_stop_unregisters_first_then_drains_inflight(stack: Stack) -> None:
    watch = stack.discovery.watch("t.backend.generate")
    assert (await anext(watch)).kind == "added"
    stream = stack.client.stream(stack.instance, _req("inflight", [5] * 9, 200), request_id="x")
    first = decode_output(await anext(stream))
    stopping = asyncio.create_task(stack.worker.stop(grace_s=5))
    assert (await asyncio.wait_for(anext(watch), 5)).kind == "removed"
    with pytest.raises(errors.PeerGone):  # new requests are refused while draining
        await _generate(stack, "new", [1, 2], 3)
    rest = [decode_output(p) async for p in stream]
    assert len(first.token_ids) + sum(len(o.token_ids) for o in rest) == 200
    assert rest[-1].finish_reason == "length"
    await asyncio.wait_for(stopping, 5)


async def test_stop_after_grace_fails_the_rest_with_peer_gone(stack: Stack) -> None:
    stream = stack.client.stream(stack.instance, _req("stuck", [5] * 9, 10**6), request_id="s")
    await anext(stream)
    await stack.worker.stop(grace_s=0.05)
    with pytest.raises(errors.PeerGone):
        async for _ in stream:
            pass
    assert stack.engine.load().num_active_blocks == 0


async def test_request_deadline_is_enforced_by_the_worker(stack: Stack) -> None:
    """A deadline carried only in the PreprocessedRequest (not on the request-plane frame)."""
    loads = await stack.events.subscribe("t.backend.load_metrics")
    payload = _req("d", [4] * 9, 1_000_000, deadline_s=time.time() + 0.1)
    with pytest.raises(errors.DeadlineExceeded, match="request_id=d"):
        async for _ in stack.client.stream(stack.instance, payload, request_id="d"):
            pass
    await _next_load(loads, lambda m: m.num_running == 0 and m.num_active_blocks == 0)
    past = _req("p", [4] * 9, 5, deadline_s=time.time() - 1)
    with pytest.raises(errors.DeadlineExceeded, match="after its deadline"):
        [_ async for _ in stack.client.stream(stack.instance, past, request_id="p")]


async def test_load_metrics_announced_at_start_and_follow_requests(stack: Stack) -> None:
    loads = await stack.events.subscribe("t.backend.load_metrics")
    idle = await _next_load(loads, lambda m: True)  # periodic, even with nothing running
    assert (idle.num_total_blocks, idle.worker_id) == (1024, stack.worker.instance_id)
    stream = stack.client.stream(stack.instance, _req("m", [6] * 9, 10**6), request_id="m")
    await anext(stream)
    busy = await _next_load(loads, lambda m: m.num_running == 1)
    assert busy.num_active_blocks >= 3
    await stream.aclose()
