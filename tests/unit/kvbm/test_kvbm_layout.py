"""layout: per-layer KV tensors ↔ the flat bytes a tier stores, one block or many."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.kvbm.layout import as_bytes, join_blocks, per_block, split_like

torch = pytest.importorskip("torch")


def _layers(num_blocks: int) -> list[object]:
    # the native engine's export_blocks shape per layer: [2, n, block_size, kv_heads, head_dim]
    return [torch.randn(2, num_blocks, 4, 3, 8).to(torch.bfloat16) for _ in range(5)]


def test_one_block_round_trips_bit_exactly() -> None:
    layers = _layers(1)
    data = bytes(as_bytes(layers))
    assert len(data) == sum(t.numel() * 2 for t in layers)
    restored = split_like(data, layers)
    assert all(
        torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(restored, layers, strict=True)
    )


def test_per_block_then_join_restores_the_batch() -> None:
    layers = _layers(3)
    blocks = [bytes(as_bytes(one)) for one in per_block(layers)]
    assert len(blocks) == 3 and len(set(blocks)) == 3
    template = per_block(layers)[0]
    joined = join_blocks(blocks[1:], template)
    assert all(torch.equal(j, layer[:, 1:]) for j, layer in zip(joined, layers, strict=True))


def test_size_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="expected"):
        split_like(b"\x00" * 10, _layers(1))


def test_plain_buffers_pass_through() -> None:
    assert bytes(as_bytes(b"abc")) == b"abc"
    assert bytes(as_bytes(np.array([1, 2], dtype=np.uint16))) == b"\x01\x00\x02\x00"
    assert bytes(as_bytes([b"ab", np.array([3], dtype=np.uint8)])) == b"ab\x03"
