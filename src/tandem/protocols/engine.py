"""Token-in/token-out wire types between frontend, router and workers (request plane).

Version 2. Encoded with msgspec msgpack; unknown fields are ignored on decode so newer
senders can talk to older receivers. Version 2 adds, to `PreprocessedRequest`, the prompt as
one little-endian u32 buffer (`token_bytes`, sent by `encode_request` with `token_ids` left
empty) and the router's block hashes (`block_hashes`, `hash_block_size`). A version-1 list of
`token_ids` is still read; a version-1 receiver given a version-2 request sees an empty
prompt and refuses it ("token_ids is empty"), never a wrong one.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

WIRE_VERSION = 2
_IS_LE = sys.byteorder == "little"
assert array("I").itemsize == 4, "token_bytes needs a 4-byte array('I')"

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
    # (wire version 2 also had `num_output_tokens` here, always equal to the request's
    # num_generated_tokens; a message that still carries it decodes, the field ignored: the
    # engine's matcher replays the request's last num_generated_tokens)


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


# what a worker offering peer fetch publishes under this key of its instance metadata (the
# KV router's `tandem.router.fetch.FetchSource` reads it)
FETCH_METADATA_KEY = "kv_fetch"


class KvFetchHint(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The KV router's peer fetch (issue 31): before prefilling, have the KV of the prompt's
    first ``len(block_hashes)`` blocks instead of recomputing it: the leading ones this
    worker caches itself stay, the rest is pulled from instance ``source_instance_id``
    (whose transfer agent ``agent_id`` listens at ``address``). A hint, never a promise: the
    holder may have evicted some (a shorter fetch) or be gone (recompute)."""

    source_instance_id: str
    address: tuple[str, int]
    agent_id: str
    block_hashes: list[int]  # the router's chained hashes (DESIGN.md §5) of those blocks
    block_size: int
    # how the KV moves: None, tandem's transfer agents (native, mocker); "vllm-nixl", vLLM's
    # NixlConnector, whose export is a request on the holder: the frontend sends it to the
    # holder's request-plane ``source_address`` and hands the result on in ``export``
    protocol: str | None = None
    source_address: str | None = None
    export: dict[str, Any] | None = None


class PreprocessedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a worker's `generate` endpoint receives: tokens, sampling, stop conditions."""

    version: int = WIRE_VERSION
    request_id: str
    model: str
    token_ids: list[int]
    # how many trailing tokens of token_ids this request generated before (a prefill
    # worker's first token, a lost worker's output before a migration; `continued_after`):
    # penalties count them as output, not prompt, and a structured constraint's matcher
    # replays them before the first new token
    num_generated_tokens: int = 0
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stop: StopConditions
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    lora_name: str | None = None
    cache_salt: str | None = None
    routing: RoutingHints | None = None
    # absolute wall-clock deadline (time.time() seconds); None = no deadline
    deadline_s: float | None = None
    # issue 33 (protocols/tenancy.py): the priority class (vLLM's convention: lower = served
    # earlier; the router queue and the engines' schedulers order by it) and the tenant whose
    # fair share it counts against (None = the default tenant)
    priority: int = 0
    tenant: str | None = None
    # the tenant's weight (its share of its class: the router queue's fair share), stamped by
    # the frontend from the tenants file so that every router, remote ones too, reads it
    tenant_weight: float = 1.0
    # the conversation this request continues (x-session-id): the router sends it to the
    # worker of the session's last turn while that one is not overloaded (router/session.py)
    session_id: str | None = None
    # prefill/decode handoff (DESIGN.md §4); opaque to everyone but tandem.disagg
    disagg_params: dict[str, Any] | None = None
    # free-form annotations (e.g. "prefill_only"); engines ignore what they do not know
    annotations: list[str] = msgspec.field(default_factory=list)
    # images, in prompt order; their placeholder rows are already expanded in token_ids
    mm_items: list[MmItem] = msgspec.field(default_factory=list)
    # token_ids as little-endian u32 (4 bytes per id). On the wire (`encode_request`) it replaces
    # token_ids, which then travel empty. In memory it is a cache of token_ids' bytes, valid
    # only while its length is 4 * len(token_ids) (`prompt_u32` checks; a request whose ids were
    # extended or cut gets them recomputed)
    token_bytes: bytes | None = None
    # chained hashes (tandem.tokens.hashing, DESIGN.md §5) of the first len(block_hashes) full
    # blocks of `hash_block_size` tokens of token_ids, lora_name/cache_salt seeded, mm_items
    # mixed in: what the KV router computed to route it. A receiver with the same block size
    # may use them instead of hashing the prompt again, after checking a sample
    # (`tandem.tokens.hashing.hashes_match_sample`); a prefix of them stays valid when
    # token_ids grow
    block_hashes: list[int] | None = None
    hash_block_size: int = 0
    # the KV router's peer fetch for this request (None: prefill from the local cache only)
    kv_fetch: KvFetchHint | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """len(token_ids), also while they are still in `token_bytes` (see decode_request)."""
        if not self.token_ids and self.token_bytes:
            return len(self.token_bytes) // 4
        return len(self.token_ids)

    def continued_after(self, tokens: list[int]) -> PreprocessedRequest:
        """This request continued after `tokens` it generated elsewhere (a disaggregated
        prefill's first token, a lost worker's output before a migration): prompt + tokens,
        counted as generated (`num_generated_tokens`), the budget reduced by them (at least
        one more token, min_tokens by as many), the prompt's cached bytes dropped (they were
        the shorter prompt's). Everything else (id, routing, handoff, images) is the
        caller's to change. Needs token_ids as a list (not still in token_bytes)."""
        n = len(tokens)
        stop = msgspec.structs.replace(
            self.stop,
            max_tokens=max(self.stop.max_tokens - n, 1),
            min_tokens=max(self.stop.min_tokens - n, 0),
        )
        return msgspec.structs.replace(
            self,
            token_ids=self.token_ids + tokens,
            token_bytes=None,
            num_generated_tokens=self.num_generated_tokens + n,
            stop=stop,
        )


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
    """msgpack of `msg`; a PreprocessedRequest goes out in its wire form (`encode_request`)."""
    if type(msg) is PreprocessedRequest:
        return encode_request(msg)
    return _encoder.encode(msg)


