"""Request-plane wire format, version 2.

A frame is a 4-byte big-endian length followed by one msgpack array. A connection opens
with a handshake, then carries many streams whose frames interleave:

    [HELLO,   version, server_nonce, auth_required]                                  s -> c
    [AUTH,    version, client_nonce, client_proof | None]                            c -> s
    [WELCOME, server_proof | None (, answers_pings)?]                                s -> c
    [REFUSED, reason]                       s -> c, then the server closes the connection

    [REQUEST, stream_id, endpoint_path, request_id, deadline_s | None, window, payload
     (, traceparent | None (, takes_batches)?)?]                                     c -> s
    [DATA,    stream_id, payload]                                                    s -> c
    [BATCH,   stream_id, payload | None, stream_id, payload | None, ...]             s -> c
    [END,     stream_id]                                                             s -> c
    [ERROR,   stream_id, error_class_name, message, retry_after_s | None]            s -> c
    [CANCEL,  stream_id]                                                             c -> s
    [CREDIT,  stream_id, num_frames]                                                 c -> s
    [PING,    token]                                                                 c -> s
    [PONG,    token]                                                                 s -> c

Authentication (`tandem.runtime.secret`): client_proof = HMAC(key, "client", server_nonce,
client_nonce), server_proof likewise with "server"; the key is derived from the cluster secret.
A server with a secret reads nothing but AUTH until the proof checks out; a client with a
secret sends no request until the server has proven it holds the secret too.

Flow control is per stream: REQUEST grants `window` DATA frames; the server sends no more DATA
on that stream until CREDIT returns some. END and ERROR need no credit. So a consumer that
stops reading holds back its own stream only; the others on the connection keep flowing.

A REQUEST may end with the caller's W3C `traceparent` (tracing on, `tandem.runtime.tracing`);
without tracing the field is left out or None, and a server ignores trailing fields it does not
know.

BATCH: a client that sets `takes_batches` in a REQUEST lets the server put, from then on, the
DATA and END of that connection's streams in BATCH frames: each pair is one stream's payload (a
DATA) or None (its END), in the order they were sent, and each payload needs credit as a DATA
does. A server sends, per event-loop iteration, one BATCH of what its streams sent (a new one
after any other frame, so order holds, and past `BATCH_MAX_BYTES` or half its own
max_frame_bytes). A payload over `BATCH_MAX_PAYLOAD_BYTES` or a quarter of max_frame_bytes goes
as its own DATA, so a BATCH stays within the frame limit both sides are configured with. At many
concurrent streams of one token each, that is one frame to pack and parse a step instead of one
per token. Servers that predate BATCH ignore the field, and a client that does not set it never
receives one.

PING/PONG (liveness of a pooled connection; `tandem.runtime.tcp.client`): a server that
answers PING sets `answers_pings` in WELCOME, and only then does a client send one; the server
answers each with a PONG carrying the same token at once. A client that hears nothing on a
connection (no frame of any kind) pings it every `PING_INTERVAL_S`; a connection silent past
the client's limit is dropped. WELCOME's trailing field is ignored by clients that predate it,
and such servers never advertise it, so neither side ever receives a frame kind it does not
know: the version stays 2.

Stream ids are chosen by the client, unique per connection. Version 1 (no handshake, no
credit) is not spoken: a v1 peer is refused with a message naming both versions.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from tandem import errors

PROTOCOL_VERSION = 2
HELLO, AUTH, WELCOME, REFUSED = 10, 11, 12, 13
REQUEST, DATA, END, ERROR, CANCEL, CREDIT, BATCH = 0, 1, 2, 3, 4, 5, 6
PING, PONG = 7, 8  # only after WELCOME's answers_pings
# a BATCH's bytes (payloads + BATCH_PAIR_OVERHEAD_BYTES a pair); past it the next opens another
BATCH_MAX_BYTES = 256 << 10
BATCH_MAX_PAYLOAD_BYTES = 64 << 10  # a payload over this goes as its own DATA frame
BATCH_PAIR_OVERHEAD_BYTES = 16  # msgpack of a stream id (<= 9) and a bin header (<= 5)
# a REQUEST this large (a prompt of ~4000 tokens and up) is written at once, not after every
# other callback of the loop iteration: that wait is on its TTFT, and its write is one syscall
# among ~0.5 ms of work on it. Smaller ones share the iteration's one write (a syscall each
# costs the frontend ~10 % of its CPU at ISL 64, c=64).
FLUSH_NOW_BYTES = 16 << 10
DEFAULT_MAX_FRAME_BYTES = 16 << 20  # a 128k-token prompt is ~0.6 MB of msgpack ints
HANDSHAKE_MAX_FRAME_BYTES = 1024  # before authentication nothing larger is read
MAX_WINDOW = 1 << 16
HEADER = struct.Struct(">I")

_packb = msgpack.Packer(use_bin_type=True).pack


def encode(frame: list[Any] | tuple[Any, ...]) -> bytes:
    body: bytes = _packb(frame)
    return HEADER.pack(len(body)) + body


class FrameError(Exception):
    """The byte stream is not valid framing or breaks the protocol; the connection must be
    dropped (the message says why and is logged)."""


def error_frame(stream_id: int, exc: errors.ServingError) -> tuple[Any, ...]:
    retry = exc.retry_after_s if isinstance(exc, errors.Overloaded) else None
    return (ERROR, stream_id, type(exc).__name__, exc.message, retry)


def error_from_frame(name: str, message: str, retry_after_s: float | None) -> errors.ServingError:
    """Rebuild the server's error by class name (unknown names become a plain ServingError)."""
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ServingError)):
        return errors.ServingError(f"{name}: {message}")
    if issubclass(cls, errors.Overloaded):
        return cls(message, retry_after_s=retry_after_s if retry_after_s is not None else 1.0)
    return cls(message)
