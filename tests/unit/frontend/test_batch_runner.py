"""`BatchRunner` on an in-memory `BatchStore` with a fake `execute`: no line starts while
interactive traffic queues (busy), at most `max_inflight` run, retryable answers run again,
and leases keep two runners off one batch until the holder lets go."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.frontend.batch.config import BatchConfig
from tandem.frontend.batch.runner import BatchRunner
from tandem.frontend.batch.store import BatchStore, NewLine

pytestmark = pytest.mark.timeout(20)


def _store(num_lines: int) -> BatchStore:
    store = BatchStore(None)
    body = {"id": "batch_1", "status": "in_progress", "created_at": 1, "expires_at": 2**40,
            "endpoint": "/v1/chat/completions"}  # fmt: skip
    lines = [NewLine(f"c{i}", json.dumps({"model": "m", "i": i}).encode(), None)
             for i in range(num_lines)]  # fmt: skip
    store.add_batch(body, "key:a", lines)
    return store


async def test_no_line_starts_while_busy_and_at_most_max_inflight_run() -> None:
    store, gate, started = _store(5), asyncio.Event(), []
    busy = True

    async def execute(url: str, body: bytes, owner: str, request_id: str) -> tuple[int, bytes]:
        started.append(request_id)
        await gate.wait()
        return 200, b"{}"

    runner = BatchRunner(store, BatchConfig(max_inflight=2), execute, lambda: busy)
    await runner.tick()
    await asyncio.sleep(0)
    assert started == [] and runner.num_inflight == 0
    busy = False
    async with asyncio.timeout(5):
        while len(started) < 2:
            await runner.tick()
            await asyncio.sleep(0.01)
    await runner.tick()  # room for none: two are in flight
    await asyncio.sleep(0.05)
    assert len(started) == 2 and runner.num_inflight == 2
    gate.set()
    async with asyncio.timeout(5):
        while store.batch("batch_1", None)["status"] != "completed":  # type: ignore[index]
            await runner.tick()
            await asyncio.sleep(0.01)
    assert store.batch("batch_1", None)["request_counts"] == {"total": 5, "completed": 5,  # type: ignore[index]
                                                              "failed": 0}  # fmt: skip
    await runner.close()


async def test_retryable_answers_run_again_and_a_400_is_final() -> None:
    store = _store(2)
    answers = {0: [503, 429, 200], 1: [400]}  # by line

    async def execute(url: str, body: bytes, owner: str, request_id: str) -> tuple[int, bytes]:
        status = answers[json.loads(body)["i"]].pop(0)
        return status, json.dumps({"status": status}).encode()

    runner = BatchRunner(store, BatchConfig(max_inflight=1), execute)
    async with asyncio.timeout(10):
        while store.batch("batch_1", None)["status"] != "completed":  # type: ignore[index]
            await runner.tick()
            await asyncio.sleep(0.01)
    assert runner.num_retries == 2
    counts = store.batch("batch_1", None)["request_counts"]  # type: ignore[index]
    assert counts == {"total": 2, "completed": 1, "failed": 1}
    errors = [json.loads(x) for x in store.results("batch_1", "failed")]
    assert errors[0]["response"]["status_code"] == 400
    await runner.close()


async def test_a_lease_keeps_a_second_runner_off_until_released() -> None:
    store = _store(1)
    a = store.claim("runner-a", 60.0)
    assert [batch_id for batch_id, _, _ in a] == ["batch_1"]
    assert store.claim("runner-b", 60.0) == []
    store.release("runner-a")
    assert [batch_id for batch_id, _, _ in store.claim("runner-b", 60.0)] == ["batch_1"]


async def test_a_validating_batch_goes_in_progress_when_a_runner_takes_it_unless_cancelled() -> (
    None
):
    """OpenAI's walk: a batch is created `validating` and a runner moves it to `in_progress`
    (with `in_progress_at`); a cancel that lands first is not overwritten."""

    async def execute(url: str, body: bytes, owner: str, request_id: str) -> tuple[int, bytes]:
        return 200, b"{}"

    store = _store(1)
    store.update("batch_1", "validating", in_progress_at=None)
    runner = BatchRunner(store, BatchConfig(), execute, lambda: True)  # busy: no line starts
    await runner.tick()
    batch = store.batch("batch_1", None)
    assert batch is not None and batch["status"] == "in_progress" and batch["in_progress_at"]
    store.update("batch_1", "cancelling")
    store.begin("batch_1", 5)  # a runner that read `validating` before the cancel
    assert store.batch("batch_1", None)["status"] == "cancelling"  # type: ignore[index]
    await runner.close()
