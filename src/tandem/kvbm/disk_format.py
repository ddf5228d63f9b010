"""On-disk format of one G3 block file, version 1.

    offset  size  field
    0       8     magic b"TDKVBLK\\0"
    8       2     version (1)
    10      2     reserved (0)
    12      4     header_bytes (64)
    16      8     block_hash (u64)
    24      8     payload length in bytes (u64)
    32      8     checksum: XXH3-64 over bytes 0..32 of the header, then the payload
    40      24    zero padding
    64      ...   payload, then zero padding up to a multiple of 4096 (O_DIRECT alignment)

All integers little-endian. A file is rejected (`BlockCorrupt`) when its magic, version, hash
or checksum disagree, or when it is shorter than header + payload (truncated).
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"TDKVBLK\x00"
VERSION = 1
HEADER_BYTES = 64
ALIGN = 4096
_U64 = (1 << 64) - 1
_FIELDS = struct.Struct("<8sHHIQQ")  # everything the checksum covers
_CHECKSUM = struct.Struct("<Q")


class BlockCorrupt(ValueError):
    """A block file failed its integrity check; the message says which."""


def round_up(num_bytes: int, align: int = ALIGN) -> int:
    return -(-num_bytes // align) * align


def file_bytes(payload_bytes: int) -> int:
    """Size of the file that holds a payload of `payload_bytes` (header and padding included)."""
    return round_up(HEADER_BYTES + payload_bytes)


def _checksum(fields: bytes | memoryview, payload: bytes | memoryview) -> int:
    hasher = xxhash.xxh3_64()
    hasher.update(fields)
    hasher.update(payload)
    return hasher.intdigest()


def encode_into(buf: memoryview, block_hash: int, payload: memoryview) -> int:
    """Write header + payload into `buf` (zero-padded); return the bytes to write (aligned)."""
    total = file_bytes(payload.nbytes)
    if total > buf.nbytes:
        raise ValueError(f"block file of {total} bytes exceeds the {buf.nbytes}-byte buffer")
    fields = _FIELDS.pack(MAGIC, VERSION, 0, HEADER_BYTES, block_hash & _U64, payload.nbytes)
    buf[: _FIELDS.size] = fields
    _CHECKSUM.pack_into(buf, _FIELDS.size, _checksum(fields, payload))
    buf[_FIELDS.size + _CHECKSUM.size : HEADER_BYTES] = bytes(HEADER_BYTES - 40)
    end = HEADER_BYTES + payload.nbytes
    buf[HEADER_BYTES:end] = payload.cast("B")
    buf[end:total] = bytes(total - end)
    return total


def decode(buf: memoryview, num_read: int, block_hash: int) -> memoryview:
    """The payload of a file whose first `num_read` bytes are in `buf`; raise BlockCorrupt."""
    if num_read < HEADER_BYTES:
        raise BlockCorrupt(f"truncated: {num_read} bytes < {HEADER_BYTES}-byte header")
    fields = buf[: _FIELDS.size]
    magic, version, _, header_bytes, stored_hash, length = _FIELDS.unpack(fields)
    if magic != MAGIC:
        raise BlockCorrupt(f"bad magic {magic!r}; expected {MAGIC!r}")
    if version != VERSION or header_bytes != HEADER_BYTES:
        raise BlockCorrupt(f"version={version} header_bytes={header_bytes}; expected 1 and 64")
    if stored_hash != block_hash & _U64:
        raise BlockCorrupt(f"block_hash={stored_hash:#x}; expected {block_hash & _U64:#x}")
    if HEADER_BYTES + length > num_read:
        raise BlockCorrupt(f"truncated: {num_read} bytes < {HEADER_BYTES} + payload {length}")
    payload = buf[HEADER_BYTES : HEADER_BYTES + length]
    (stored_sum,) = _CHECKSUM.unpack_from(buf, _FIELDS.size)
    if _checksum(fields, payload) != stored_sum:
        raise BlockCorrupt(f"checksum mismatch (stored {stored_sum:#x})")
    return payload
