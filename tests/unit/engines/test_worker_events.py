from __future__ import annotations

from tandem.engines.worker_events import KvEventPublisher
from tandem.protocols.kv_events import AllBlocksCleared, BlockStored, decode_batch
from tandem.runtime.events.memory import MemoryEventBus


def _stored(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[i], parent_hash=None, token_ids=list(range(1000, 1064)), block_size=64
    )


async def test_replay_buffer_stays_bounded_in_bytes_after_many_batches() -> None:
    """The replay buffer was bounded by batch count only (4096), holding every BlockStored's
    token ids as Python ints: tens of MB per worker in a soak. Now it is bounded in bytes
    too, and replays what it still holds exactly."""
    bus = MemoryEventBus()
    pub = KvEventPublisher(bus, "t.kv", "w1", buffer_size=100_000, buffer_bytes=64 << 10)
    for i in range(5000):
        await pub.publish([_stored(i)])
    assert pub.num_buffered_bytes <= 64 << 10
    assert 0 < pub.num_buffered < 5000

    recent = pub.event_id - 10
    replay = [decode_batch(p) for p in pub.state_reply(recent, lambda: [])]
    assert [b.event_id for b in replay] == list(range(recent + 1, pub.event_id + 1))
    assert not pub.can_replay_after(1)  # long gone: the router gets the full state instead
    (full,) = [decode_batch(p) for p in pub.state_reply(1, lambda: [_stored(7)])]
    assert isinstance(full.events[0], AllBlocksCleared)
    assert full.event_id == pub.event_id
    await bus.close()


async def test_replay_buffer_count_bound_still_applies() -> None:
    bus = MemoryEventBus()
    pub = KvEventPublisher(bus, "t.kv", "w1", buffer_size=3)
    for i in range(10):
        await pub.publish([_stored(i)])
    assert pub.num_buffered == 3
    assert pub.can_replay_after(7) and not pub.can_replay_after(6)
    assert pub.state_reply(pub.event_id, lambda: []) == []
    await bus.close()
