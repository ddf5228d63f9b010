"""Token-in/token-out wire types between frontend, router and workers (request plane).

Version 1. Encoded with msgspec msgpack; unknown fields are ignored on decode so newer
senders can talk to older receivers.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

WIRE_VERSION = 1

FinishReason = Literal["stop", "length", "cancelled", "error"]


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick the next token. temperature 0 means greedy; top_k 0 means off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # number of top logprobs per token to return; None = no logprobs at all
    logprobs: int | None = None
    # OpenAI/vLLM penalties: presence and frequency subtract from the logits of tokens already
    # generated (once / per occurrence); repetition divides positive logits (multiplies
    # negative ones) of tokens seen in prompt or output. 0, 0 and 1 mean off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit before sampling (OpenAI range [-100, 100])
    logit_bias: dict[int, float] | None = None
    # constrained decoding: the output must match this; None = unconstrained
    structured: StructuredOutput | None = None


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on the generated text, enforced by the engine's grammar mask.

    kind "json": any JSON object (response_format json_object); "json_schema": `spec` is a JSON
    Schema document (text); "regex": `spec` is a regular expression; "grammar": `spec` is a Lark
    grammar. Tool calls with tool_choice "required" or a named function arrive here as a
    json_schema (or a grammar) the frontend built from the tools.
    """

    kind: Literal["json", "json_schema", "regex", "grammar"]
    spec: str | None = None
    # json_schema: reject (not just ignore) properties the schema does not name
    strict: bool = True
    # the last num_output_tokens of the request's token_ids were generated under this
    # constraint elsewhere (a disaggregated prefill's first token, a migrated stream): the
    # engine's matcher replays them before the first new token
    num_output_tokens: int = 0


def continued_sampling(sampling: SamplingParams, num_tokens: int) -> SamplingParams:
    """`sampling` for a request continued after `num_tokens` it generated elsewhere (their
    ids appended to its token_ids): a structured constraint carries on from them."""
    structured = sampling.structured
    if structured is None or num_tokens == 0:
        return sampling
    done = structured.num_output_tokens + num_tokens
    return msgspec.structs.replace(
        sampling, structured=msgspec.structs.replace(structured, num_output_tokens=done)
    )


class StopConditions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """When generation ends. Stop *strings* are applied by the frontend, not the engine."""

    max_tokens: int
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0


class RoutingHints(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request router overrides (DESIGN.md §7)."""

    worker_id: str | None = None  # pinned instance (header x-worker-instance-id)
    overlap_weight: float | None = None
    temperature: float | None = None


class MmItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One image of a request (DESIGN.md §10): where its embedding rows sit in `token_ids`.

    `token_ids[offset : offset + num_tokens]` are the image's placeholder rows; the engine replaces
    their embeddings with the image's. `image_bytes` is the original PNG/JPEG so a worker or encoder
    can decode it; None when the receiver is expected to have the embedding (cached or
    transferred, see `embedding_handle`).
    """

    mm_hash: int
    offset: int
    num_tokens: int
    image_bytes: bytes | None = None
    # set by the encode path: the transfer-handle metadata of this image's embedding
    embedding_handle: dict[str, Any] | None = None


class PreprocessedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a worker's `generate` endpoint receives: tokens, sampling, stop conditions."""

    version: int = WIRE_VERSION
    request_id: str
    model: str
    token_ids: list[int]
    # how many trailing tokens of token_ids this request generated before (a prefill
    # worker's first token, a lost worker's output before a migration): penalties count
    # them as output, not prompt
    num_generated_tokens: int = 0
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stop: StopConditions
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    lora_name: str | None = None
    cache_salt: str | None = None
    routing: RoutingHints | None = None
    # absolute wall-clock deadline (time.time() seconds); None = no deadline
    deadline_s: float | None = None
    # prefill/decode handoff (DESIGN.md §4); opaque to everyone but tandem.disagg
    disagg_params: dict[str, Any] | None = None
    # free-form annotations (e.g. "prefill_only"); engines ignore what they do not know
    annotations: list[str] = msgspec.field(default_factory=list)
    # images, in prompt order; their placeholder rows are already expanded in token_ids
    mm_items: list[MmItem] = msgspec.field(default_factory=list)


class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class EngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One streamed chunk from an engine: new tokens since the last chunk.

    The last chunk of a stream has `finish_reason` set. `num_cached_tokens` is set on the
    first chunk (prompt tokens served from the prefix cache).
    """

    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_cached_tokens: int | None = None
    # one logprob per token in token_ids, and per token its top alternatives
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    disagg_params: dict[str, Any] | None = None
    error: str | None = None


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(PreprocessedRequest)
_output_decoder = msgspec.msgpack.Decoder(EngineOutput)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes) -> PreprocessedRequest:
    return _request_decoder.decode(data)


def decode_output(data: bytes) -> EngineOutput:
    return _output_decoder.decode(data)
