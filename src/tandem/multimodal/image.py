"""Decoded images and their mm_hash (DESIGN.md §5, §10).

An image travels as its original encoded bytes (PNG/JPEG); every process that needs pixels decodes
them with `decode_image`. The mm_hash is XXH3-64 (seed 1337) over the decoded RGB pixels and their
shape, so two encodings of the same picture share KV blocks and an embedding-cache entry.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from tandem.errors import InvalidRequest

MM_HASH_SEED = 1337
# formats Pillow reports for what we accept, keyed by the MIME type a data: URL may name
ACCEPTED_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG"}
_shape = struct.Struct("<III")


@dataclass(frozen=True, slots=True)
class DecodedImage:
    """One image as the encoder sees it: `pixels` uint8 HxWx3 (RGB), read-only."""

    pixels: np.ndarray
    mm_hash: int
    source_bytes: bytes


def mm_hash_of(pixels: np.ndarray) -> int:
    """XXH3-64 over the shape (LE u32 height, width, channels) then the C-order RGB bytes."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels must be uint8 HxWx3, got {pixels.dtype} {pixels.shape}")
    h = xxhash.xxh3_64(seed=MM_HASH_SEED)
    h.update(_shape.pack(*pixels.shape))
    h.update(np.ascontiguousarray(pixels).data)
    return h.intdigest()


def decode_image(
    data: bytes,
    *,
    max_pixels: int | None = None,
    what: str = "image",
    declared_mime: str | None = None,
) -> DecodedImage:
    """Decode PNG/JPEG bytes to RGB. Raises `InvalidRequest` naming `what` when the bytes are not
    a PNG/JPEG image (or not the `declared_mime` one), or when width·height exceeds `max_pixels`
    (checked before the pixels are decoded, so a decompression bomb costs nothing)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format not in ACCEPTED_FORMATS.values():
                raise InvalidRequest(
                    f"{what}: unsupported image format {img.format!r}; expected PNG or JPEG",
                    param=what,
                )
            if declared_mime is not None and ACCEPTED_FORMATS.get(declared_mime) != img.format:
                raise InvalidRequest(
                    f"{what}: declared {declared_mime} but the bytes are {img.format}",
                    param=what,
                )
            width, height = img.size
            if max_pixels is not None and width * height > max_pixels:
                raise InvalidRequest(
                    f"{what}: image is {width}x{height} = {width * height} pixels, over the limit "
                    f"of {max_pixels} pixels (--mm-max-image-pixels)",
                    param=what,
                )
            pixels = np.asarray(img.convert("RGB"), dtype=np.uint8)
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(
            f"{what}: cannot decode the image ({exc}); expected PNG or JPEG", param=what
        ) from exc
    pixels.setflags(write=False)
    return DecodedImage(pixels=pixels, mm_hash=mm_hash_of(pixels), source_bytes=data)
