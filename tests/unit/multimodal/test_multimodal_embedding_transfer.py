"""Embeddings through the transfer layer: pulled exactly, the pull frees the encoder's slots, an
unclaimed op frees them at its TTL, a full pool refuses with 503, and a gone op is a clear error."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from tests.support.eventually import eventually

from tandem.errors import Overloaded, TransferError
from tandem.multimodal.embedding_cache import EmbeddingCache
from tandem.multimodal.embedding_transfer import EmbeddingReceiver, EmbeddingSender
from tandem.transfer import TransferAgent, TransferAgentConfig

ROWS, HIDDEN = 50, 576


@pytest.fixture(params=["shm", "tcp"])
def agents(request: pytest.FixtureRequest) -> Iterator[tuple[TransferAgent, TransferAgent]]:
    config = TransferAgentConfig(backends=(request.param,))
    with TransferAgent(config) as owner, TransferAgent(config) as peer:
        yield owner, peer


def _embeddings(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((ROWS, HIDDEN), dtype=np.float32) for _ in range(n)]


async def test_pull_returns_exact_embeddings_and_frees_slots(agents) -> None:
    owner, peer = agents
    sender = EmbeddingSender(owner, slot_bytes=ROWS * HIDDEN * 4, num_slots=8, ttl_s=30)
    receiver = EmbeddingReceiver(peer, num_slots=8)
    embs = _embeddings(3)
    handles = sender.offer(embs, [11, 22, 33])
    assert [h.mm_hash for h in handles] == [11, 22, 33]
    assert handles[0].shape == (ROWS, HIDDEN) and handles[0].dtype == "float32"
    assert sender.num_held == 3
    got = receiver.pull(handles, timeout_s=5)
    assert all(np.array_equal(a, b) for a, b in zip(got, embs, strict=True))
    await eventually(lambda: sender.num_held == 0, timeout_s=5)  # the pull acknowledged the op


async def test_unpulled_embeddings_are_freed_at_ttl(agents) -> None:
    owner, peer = agents
    sender = EmbeddingSender(owner, slot_bytes=ROWS * HIDDEN * 4, num_slots=4, ttl_s=0.2)
    handles = sender.offer(_embeddings(2), [1, 2])
    assert sender.num_held == 2
    await eventually(lambda: sender.num_held == 0, timeout_s=5)
    with pytest.raises(TransferError, match="expired"):
        EmbeddingReceiver(peer).pull(handles, timeout_s=2)


def test_full_pool_is_overloaded_not_a_wait(agents) -> None:
    owner, _ = agents
    sender = EmbeddingSender(owner, slot_bytes=ROWS * HIDDEN * 4, num_slots=2, ttl_s=30)
    sender.offer(_embeddings(2), [1, 2])
    with pytest.raises(Overloaded, match="pool of 2"):
        sender.offer(_embeddings(1), [3])


def test_embedding_larger_than_a_slot_is_refused(agents) -> None:
    owner, _ = agents
    sender = EmbeddingSender(owner, slot_bytes=64, num_slots=2, ttl_s=30)
    with pytest.raises(ValueError, match="does not fit"):
        sender.offer(_embeddings(1), [1])


def test_cache_evicts_least_recently_used_by_bytes() -> None:
    one = np.zeros((ROWS, HIDDEN), np.float32)
    cache = EmbeddingCache(capacity_bytes=2 * one.nbytes)
    cache.put(1, one)
    cache.put(2, one.copy())
    assert cache.get(1) is one  # 1 is now the most recent
    cache.put(3, one.copy())
    cache.check_integrity()
    assert cache.get(2) is None and cache.get(1) is not None and cache.get(3) is not None
    assert (cache.num_hits, cache.num_misses, cache.num_evictions) == (3, 1, 1)
    off = EmbeddingCache(capacity_bytes=0)
    off.put(1, one)
    assert off.get(1) is None
