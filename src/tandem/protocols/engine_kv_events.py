"""The KV event wire format vLLM and SGLang publish over ZMQ (read by the router's
`ZmqEngineSource` and by the vLLM worker adapter).

Wire: multipart [topic, seq (8-byte big-endian), payload]; payload is a msgpack
`KVEventBatch` = array [ts, events, data_parallel_rank?], each event an array whose first
element is its tag ("BlockStored", "BlockRemoved", "AllBlocksCleared") — or, as vLLM >= 0.3x
publishes, a map whose "type" key is the tag (extra keys ignored). Replay: send the
first wanted seq (8-byte big-endian) to the replay ROUTER socket; it answers one
[seq, payload] message per buffered batch and ends with an empty payload (seq -1).
"""

from __future__ import annotations

import msgspec
import xxhash

EngineHash = int | bytes


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class EngineBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class EngineBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[EngineHash]
    medium: str | None = None


class EngineAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class EngineEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[EngineBlockStored | EngineBlockRemoved | EngineAllBlocksCleared]
    data_parallel_rank: int | None = None


class _MapBlockStored(EngineBlockStored, array_like=False, tag_field="type"):
    pass


class _MapBlockRemoved(EngineBlockRemoved, array_like=False, tag_field="type"):
    pass


class _MapAllBlocksCleared(EngineAllBlocksCleared, array_like=False, tag_field="type"):
    pass


class _MapEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EngineEventBatch)
_map_decoder = msgspec.msgpack.Decoder(_MapEventBatch)


def decode_engine_batch(payload: bytes) -> EngineEventBatch:
    """Either event encoding; events decode as (subclasses of) the Engine* types.
    Raises msgspec.DecodeError / ValidationError on a malformed payload."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError:
        batch = _map_decoder.decode(payload)
        return EngineEventBatch(
            ts=batch.ts, events=list(batch.events), data_parallel_rank=batch.data_parallel_rank
        )


def engine_hash_key(h: EngineHash) -> int:
    """Engine hashes as int lookup keys (bytes hashes folded with XXH3-64)."""
    return h if isinstance(h, int) else xxhash.xxh3_64_intdigest(h)
