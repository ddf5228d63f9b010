from __future__ import annotations

import asyncio

import pytest

from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.events.subject import compile_matcher

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("a.b.c", "a.b.c", True),
        ("a.b.c", "a.b", False),
        ("a.*.c", "a.x.c", True),
        ("a.*.c", "a.x.y.c", False),
        ("a.>", "a.b", True),
        ("a.>", "a.b.c.d", True),
        ("a.>", "a", False),
        ("*.kv.>", "w1.kv.x.y", True),
        ("*", "a.b", False),
        (">", "a.b", True),
    ],
)
def test_nats_wildcards(pattern: str, subject: str, expected: bool) -> None:
    assert compile_matcher(pattern)(subject) is expected


@pytest.mark.parametrize("bad", ["", "a..b", "a.>.b", "a.b*", "a.*x"])
def test_malformed_patterns_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="subject"):
        compile_matcher(bad)


async def test_publish_reaches_matching_subscriptions_in_order() -> None:
    bus = MemoryEventBus()
    kv = await bus.subscribe("tandem.kv.>")
    w1 = await bus.subscribe("tandem.*.w1")
    for i in range(3):
        await bus.publish("tandem.kv.w1", b"%d" % i)
    await bus.publish("tandem.load.w1", b"L")
    got = [await anext(kv) for _ in range(3)]
    assert got == [("tandem.kv.w1", b"0"), ("tandem.kv.w1", b"1"), ("tandem.kv.w1", b"2")]
    assert [await anext(w1) for _ in range(4)][-1] == ("tandem.load.w1", b"L")
    await bus.close()


async def test_slow_subscriber_drops_oldest_and_counts() -> None:
    bus = MemoryEventBus(buffer_size=3)
    sub = await bus.subscribe("s")
    for i in range(10):
        await bus.publish("s", b"%d" % i)
    assert sub.num_dropped == 7
    assert [(await anext(sub))[1] for _ in range(3)] == [b"7", b"8", b"9"]


async def test_close_ends_a_blocked_iterator() -> None:
    bus = MemoryEventBus()
    sub = await bus.subscribe("s")
    waiter = asyncio.create_task(anext(sub, None))
    await asyncio.sleep(0)
    await sub.close()
    assert await asyncio.wait_for(waiter, 2) is None
    await bus.publish("s", b"x")  # no longer delivered, no error


async def test_publish_with_wildcard_is_rejected() -> None:
    with pytest.raises(ValueError, match="wildcards"):
        await MemoryEventBus().publish("a.*", b"")
