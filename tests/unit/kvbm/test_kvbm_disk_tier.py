"""DiskTier: round trip through files, LRU deletes files, and every kind of damage to a file
between put and get (bit flip, truncation, bad magic, a file renamed onto another hash,
deletion) is detected, dropped, counted and reported as a miss."""

from __future__ import annotations

import errno
import logging
import os
import re
from pathlib import Path

import pytest

from tandem.kvbm import disk_tier as disk_tier_module
from tandem.kvbm.base import BlockMeta
from tandem.kvbm.disk_format import ALIGN, HEADER_BYTES
from tandem.kvbm.disk_tier import DiskTier

META = BlockMeta(block_size=4, token_ids=(5, 6, 7, 8), parent_hash=3)


def _data(block_hash: int, size: int = 5000) -> bytes:
    return bytes((block_hash * 31 + i) % 251 for i in range(size))


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> DiskTier:
    return DiskTier(
        directory=tmp_path, capacity_blocks=3, block_bytes=8192, direct_io=request.param
    )


def test_round_trip_and_file_layout(tier: DiskTier) -> None:
    assert tier.put(1, _data(1), META) == []
    tier.check_integrity()
    path = tier.path_of(1)
    assert path.stat().st_size % ALIGN == 0 and path.stat().st_size >= HEADER_BYTES + 5000
    assert tier.get(1) == _data(1)
    assert tier.meta(1) == META
    assert tier.get(2) is None


def test_lru_eviction_deletes_the_file(tier: DiskTier) -> None:
    for h in (1, 2, 3):
        tier.put(h, _data(h), META)
    tier.get(1)
    assert tier.put(4, _data(4), META) == [2]
    tier.check_integrity()
    assert not tier.path_of(2).exists()
    assert tier.lookup([1, 3, 4]) == 3
    assert tier.remove(3) and not tier.path_of(3).exists()
    tier.check_integrity()


def _flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(raw)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: _flip_byte(p, HEADER_BYTES + 1234), "checksum mismatch"),
        (lambda p: _flip_byte(p, 24), "truncated|checksum"),  # the length field
        (lambda p: _flip_byte(p, 0), "bad magic"),
        (lambda p: os.truncate(p, HEADER_BYTES + 100), "truncated"),
        (lambda p: os.truncate(p, 10), "truncated"),
        (lambda p: p.unlink(), "No such file"),
    ],
    ids=["payload-bit", "length-field", "magic", "truncated-payload", "truncated-header", "gone"],
)
def test_damaged_file_is_a_counted_miss(
    tier: DiskTier, damage: object, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier.put(1, _data(1), META)
    tier.put(2, _data(2), META)
    damage(tier.path_of(1))  # type: ignore[operator]
    with caplog.at_level(logging.WARNING, logger="tandem.kvbm.disk_tier"):
        assert tier.get(1) is None
    assert caplog.records and re.search(reason, caplog.text)
    assert tier.num_corrupt == 1
    assert not tier.contains(1) and not tier.path_of(1).exists()
    tier.check_integrity()
    assert tier.get(2) == _data(2)  # the neighbour is untouched


def test_file_of_another_block_is_rejected(tier: DiskTier) -> None:
    tier.put(1, _data(1), META)
    tier.put(2, _data(2), META)
    tier.path_of(1).write_bytes(tier.path_of(2).read_bytes())  # a valid file, wrong block
    assert tier.get(1) is None
    assert tier.num_corrupt == 1


def test_stale_files_are_removed_at_start(tmp_path: Path) -> None:
    first = DiskTier(directory=tmp_path, capacity_blocks=2, block_bytes=64, direct_io=False)
    first.put(1, b"x" * 64, META)
    (tmp_path / "notes.txt").write_text("keep me")
    second = DiskTier(directory=tmp_path, capacity_blocks=2, block_bytes=64, direct_io=False)
    assert second.num_blocks == 0 and not first.path_of(1).exists()
    assert (tmp_path / "notes.txt").exists()
    second.check_integrity()


def test_falls_back_to_buffered_io_when_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = os.open

    def refuse_direct(path: object, flags: int, *args: object) -> int:
        if flags & disk_tier_module._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_tier_module, "_O_DIRECT", disk_tier_module._O_DIRECT or 0x4000)
    monkeypatch.setattr(os, "open", refuse_direct)
    with caplog.at_level(logging.WARNING, logger="tandem.kvbm.disk_tier"):
        tier = DiskTier(directory=tmp_path, capacity_blocks=2, block_bytes=64, direct_io=True)
    assert tier.direct_io is False
    assert "O_DIRECT unsupported" in caplog.text
    tier.put(1, b"y" * 64, META)
    assert tier.get(1) == b"y" * 64


def test_oversized_block_is_rejected(tier: DiskTier) -> None:
    with pytest.raises(ValueError, match="exceeds"):
        tier.put(1, bytes(8193), META)
    tier.check_integrity()
