"""`POST /v1/completions/render` and `/v1/chat/completions/render` (vLLM's render endpoints):
the prompt as token ids, with its resolved sampling parameters, without generating.

The answer is what vLLM's render answers: the tokens-in request (`GenerateRequest`: `token_ids`,
`sampling_params`, `model`, `stream`, ...), one for a chat body and a list (one per prompt) for
a completions body, ready to post to `/inference/v1/generate`, where it generates exactly what
the original request would have. vLLM's router calls these on a worker to route text prompts
by their tokens. The body is checked and preprocessed by the very code the generating
endpoint runs (template, tokenization, vocabulary, context, sampling ranges), so a request
that would be a 400 there is the same 400 here; what a tokens-in request cannot carry
(`echo`, `best_of` > n, structured outputs and forced tool calls, images) is a 400 naming it.
Nothing is admitted or routed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.errors import InvalidRequest
from tandem.frontend.api.request_input import decode_body, decode_completion, new_request_id
from tandem.frontend.http.message import HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry
from tandem.frontend.observability.metrics import count_as
from tandem.frontend.pipeline.generate import GeneratePipeline
from tandem.frontend.pipeline.preprocess import Prepared
from tandem.protocols.openai import ChatCompletionRequest, CompletionRequest

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_json = msgspec.json.Encoder()
_NOT_CARRIED = "a tokens-in request (what render answers) cannot carry it"


class RenderEndpoints:
    """The two render handlers; safe for concurrent requests."""

    def __init__(self, registry: ModelRegistry, pipeline: GeneratePipeline) -> None:
        self.registry, self.pipeline = registry, pipeline

    async def completions(self, http: HttpRequest, response: HttpResponse) -> None:
        req = decode_completion(http.body)
        prepared = await self._prepare(http, req, "/v1/completions/render", "cmpl")
        if req.echo:
            raise InvalidRequest(f"echo=true cannot be rendered: {_NOT_CARRIED}", param="echo")
        n = len(prepared.requests) // len(prepared.prompt_lens)
        rendered = [
            generate_request(prepared, p * n, n, req, "cmpl")
            for p in range(len(prepared.prompt_lens))
        ]
        await response.send(200, _json.encode(rendered))

    async def chat_completions(self, http: HttpRequest, response: HttpResponse) -> None:
        req = decode_body(_chat_decoder, http.body)
        prepared = await self._prepare(http, req, "/v1/chat/completions/render", "chatcmpl")
        if prepared.requests[0].mm_items:
            raise InvalidRequest(
                f"messages with image parts cannot be rendered: {_NOT_CARRIED} (no images)",
                param="messages",
            )
        rendered = generate_request(prepared, 0, len(prepared.requests), req, "chatcmpl")
        await response.send(200, _json.encode(rendered))

    async def _prepare(
        self,
        http: HttpRequest,
        req: ChatCompletionRequest | CompletionRequest,
        path: str,
        kind: str,
    ) -> Prepared:
        model = self.registry.get(req.model)
        count_as(model.name, stream=req.stream)
        model.require_task("generate", path)
        self.pipeline.admission.fan_out(req)  # the generating endpoint's 400 past --max-fanout
        await model.ready()
        prepared = await self.pipeline.preprocess(http, req, model, f"{kind}-{new_request_id()}")
        if prepared.best_of is not None:
            raise InvalidRequest(
                f"best_of={req.best_of} > n={req.n} cannot be rendered: {_NOT_CARRIED}",
                param="best_of",
            )
        if prepared.requests[0].sampling.structured is not None:
            param = "response_format" if req.response_format is not None else "tool_choice"
            raise InvalidRequest(
                f"{param} (a structured output) cannot be rendered: {_NOT_CARRIED}",
                param=param,
            )
        return prepared


def generate_request(
    prepared: Prepared,
    first: int,
    n: int,
    req: ChatCompletionRequest | CompletionRequest,
    kind: str,
) -> dict[str, Any]:
    """The tokens-in request of the prompt whose first choice is `prepared.requests[first]`
    (its n choices share prompt, sampling and stop conditions but for their seeds: choice i
    is seeded seed + i on both endpoints)."""
    engine = prepared.requests[first]
    s, stop = engine.sampling, engine.stop
    sampling = {
        "n": n,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "seed": s.seed,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "max_tokens": stop.max_tokens,  # resolved against the context, as vLLM renders it
        "min_tokens": stop.min_tokens,
        "stop": prepared.stop_strings or None,
        "stop_token_ids": list(stop.stop_token_ids),
        "ignore_eos": stop.ignore_eos,
        "logprobs": s.logprobs,
        "logit_bias": None
        if s.logit_bias is None
        else {str(k): v for k, v in s.logit_bias.items()},
        "skip_special_tokens": prepared.skip_special_tokens,
        "include_stop_str_in_output": prepared.include_stop_str,
    }
    return {
        "request_id": f"{kind}-{new_request_id()}",
        "token_ids": list(engine.token_ids),
        "sampling_params": sampling,
        "model": prepared.model.name,
        "stream": req.stream,
        "stream_options": msgspec.to_builtins(req.stream_options) if req.stream else None,
        "cache_salt": None,
        "priority": 0,
        "features": None,
        "kv_transfer_params": None,
    }
