from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tandem.transfer.descriptor import RegionLayout, decode_meta
from tandem.transfer.region import (
    SHM_DIR,
    MemoryRegion,
    as_bytes,
    copy_blocks,
    create_shm_region,
    sweep_stale_segments,
)

pytestmark = pytest.mark.timeout(20)
SHAPE = dict(num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8)


def kv_tensor(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 10, 4, 2, 8, generator=g).to(torch.bfloat16)


def test_kv_layout_block_view_matches_tensor_indexing() -> None:
    kv = kv_tensor()
    layout = RegionLayout.for_kv_cache(**SHAPE, dtype="bfloat16")
    region = MemoryRegion(name="kv", layout=layout, data=as_bytes(kv))
    blocks = region.blocks()
    assert blocks.shape == (3, 2, 10, 4 * 2 * 8 * 2)
    expected = kv[1, 1, 7].contiguous().view(torch.uint8).reshape(-1).numpy()
    assert np.array_equal(blocks[1, 1, 7], expected)
    assert layout.span_bytes == kv.numel() * 2


def test_shm_region_as_torch_shares_memory_with_block_view() -> None:
    layout = RegionLayout.for_kv_cache(**SHAPE, dtype="bfloat16")
    region = create_shm_region("kv", layout)
    try:
        kv = region.as_torch("bfloat16", (3, 2, 10, 4, 2, 8))
        kv[2, 0, 5] = 1.5
        expected = kv[2, 0, 5].contiguous().view(torch.uint8).reshape(-1).numpy()
        assert np.array_equal(region.blocks()[2, 0, 5], expected)
        assert region.blocks()[2, 1, 5].max() == 0
    finally:
        region.close()


def test_layout_larger_than_buffer_is_rejected() -> None:
    layout = RegionLayout.contiguous(num_blocks=4, block_bytes=16)
    with pytest.raises(ValueError, match="spans 64 bytes"):
        MemoryRegion(name="r", layout=layout, data=np.zeros(63, np.uint8))


@pytest.mark.parametrize(
    ("dst_ids", "src_ids"),
    [
        ([0, 1, 2, 3], [4, 5, 6, 7]),
        ([9, 0, 5, 3], [1, 8, 2, 6]),
        (list(range(10)), list(range(10))),
    ],
)
def test_copy_blocks_copies_exactly_the_named_blocks(
    dst_ids: list[int], src_ids: list[int]
) -> None:
    layout = RegionLayout.for_kv_cache(**SHAPE, dtype="bfloat16")
    src = MemoryRegion(name="s", layout=layout, data=as_bytes(kv_tensor(1)))
    dst_tensor = torch.zeros(3, 2, 10, 4, 2, 8, dtype=torch.bfloat16)
    dst = MemoryRegion(name="d", layout=layout, data=as_bytes(dst_tensor))
    copy_blocks(dst.blocks(), dst_ids, src.blocks(), src_ids, slice(1, 3))
    want = torch.zeros_like(dst_tensor)
    want[1:3, :, dst_ids] = kv_tensor(1)[1:3, :, src_ids]
    assert torch.equal(dst_tensor, want)


def test_fragmented_ids_use_one_fancy_copy_with_same_result() -> None:
    layout = RegionLayout.contiguous(num_blocks=200, block_bytes=8, num_layers=2)
    rng = np.random.default_rng(3)
    src_data = rng.integers(0, 256, layout.span_bytes, dtype=np.uint8)
    dst_ids = list(rng.permutation(200)[:100])
    src_ids = list(rng.permutation(200)[:100])
    src = MemoryRegion(name="s", layout=layout, data=src_data)
    dst = MemoryRegion(name="d", layout=layout, data=np.zeros(layout.span_bytes, np.uint8))
    copy_blocks(dst.blocks(), dst_ids, src.blocks(), src_ids, slice(0, 2))
    assert np.array_equal(dst.blocks()[:, :, dst_ids], src.blocks()[:, :, src_ids])


def test_shm_region_lives_in_dev_shm_until_closed() -> None:
    layout = RegionLayout.contiguous(num_blocks=4, block_bytes=64)
    region = create_shm_region("kv", layout)
    assert region.shm_name is not None
    path = os.path.join(SHM_DIR, region.shm_name)
    assert os.path.getsize(path) == 256
    region.blocks()[0, 0, 2] = 7
    region.close()
    assert not os.path.exists(path)


def test_sweep_removes_segments_of_dead_processes_only() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = os.path.join(SHM_DIR, f"tandem-{int(dead.stdout)}-abcd1234-kv")
    with open(stale, "wb") as f:
        f.write(b"x")
    mine = create_shm_region("live", RegionLayout.contiguous(num_blocks=1, block_bytes=8))
    try:
        removed = sweep_stale_segments()
        assert os.path.basename(stale) in removed
        assert not os.path.exists(stale)
        assert os.path.exists(os.path.join(SHM_DIR, mine.shm_name or ""))
    finally:
        mine.close()


def test_meta_round_trips_through_msgpack() -> None:
    from tandem.transfer.descriptor import OpKind, TransferOpMeta, encode_meta

    meta = TransferOpMeta(
        op_id="r1", kind=OpKind.WRITABLE, agent_id="a", host_id="h", address=("127.0.0.1", 5),
        backends=("shm", "tcp"), region="kv", layout=RegionLayout.for_kv_cache(**SHAPE,
        dtype="float16"), block_ids=(3, 1), layer_start=0, layer_end=2, expires_at=1.5,
        handles={"shm": b"tandem-1-ab-kv"},
    )  # fmt: skip
    assert decode_meta(encode_meta(meta)) == meta
    assert meta.num_bytes == 2 * 2 * 2 * (4 * 2 * 8 * 2)


def test_peers_with_other_kv_element_types_are_refused() -> None:
    """A float16 and a bfloat16 cache have blocks of the same bytes: the transfer must still
    refuse them (the copied bits would mean other values), as it refuses other block sizes."""
    from tandem.transfer.client import incompatibility
    from tandem.transfer.descriptor import OpKind, TransferOpMeta

    def meta(dtype: str) -> TransferOpMeta:
        layout = RegionLayout.for_kv_cache(**SHAPE, dtype=dtype)
        return TransferOpMeta(
            op_id="r1", kind=OpKind.READABLE, agent_id="a", host_id="h",
            address=("127.0.0.1", 5), backends=("tcp",), region="kv", layout=layout,
            block_ids=(0, 1), layer_start=0, layer_end=2, expires_at=1.5,
        )  # fmt: skip

    local = create_shm_region("kv16", RegionLayout.for_kv_cache(**SHAPE, dtype="float16"))
    try:
        assert incompatibility(meta("float16"), local, [2, 3]) == ""
        assert "element type differs: local float16, remote bfloat16" in incompatibility(
            meta("bfloat16"), local, [2, 3]
        )
        assert "block layout differs" in incompatibility(meta("float32"), local, [2, 3])
    finally:
        local.close()
