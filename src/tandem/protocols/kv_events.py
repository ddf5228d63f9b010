"""KV events and load metrics (DESIGN.md §6), as published on tandem's event plane.

Version 1. `BlockStored.block_hashes` are tandem's chained sequence hashes (DESIGN.md §5);
`engine_block_hashes` carries an engine's own ids when it has them (vLLM), kept as lookup keys.
Subjects: `{namespace}.{component}.kv_events` and `{namespace}.{component}.load_metrics`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Medium = Literal["device", "host", "disk", "remote"]


class BlockStored(msgspec.Struct, tag="stored", kw_only=True, omit_defaults=True):
    block_hashes: list[int]
    parent_hash: int | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int
    lora_name: str | None = None
    medium: Medium = "device"
    engine_block_hashes: list[int] | None = None


class BlockRemoved(msgspec.Struct, tag="removed", kw_only=True, omit_defaults=True):
    block_hashes: list[int]
    medium: Medium = "device"


class AllBlocksCleared(msgspec.Struct, tag="cleared", kw_only=True, omit_defaults=True):
    medium: Medium | None = None


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Events of one worker, in order. `event_id` is per worker, monotonically increasing by 1
    per batch, so a receiver can detect gaps and ask for a replay."""

    version: int = 1
    worker_id: str
    dp_rank: int = 0
    event_id: int
    timestamp_s: float
    events: list[KvEvent]


class LoadMetrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: int = 1
    worker_id: str
    dp_rank: int = 0
    num_active_blocks: int
    num_total_blocks: int
    num_waiting: int
    num_running: int
    timestamp_s: float = 0.0
    # id of the last KV event batch the worker published before this message (None: not
    # reported); lets a router notice a lost *last* batch, which no later gap would reveal
    kv_event_id: int | None = None
    # peer KV fetch (issue 31): the transfer bandwidth the worker's fetches measured (bytes/s;
    # None: it made none, or offers no fetch); the router prices fetches with it
    kv_fetch_bytes_per_s: float | None = None
    # and the fixed part of its fetches (export and pull round trips, threads): seconds
    kv_fetch_setup_s: float | None = None


class KvStateRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sent to a worker's `kv_state` endpoint: replay events after `after_event_id`
    (from its bounded buffer), or, when None or out of the buffer, its whole block set
    (as one BlockStored batch per stored chain, ending with the current event id)."""

    after_event_id: int | None = None


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(KvEventBatch)
_load_decoder = msgspec.msgpack.Decoder(LoadMetrics)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_batch(data: bytes) -> KvEventBatch:
    return _batch_decoder.decode(data)


def decode_load(data: bytes) -> LoadMetrics:
    return _load_decoder.decode(data)
