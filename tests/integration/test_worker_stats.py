"""A worker's WorkerStats on the event plane: lifecycle in order, steps with their tokens."""

from __future__ import annotations

import asyncio

import pytest
from tests.support.eventually import eventually

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.protocols.engine import PreprocessedRequest, StopConditions, decode_output, encode
from tandem.protocols.scaling import WorkerStats, decode_worker_stats
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.runtime import open_runtime

pytestmark = pytest.mark.timeout(30)


async def test_worker_publishes_lifecycle_and_steps() -> None:
    async with open_runtime(RuntimeConfig()) as runtime:
        sub = await runtime.events.subscribe("tandem.*.worker_stats")
        seen: list[WorkerStats] = []

        async def read() -> None:
            async for _, payload in sub:
                seen.append(decode_worker_stats(payload))

        reader = asyncio.create_task(read())
        engine = MockerEngine(MockerConfig(tokenizer=None, block_size=16, speedup_ratio=100))
        worker = Worker(engine, runtime, WorkerConfig(stats_period_s=0.05))
        instance = await worker.start()
        req = PreprocessedRequest(request_id="r", model="smollm2", token_ids=list(range(20, 60)),
                                  stop=StopConditions(max_tokens=5))  # fmt: skip
        async for chunk in runtime.stream(instance, encode(req), request_id="r"):
            if decode_output(chunk).finish_reason:
                break
        await eventually(lambda: sum(len(s.steps) for s in seen) >= 5, timeout_s=5)
        await worker.stop()
        await eventually(lambda: seen and seen[-1].state == "stopped", timeout_s=5)
        reader.cancel()
        await sub.close()
    states = [s.state for s in seen]
    order = ["starting", "ready", "draining", "stopped"]
    assert [st for i, st in enumerate(states) if i == 0 or states[i - 1] != st] == order
    steps = [step for s in seen for step in s.steps]
    assert steps[0].num_prefill_tokens == 40 and steps[0].num_decode_kv_tokens == 0
    assert [s.num_decode_kv_tokens for s in steps[1:5]] == [41, 42, 43, 44]
    assert all(s.component == "backend" and s.worker_id == worker.instance_id for s in seen)
