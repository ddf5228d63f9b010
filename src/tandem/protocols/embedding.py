"""Embedding wire types between the frontend and a worker's `embed` endpoint (request plane).

Version 1, msgspec msgpack. One request carries every input of one `/v1/embeddings` call as
token ids, so the engine can batch them in one forward; the unary answer carries the vectors
as one float32 little-endian matrix (rows in input order), not as msgpack floats (8 bytes and
a type tag each).
"""

from __future__ import annotations

import msgspec

from tandem.protocols.engine import WIRE_VERSION

EMBED_ENDPOINT = "embed"


class EmbedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Pool one vector per input. Inputs are token ids the frontend has checked against the
    model's vocabulary and context length (the engine checks again: the plane carries
    whatever a sender wrote)."""

    version: int = WIRE_VERSION
    request_id: str
    model: str
    inputs: list[list[int]]
    # absolute wall-clock deadline (time.time() seconds); None = no deadline
    deadline_s: float | None = None


class EmbedResponse(msgspec.Struct, kw_only=True):
    """`data` is a row-major [len(inputs), dim] float32 little-endian matrix of unit vectors."""

    dim: int
    data: bytes
    num_tokens: int


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EmbedRequest)
_response_decoder = msgspec.msgpack.Decoder(EmbedResponse)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_embed_request(data: bytes) -> EmbedRequest:
    return _request_decoder.decode(data)


def decode_embed_response(data: bytes) -> EmbedResponse:
    return _response_decoder.decode(data)