def encode_output(out: EngineOutput) -> bytes:
    """msgpack of one EngineOutput (what `encode` gives, without its type dispatch)."""
    return _encoder.encode(out)


def token_u32(token_ids: Sequence[int]) -> bytes | None:
    """`token_ids` as little-endian u32 bytes; None when an id does not fit in a u32."""
    try:
        data = array("I", token_ids)
    except (OverflowError, TypeError):
        return None
    if not _IS_LE:
        data.byteswap()
    return data.tobytes()


def prompt_u32(request: PreprocessedRequest) -> bytes | None:
    """token_ids as little-endian u32 bytes (the cached `token_bytes` when still valid); None
    when an id does not fit in a u32 (such a prompt travels as a list)."""
    cached = request.token_bytes
    if cached is not None and len(cached) == 4 * len(request.token_ids):
        return cached
    if not request.token_ids and cached is not None:  # decoded, not materialized
        return cached
    return token_u32(request.token_ids)


def encode_request(
    request: PreprocessedRequest,
    *,
    block_hashes: list[int] | None = None,
    hash_block_size: int = 0,
) -> bytes:
    """The request-plane payload of `request`: token_ids as one u32 buffer (a msgpack bin, read
    without building an int per id) and, when given, the router's block hashes."""
    u32 = prompt_u32(request)
    wire = request
    if u32 is not None or block_hashes is not None:
        wire = msgspec.structs.replace(
            request,
            token_ids=[] if u32 is not None else request.token_ids,
            token_bytes=u32,
            block_hashes=block_hashes if block_hashes is not None else request.block_hashes,
            hash_block_size=hash_block_size
            if block_hashes is not None
            else request.hash_block_size,
        )
    return _encoder.encode(wire)


def decode_request(data: bytes, *, materialize: bool = True) -> PreprocessedRequest:
    """Decode a request-plane payload. A prompt sent as `token_bytes` is turned back into
    `token_ids` unless `materialize` is False: then token_ids stay empty and the receiver reads
    the prompt with `prompt_array` / `num_prompt_tokens` (an engine that never needs one int
    object per prompt token, e.g. the mocker). Raises msgspec errors on a malformed payload or
    a token_bytes length that is not a multiple of 4."""
    request = _request_decoder.decode(data)
    raw = request.token_bytes
    if raw is not None and request.token_ids:  # both sent: the list is the prompt
        request.token_bytes = None
    elif raw is not None:
        if len(raw) % 4:
            raise msgspec.ValidationError(
                f"token_bytes has {len(raw)} bytes; expected 4 per token id (little-endian u32)"
            )
        if materialize:
            request.token_ids = _u32_array(raw).tolist()
    return request


def prompt_array(request: PreprocessedRequest) -> array[int]:
    """The prompt as an array('I') (from `token_bytes` without a per-id object when the ids
    were not materialized). Raises OverflowError for an id outside u32."""
    raw = request.token_bytes
    if raw is not None and (not request.token_ids or len(raw) == 4 * len(request.token_ids)):
        return _u32_array(raw)
    return array("I", request.token_ids)


def _u32_array(raw: bytes) -> array[int]:
    out = array("I")
    out.frombytes(raw)
    if not _IS_LE:
        out.byteswap()
    return out


# one EngineOutput from its msgpack (the decoder's own method: no Python frame per token)
decode_output: Callable[[bytes], EngineOutput] = _output_decoder.decode
