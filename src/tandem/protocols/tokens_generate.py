"""Tokens in, tokens out: vLLM's `POST /inference/v1/generate` request and response, and what
the render endpoints answer (`/v1/completions/render`, `/v1/chat/completions/render`: the
same request, ready to post, as vLLM's render endpoints give it).

The shapes are vLLM's (`GenerateRequest`, `GenerateResponse`, its stream chunks; Dynamo 1.4
serves the same): `token_ids` and `sampling_params` in, per-choice `token_ids` (and logprobs
per token, each token named `token_id:<id>`) out, no text. Unknown fields, here and in
`sampling_params`, are refused (`forbid_unknown_fields`): a sampling parameter this server
does not know would otherwise be dropped silently. vLLM fields that ask for something tandem
does not do are typed `Any` and listed in `UNSUPPORTED_SAMPLING` / `UNSUPPORTED_GENERATE`
with the values that ask for nothing (vLLM's defaults), so a client that sends vLLM's whole
`SamplingParams` is served, and one that asks for more gets a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.protocols.openai import StreamOptions, Unsupported
from tandem.protocols.openai_types import Usage


class GenerateSamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `SamplingParams`, as JSON. None: the same default as /v1/completions."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # None: the rest of the context
    min_tokens: int = 0
    stop: str | list[str] | None = None  # stop strings: detokenized for matching only
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per generated token (0: the token's own)
    logit_bias: dict[int, float] | None = None
    # text only: no text is returned (as vLLM's own generate), so any value is accepted;
    # `detokenize: false` refuses `stop` strings (they need the text)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int = 0  # vLLM's RequestOutputKind; the server streams deltas either way
    skip_clone: bool = False  # vLLM-internal (its copy of the params); nothing to do here
    # vLLM-internal fields that msgspec.json.encode(vllm.SamplingParams(...)) writes too: vLLM
    # derives them from the fields above (stop ids + the model's eos, bad_words' ids) when it
    # builds the params, and so does tandem's preprocess: their values are not read
    all_stop_token_ids: Any = msgspec.field(default=None, name="_all_stop_token_ids")
    bad_words_token_ids: Any = msgspec.field(default=None, name="_bad_words_token_ids")
    eos_token_id: Any = msgspec.field(default=None, name="_eos_token_id")
    watermarking_skipped: Any = msgspec.field(default=None, name="_watermarking_skipped")
    # vLLM fields tandem does not offer (UNSUPPORTED_SAMPLING)
    min_p: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None
    extra_args: Any = None
    truncate_prompt_tokens: Any = None
    flat_logprobs: Any = None
    logprob_token_ids: Any = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: Any = None
    stream_interval: Any = None
    skip_reading_prefix_cache: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    routed_experts_prompt_start: Any = None
    trace_decode_token_ids: Any = None
    watermarking: Any = None
    output_text_buffer_length: Any = None


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `GenerateRequest` (tokens in): the render endpoints answer this shape too."""

    token_ids: list[int]
    sampling_params: GenerateSamplingParams
    model: str | None = None  # None: the one model served
    request_id: str | None = None  # None: one is generated
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # seeds the prefix cache's (and the router's) block hashes
    priority: int = 0
    features: Any = None  # multimodal features (UNSUPPORTED_GENERATE)
    kv_transfer_params: Any = None  # vLLM's disaggregation hand-off (UNSUPPORTED_GENERATE)


UNSUPPORTED_SAMPLING = {
    "min_p": Unsupported((None, 0, 0.0), "min-p sampling is not offered (use top_p / top_k)"),
    "prompt_logprobs": Unsupported((None,), "prompt tokens get no logprobs"),
    "allowed_token_ids": Unsupported((None,), "use logit_bias to favour or ban token ids"),
    "bad_words": Unsupported((None, []), "use logit_bias to ban token ids"),
    "structured_outputs": Unsupported(
        (None,), "structured outputs take /v1/completions' response_format"
    ),
    "logits_processors": Unsupported((None, []), "custom logits processors are not offered"),
    "extra_args": Unsupported((None, {}), "engine-specific extra arguments are not offered"),
    "truncate_prompt_tokens": Unsupported((None,), "prompts are never truncated"),
    "flat_logprobs": Unsupported((None, False), "logprobs come in vLLM's per-token form"),
    # vLLM 0.32's further fields (a msgspec-encoded SamplingParams() carries
    # skip_reading_prefix_cache: false)
    "logprob_token_ids": Unsupported((None,), "logprobs of chosen ids are not offered"),
    "prompt_logprob_token_ids": Unsupported((None,), "prompt tokens get no logprobs"),
    "prompt_logprob_start": Unsupported((None,), "prompt tokens get no logprobs"),
    "stream_interval": Unsupported((None, 1), "every engine output is streamed as it comes"),
    "skip_reading_prefix_cache": Unsupported((None, False), "the prefix cache is always read"),
    "thinking_token_budget": Unsupported((None,), "there is no thinking budget"),
    "repetition_detection": Unsupported((None,), "repetition detection is not offered"),
    "routed_experts_prompt_start": Unsupported((None, 0), "routed experts are not returned"),
    "trace_decode_token_ids": Unsupported((None,), "decode tracing by id is not offered"),
    "watermarking": Unsupported((None,), "watermarking is not offered"),
    "output_text_buffer_length": Unsupported((None, 0), "vLLM-internal; no text is returned"),
}
UNSUPPORTED_GENERATE = {
    "features": Unsupported((None,), "multimodal features are not taken with token ids"),
    "kv_transfer_params": Unsupported(
        (None, {}), "tandem hands KV over itself (--disagg); no client-driven transfer"
    ),
    "priority": Unsupported((0,), "requests here have one priority"),
}


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A response body: every field documented (decoding a real body checks that)."""


class TokenTopLogprob(_Body):
    token: str  # "token_id:<id>"
    logprob: float


class TokenLogprob(_Body):
    token: str  # "token_id:<id>"
    logprob: float
    top_logprobs: list[TokenTopLogprob]


class TokenLogprobs(_Body):
    content: list[TokenLogprob]


class GenerateChoice(_Body):
    index: int
    token_ids: list[int]  # the whole output (a stream chunk: the tokens it adds)
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # stop, length or abort (None while streaming)


class GenerateResponse(_Body):
    """The answer of a tokens-in generate; streamed, each `data:` event is one of these with
    the choices' new tokens, the last one (with stream_options.include_usage) only usage."""

    request_id: str
    model: str
    choices: list[GenerateChoice]
    usage: Usage | None = None
    prompt_logprobs: None = None
    kv_transfer_params: None = None
