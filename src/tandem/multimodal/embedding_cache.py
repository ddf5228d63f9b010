"""`EmbeddingCache`: an LRU of image embeddings keyed by mm_hash, bounded in bytes, in the
prefill / aggregated worker (`--mm-embedding-cache-mb`); a hit skips the encoder (DESIGN.md §10)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric


class EmbeddingCache:
    """mm_hash -> embedding (a tensor or array with `nbytes`/`numel`). Entries are shared, never
    copied: callers must not modify what they get. Thread-safe. `capacity_bytes=0` caches
    nothing (every lookup is a miss)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0
        self._entries: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, mm_hash: int) -> Any | None:
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is None:
                self.num_misses += 1
                return None
            self._entries.move_to_end(mm_hash)
            self.num_hits += 1
            return entry[0]

    def put(self, mm_hash: int, embedding: Any) -> None:
        size = _nbytes(embedding)
        if size > self.capacity_bytes:
            return
        with self._lock:
            old = self._entries.pop(mm_hash, None)
            if old is not None:
                self.num_bytes -= old[1]
            self._entries[mm_hash] = (embedding, size)
            self.num_bytes += size
            while self.num_bytes > self.capacity_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.num_bytes -= evicted
                self.num_evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    def check_integrity(self) -> None:
        with self._lock:
            assert self.num_bytes == sum(size for _, size in self._entries.values())
            assert self.num_bytes <= self.capacity_bytes

    def families(self) -> list[Metric]:
        """Prometheus families (tandem_mm_embedding_cache_*)."""
        p = "tandem_mm_embedding_cache"
        return [
            CounterMetricFamily(f"{p}_hits", "image embeddings found in the cache", self.num_hits),
            CounterMetricFamily(
                f"{p}_misses", "image embeddings not in the cache (encoded)", self.num_misses
            ),
            CounterMetricFamily(f"{p}_evictions", "embeddings evicted (LRU)", self.num_evictions),
            GaugeMetricFamily(f"{p}_bytes", "bytes of embeddings held", self.num_bytes),
            GaugeMetricFamily(f"{p}_entries", "embeddings held", len(self._entries)),
        ]


def _nbytes(embedding: Any) -> int:
    nbytes = getattr(embedding, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    return int(embedding.numel() * embedding.element_size())
