"""The vLLM worker's KV event translation: vLLM batches (as vLLM 0.32 encodes them: map
events in an array batch) → tandem events with DESIGN §5 hashes, parents across batches,
removals, the snapshot a late router gets, and chains whose parent was never seen."""

from __future__ import annotations

import msgspec

from tandem.engines.vllm.kv_events import KvEventTranslator
from tandem.protocols.engine_kv_events import decode_engine_batch
from tandem.protocols.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tandem.tokens.hashing import sequence_hashes

BS = 4


def batch(*events: dict) -> bytes:
    """What vLLM 0.32 publishes: [ts, [event maps tagged by "type"], dp_rank]."""
    return msgspec.msgpack.encode([1.0, list(events), 0])


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, "group_idx": 0}  # fmt: skip


def test_chains_across_batches_get_tandem_hashes_and_parents():
    tr = KvEventTranslator(BS)
    prompt = list(range(100, 112))  # three blocks
    first = tr.translate(decode_engine_batch(batch(stored([11, 12], None, prompt[:8]))))
    second = tr.translate(decode_engine_batch(batch(stored([13], 12, prompt[8:12]))))
    expected = sequence_hashes(prompt, BS)
    assert isinstance(first[0], BlockStored) and first[0].block_hashes == expected[:2]
    assert first[0].engine_block_hashes == [11, 12] and first[0].medium == "device"
    assert isinstance(second[0], BlockStored)
    assert second[0].parent_hash == expected[1] and second[0].block_hashes == expected[2:]
    snapshot = tr.snapshot()
    assert [e.block_hashes[0] for e in snapshot] == expected  # parents first
    assert snapshot[2].parent_hash == expected[1] and snapshot[0].parent_hash is None


def test_removed_and_cleared_and_an_unknown_parent():
    tr = KvEventTranslator(BS)
    prompt = list(range(8))
    tr.translate(decode_engine_batch(batch(stored([1, 2], None, prompt))))
    gone = {"type": "BlockRemoved", "block_hashes": [2, 99], "medium": "GPU"}
    removed = tr.translate(decode_engine_batch(batch(gone)))
    assert removed == [BlockRemoved(block_hashes=[sequence_hashes(prompt, BS)[1]])]
    assert tr.translate(decode_engine_batch(batch(stored([5], 77, [9, 9, 9, 9])))) == []
    assert tr.num_unknown_parents == 1
    cleared = tr.translate(decode_engine_batch(batch({"type": "AllBlocksCleared"})))
    assert cleared == [AllBlocksCleared()] and tr.snapshot() == []


def test_array_encoded_batches_still_decode():
    payload = msgspec.msgpack.encode(
        [2.0, [["BlockStored", [7], None, [1, 2, 3, 4], BS, None, "GPU"]], None]
    )
    tr = KvEventTranslator(BS)
    out = tr.translate(decode_engine_batch(payload))
    assert out[0].block_hashes == sequence_hashes([1, 2, 3, 4], BS)
