"""OutputStream: the consumer's hand-off, and the direct sink that skips it mid-stream."""

from __future__ import annotations

import asyncio

import pytest

from tandem.engines.output_stream import OutputStream
from tandem.protocols.engine import EngineOutput

pytestmark = pytest.mark.timeout(10)


def _out(token: int, finish: str | None = None) -> EngineOutput:
    return EngineOutput(token_ids=[token], finish_reason=finish)  # type: ignore[arg-type]


async def _parked(stream: OutputStream) -> asyncio.Task[EngineOutput]:
    """A consumer task waiting in `get` (parked once the loop has run it)."""
    task = asyncio.create_task(stream.get())
    await asyncio.sleep(0)
    return task


async def test_direct_sink_takes_outputs_while_the_consumer_waits() -> None:
    taken: list[int] = []

    def sink(out: EngineOutput) -> bool:
        if out.finish_reason is not None:
            return False
        taken.append(out.token_ids[0])
        return True

    stream = OutputStream(sink)
    consumer = await _parked(stream)
    for t in range(5):
        stream.push(_out(t))
    assert taken == [0, 1, 2, 3, 4] and not consumer.done()  # never woken
    stream.push(_out(5, "length"))  # the sink refuses the last one: the consumer gets it
    last = await consumer
    assert last.token_ids == [5] and last.finish_reason == "length"


async def test_nothing_bypasses_an_output_already_queued() -> None:
    """Order: once the consumer has something to take, later outputs queue behind it."""
    taken: list[int] = []
    stream = OutputStream(lambda out: taken.append(out.token_ids[0]) is None)
    stream.push(_out(0))  # nobody waiting yet: queued
    consumer = asyncio.create_task(stream.get())  # will take output 0 without parking
    stream.push(_out(1))  # queued behind 0
    assert taken == []
    assert (await consumer).token_ids == [0, 1]  # merged, in order
    consumer = await _parked(stream)
    stream.push(_out(2))
    assert taken == [2] and not consumer.done()
    consumer.cancel()


async def test_a_refused_output_wakes_the_consumer_and_keeps_order() -> None:
    calls: list[int] = []

    def sink(out: EngineOutput) -> bool:
        calls.append(out.token_ids[0])
        return out.token_ids[0] != 1  # refuses 1 (no credit, say)

    stream = OutputStream(sink)
    consumer = await _parked(stream)
    stream.push(_out(0))
    stream.push(_out(1))
    stream.push(_out(2))  # 1 is queued for the consumer: 2 must follow it, not pass it
    assert calls == [0, 1]
    assert (await consumer).token_ids == [1, 2]


async def test_a_failing_sink_is_dropped_and_the_consumer_takes_over() -> None:
    def broken(out: EngineOutput) -> bool:
        raise RuntimeError("boom")

    stream = OutputStream(broken)
    consumer = await _parked(stream)
    stream.push(_out(0))  # must not raise into the producer (the engine's step loop)
    assert (await consumer).token_ids == [0]
    assert stream.direct is None
    stream.push(_out(1))
    assert (await stream.get()).token_ids == [1]
