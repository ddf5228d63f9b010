"""Request-plane wire format, version 1.

A frame is a 4-byte big-endian length followed by one msgpack array:

    [REQUEST, stream_id, endpoint_path, request_id, deadline_s | None, payload]  client -> server
    [DATA,    stream_id, payload]                                               server -> client
    [END,     stream_id]                                                        server -> client
    [ERROR,   stream_id, error_class_name, message, retry_after_s | None]       server -> client
    [CANCEL,  stream_id]                                                        client -> server

Stream ids are chosen by the client, unique per connection. Many streams share one
connection; frames of different streams interleave.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack

from tandem import errors

REQUEST, DATA, END, ERROR, CANCEL = 0, 1, 2, 3, 4
MAX_FRAME_BYTES = 256 << 20
_HEADER = struct.Struct(">I")

_packb = msgpack.Packer(use_bin_type=True).pack


def encode(frame: list[Any] | tuple[Any, ...]) -> bytes:
    body: bytes = _packb(frame)
    return _HEADER.pack(len(body)) + body


class FrameError(Exception):
    """The byte stream is not valid framing; the connection must be dropped."""


def decode_frames(buf: bytearray, on_frame: Callable[[list[Any]], None]) -> None:
    """Call `on_frame` for every complete frame at the start of `buf`, then remove those
    bytes from `buf` (a partial frame stays for the next call)."""
    off, n = 0, len(buf)
    unpack_from = _HEADER.unpack_from
    try:
        while n - off >= 4:
            (size,) = unpack_from(buf, off)
            if size > MAX_FRAME_BYTES:
                raise FrameError(f"frame of {size} bytes exceeds limit {MAX_FRAME_BYTES}")
            end = off + 4 + size
            if end > n:
                break
            frame = msgpack.unpackb(buf[off + 4 : end], raw=False, use_list=True)
            off = end
            on_frame(frame)
    finally:
        if off:
            del buf[:off]


def error_frame(stream_id: int, exc: errors.ServingError) -> tuple[Any, ...]:
    retry = getattr(exc, "retry_after_s", None)
    return (ERROR, stream_id, type(exc).__name__, exc.message, retry)


def error_from_frame(name: str, message: str, retry_after_s: float | None) -> errors.ServingError:
    """Rebuild the server's error by class name (unknown names become a plain ServingError)."""
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ServingError)):
        return errors.ServingError(f"{name}: {message}")
    if issubclass(cls, errors.Overloaded):
        return cls(message, retry_after_s=retry_after_s if retry_after_s is not None else 1.0)
    return cls(message)
