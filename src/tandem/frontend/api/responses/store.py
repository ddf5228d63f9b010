"""`ResponseStore`: the bounded in-memory store behind `previous_response_id` and
`GET`/`DELETE /v1/responses/{id}`.

Bounded three ways (`ResponseStoreConfig`): a count of entries and a total of bytes (the
least recently used entries go first when either is exceeded; an entry larger than the byte
limit on its own is not stored), and a time to live from the last store or read. One per
frontend and per process: a response stored on one frontend is unknown to the others and is
lost when the frontend restarts (as OpenAI documents for `store`, retrieval may fail; then
the client resends the conversation). Each entry belongs to its owner (`frontend/ownership.py`):
a read or delete by anyone else finds nothing. Not thread-safe; one event loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseStoreConfig:
    max_entries: int = 1024
    max_bytes: int = 64 << 20
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_entries <= 1 << 24:
            raise ValueError(f"max_entries={self.max_entries} must be in [1, {1 << 24}]")
        if not 1 <= self.max_bytes <= 1 << 40:
            raise ValueError(f"max_bytes={self.max_bytes} must be in [1, {1 << 40}]")
        if not 0 < self.ttl_s <= 30 * 86400:
            raise ValueError(f"ttl_s={self.ttl_s} must be in (0, {30 * 86400}]")


def add_response_store_args(parser: argparse.ArgumentParser) -> None:
    d = ResponseStoreConfig()
    g = parser.add_argument_group("responses store (previous_response_id)")
    env = os.environ.get
    g.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=int(env("TANDEM_RESPONSES_STORE_MAX_ENTRIES", d.max_entries)),
        help="responses kept for previous_response_id and GET /v1/responses/{id}, least "
        "recently used dropped first (env TANDEM_RESPONSES_STORE_MAX_ENTRIES)",
    )
    g.add_argument(
        "--responses-store-max-mb",
        type=float,
        default=float(env("TANDEM_RESPONSES_STORE_MAX_MB", d.max_bytes / (1 << 20))),
        help="memory the stored responses and conversations may take, in MiB "
        "(env TANDEM_RESPONSES_STORE_MAX_MB)",
    )
    g.add_argument(
        "--responses-store-ttl-s",
        type=float,
        default=float(env("TANDEM_RESPONSES_STORE_TTL_S", d.ttl_s)),
        help="a stored response is dropped this long after its last use "
        "(env TANDEM_RESPONSES_STORE_TTL_S)",
    )


def response_store_config_from_args(ns: argparse.Namespace) -> ResponseStoreConfig:
    return ResponseStoreConfig(
        max_entries=ns.responses_store_max_entries,
        max_bytes=int(ns.responses_store_max_mb * (1 << 20)),
        ttl_s=ns.responses_store_ttl_s,
    )


class StoredResponse(NamedTuple):
    """`body`: the Response object as sent (JSON); `messages`: the conversation up to and
    including this response's output, as chat messages, without the request's
    `instructions` (OpenAI does not carry them over to the next turn); `owner`: the tenant or
    key that stored it."""

    body: bytes
    messages: list[dict[str, Any]]
    num_bytes: int
    owner: str = ""


class ResponseStore:
    def __init__(
        self,
        config: ResponseStoreConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or ResponseStoreConfig()
        self._clock = clock
        self._entries: OrderedDict[str, tuple[StoredResponse, float]] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, response_id: str, body: bytes, messages: list[dict[str, Any]], owner: str = ""
    ) -> bool:
        """Store (or replace) `owner`'s entry; evicts expired, then least recently used
        entries until the limits hold. Returns False (and stores nothing) when the entry alone
        is over the byte limit."""
        size = len(body) + sum(len(str(m.get("content", ""))) + 16 for m in messages)
        self.delete(response_id)
        if size > self.config.max_bytes:
            logger.warning(
                "response %s (%d bytes) exceeds the store's %d bytes; not stored",
                response_id,
                size,
                self.config.max_bytes,
            )
            return False
        self._expire()
        while self._entries and (
            len(self._entries) >= self.config.max_entries
            or self.num_bytes + size > self.config.max_bytes
        ):
            _, (oldest, _) = self._entries.popitem(last=False)
            self.num_bytes -= oldest.num_bytes
        entry = StoredResponse(body, messages, size, owner)
        self._entries[response_id] = (entry, self._clock())
        self.num_bytes += size
        return True

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The entry, refreshed (most recently used, TTL restarted); None if unknown, expired
        or (with `owner`) someone else's."""
        self._expire()
        item = self._entries.get(response_id)
        if item is None or (owner is not None and item[0].owner != owner):
            return None
        self._entries[response_id] = (item[0], self._clock())
        self._entries.move_to_end(response_id)
        return item[0]

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        """Drop the entry; False if unknown or (with `owner`) someone else's."""
        item = self._entries.get(response_id)
        if item is None or (owner is not None and item[0].owner != owner):
            return False
        del self._entries[response_id]
        self.num_bytes -= item[0].num_bytes
        return True

    def _expire(self) -> None:
        """Drop entries idle for ttl_s (the oldest are first: reads move entries to the end)."""
        deadline = self._clock() - self.config.ttl_s
        while self._entries:
            response_id, (entry, touched) = next(iter(self._entries.items()))
            if touched > deadline:
                return
            del self._entries[response_id]
            self.num_bytes -= entry.num_bytes

    def check_integrity(self) -> None:
        assert self.num_bytes == sum(e.num_bytes for e, _ in self._entries.values())
        assert len(self._entries) <= self.config.max_entries
        assert self.num_bytes <= self.config.max_bytes
        times = [t for _, t in self._entries.values()]
        assert times == sorted(times), "entries out of LRU order"
