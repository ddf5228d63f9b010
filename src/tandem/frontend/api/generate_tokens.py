"""`POST /inference/v1/generate`: token ids in, token ids out (vLLM's shape, which Dynamo 1.4
serves too), on the generate pipeline like every other request.

The body (`protocols/tokens_generate.GenerateRequest`) becomes the /v1/completions request
with the same ids as its `prompt` and the same sampling fields, and runs through the same
preprocess (vocabulary and context checks, the u32 prompt), admission, KV-aware routing,
migration and disaggregation; only the answer differs: each choice's `token_ids` and, when
asked, logprobs per token named `token_id:<id>`. Nothing is detokenized, except to match
`stop` strings when a request has some. Errors name the field as the client sent it
(`token_ids`, `sampling_params.max_tokens`, ...).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from tandem.errors import InvalidRequest, ServingError
from tandem.frontend import errors as http_errors
from tandem.frontend.api.completion_format import usage
from tandem.frontend.api.model_routes import model_for
from tandem.frontend.api.request_input import (
    MAX_REQUEST_ID_CHARS,
    REQUEST_ID_HEADER,
    client_request_id,
    new_request_id,
)
from tandem.frontend.http.message import HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry
from tandem.frontend.observability.metrics import count_as
from tandem.frontend.pipeline.generate import GeneratePipeline, request_context
from tandem.frontend.pipeline.postprocess import ChoiceState, Event
from tandem.frontend.pipeline.preprocess import Prepared
from tandem.protocols.engine import EngineOutput
from tandem.protocols.openai import (
    CompletionIdsRequest,
    check_cache_salt,
    check_unsupported,
    show_value,
)
from tandem.protocols.tokens_generate import (
    UNSUPPORTED_GENERATE,
    UNSUPPORTED_SAMPLING,
    GenerateRequest,
    GenerateSamplingParams,
)
from tandem.tokens.tokenizer import ModelTokenizer

PATH = "/inference/v1/generate"
_decoder = msgspec.json.Decoder(GenerateRequest)
_json = msgspec.json.Encoder()
_UNKNOWN_FIELD = re.compile(r"unknown field `(?P<field>[^`]+)`(?: - at `\$\.?(?P<at>[^`]*)`)?")
# the completions fields a sampling_params field becomes (error names are turned back)
_SAMPLING_NAMES = (
    "n", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "max_tokens", "min_tokens", "stop_token_ids", "stop", "ignore_eos",
    "logprobs", "logit_bias",
)  # fmt: skip
_RENAME = re.compile(r"(?<![\w.\[])(prompt|" + "|".join(_SAMPLING_NAMES) + r")\b")


def decode_generate(body: bytes) -> GenerateRequest:
    """The request, or InvalidRequest naming what is wrong: an unknown field (here or in
    `sampling_params`), a value vLLM defines that tandem does not offer, a bad shape."""
    try:
        req = _decoder.decode(body)
    except http_errors.BODY_ERRORS as exc:
        m = _UNKNOWN_FIELD.search(str(exc))
        if m is None:
            raise http_errors.decode_error(exc, body) from exc
        param = ".".join(p for p in (m.group("at"), m.group("field")) if p)
        known = GenerateSamplingParams if m.group("at") else GenerateRequest
        raise InvalidRequest(
            f"{param} is not a field of {PATH} (vLLM's GenerateRequest); expected one of: "
            f"{', '.join(known.__struct_encode_fields__)}",
            param=param,
        ) from exc
    check_unsupported(req, UNSUPPORTED_GENERATE)
    try:
        check_unsupported(req.sampling_params, UNSUPPORTED_SAMPLING)
    except InvalidRequest as exc:  # its message starts with the field's name
        exc.param, exc.message = f"sampling_params.{exc.param}", f"sampling_params.{exc.message}"
        exc.args = (exc.message,)
        raise
    return req


def completion_request(req: GenerateRequest, model: str) -> CompletionIdsRequest:
    """The /v1/completions request with `req`'s ids as its prompt and its sampling fields."""
    sp = req.sampling_params
    if not req.token_ids:
        raise InvalidRequest(
            "token_ids is empty; expected at least one token id", param="token_ids"
        )
    if sp.stop and not sp.detokenize:
        raise InvalidRequest(
            f"sampling_params.stop={show_value(sp.stop)} needs detokenize: true (stop strings "
            "are matched on the text); use stop_token_ids, or drop detokenize: false",
            param="sampling_params.stop",
        )
    if sp.output_kind not in (0, 1, 2):
        raise InvalidRequest(
            f"sampling_params.output_kind={sp.output_kind} is invalid; expected vLLM's "
            "RequestOutputKind: 0 (cumulative), 1 (delta) or 2 (final only)",
            param="sampling_params.output_kind",
        )
    if req.cache_salt is not None:
        check_cache_salt(req.cache_salt)
    bias = None if sp.logit_bias is None else {str(k): v for k, v in sp.logit_bias.items()}
    return CompletionIdsRequest(
        model=model,
        prompt=req.token_ids,
        n=sp.n,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        seed=sp.seed,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        max_tokens=sp.max_tokens,
        min_tokens=sp.min_tokens,
        stop=sp.stop,
        stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs,
        logit_bias=bias,
        skip_special_tokens=sp.skip_special_tokens,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        stream=bool(req.stream),
        stream_options=req.stream_options,
    )


class GenerateTokensEndpoint:
    """The handler of `POST /inference/v1/generate`; safe for concurrent requests."""

    def __init__(self, registry: ModelRegistry, pipeline: GeneratePipeline) -> None:
        self.registry, self.pipeline = registry, pipeline
        self._client_ids: set[str] = set()  # client request ids in flight

    async def __call__(self, http: HttpRequest, response: HttpResponse) -> None:
        req = decode_generate(http.body)
        model = await model_for(self.registry, req.model)
        stream = bool(req.stream)
        count_as(model.name, stream=stream)
        model.require_task("generate", PATH)
        completion = completion_request(req, model.name)
        admission = self.pipeline.admission
        client_id = self._client_id(http, req)
        with generate_names():
            num = admission.fan_out(completion)
        with admission.slots(num), self._held(client_id):
            request_id = f"gen-{client_id or new_request_id()}"
            with request_context(http, request_id, model.name):
                with generate_names():
                    prepared = await self.pipeline.preprocess(http, completion, model, request_id)
                if req.cache_salt is not None:
                    for r in prepared.requests:
                        r.cache_salt = req.cache_salt
                choices = token_choices(prepared)
                output = TokensOutput(client_id or request_id, prepared, choices, req)
                states: list[ChoiceState] = list(choices)
                await self.pipeline.run(response, prepared, states, output, stream=stream)

    def _client_id(self, http: HttpRequest, req: GenerateRequest) -> str | None:
        """The body's request_id (else the X-Request-ID header), checked like the header and
        refused while a request with it is in flight."""
        if req.request_id is None:
            client_id = client_request_id(http.headers)
        else:
            try:
                client_id = client_request_id({REQUEST_ID_HEADER: req.request_id})
            except InvalidRequest:
                raise InvalidRequest(
                    f"request_id={show_value(req.request_id)} is invalid; expected 1 to "
                    f"{MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces",
                    param="request_id",
                ) from None
        if client_id is not None and client_id in self._client_ids:
            raise InvalidRequest(
                f"request_id={client_id!r} is already in flight; expected a unique id",
                param="request_id",
            )
        return client_id

    @contextmanager
    def _held(self, client_id: str | None) -> Iterator[None]:
        if client_id is None:
            yield
            return
        self._client_ids.add(client_id)
        try:
            yield
        finally:
            self._client_ids.discard(client_id)


@contextmanager
def generate_names() -> Iterator[None]:
    """Preprocessing and admission name /v1/completions' fields; a client of this endpoint
    sent `token_ids` and `sampling_params.*`: an InvalidRequest raised in the block names
    those."""
    try:
        yield
    except InvalidRequest as exc:
        if exc.param is not None:
            exc.param = _RENAME.sub(_generate_name, exc.param)
        exc.message = _RENAME.sub(_generate_name, exc.message)
        exc.message = exc.message.replace("token_ids token id", "token_ids: token id")
        exc.args = (exc.message,)
        raise


def _generate_name(m: re.Match[str]) -> str:
    name = m.group(1)
    return "token_ids" if name == "prompt" else f"sampling_params.{name}"


def token_choices(prepared: Prepared) -> list[TokenChoice]:
    """One state per engine request; a tokenizer (a detokenizer) only for stop strings."""
    tok = prepared.model.tokenizer if prepared.stop_strings else None
    return [
        TokenChoice(i, tok, prepared.stop_strings, skip_special_tokens=prepared.skip_special_tokens)
        for i in range(len(prepared.requests))
    ]


class TokenChoice(ChoiceState):
    """A choice whose answer is its token ids (all of them kept: `token_ids`); logprobs name
    tokens `token_id:<id>`, never decoded. With stop strings, the choice ends at the token
    that completes the string (`ChoiceState.process` matches a chunk token by token)."""

    __slots__ = ("num_sent", "token_ids")

    def __init__(
        self, index: int, tokenizer: ModelTokenizer | None, stops: list[str], **kw: Any
    ) -> None:
        super().__init__(index, tokenizer, stops, **kw)
        self.token_ids: list[int] = []
        self.num_sent = 0  # of token_ids, streamed so far

    def process(self, out: EngineOutput, *, keep_text: bool = False) -> None:
        counted = self.num_tokens
        super().process(out, keep_text=keep_text)
        self.token_ids += out.token_ids[: self.num_tokens - counted]

    def _logprobs(self, out: EngineOutput, used: int) -> list[dict[str, Any]]:
        assert out.logprobs is not None
        tops = out.top_logprobs or [[] for _ in out.token_ids]
        return [
            {
                "token": f"token_id:{tid}",
                "logprob": lp,
                "top_logprobs": [
                    {"token": f"token_id:{t.token_id}", "logprob": t.logprob} for t in top
                ],
            }
            for tid, lp, top in zip(out.token_ids[:used], out.logprobs, tops, strict=False)
        ]


class TokensOutput:
    """The tokens-in answer (`Output` of the generate pipeline): one `data:` event per engine
    chunk with the choice's new token ids, or one body with every choice's ids."""

    __slots__ = (
        "_choices",
        "_continuous",
        "_head",
        "_include_usage",
        "_prepared",
        "_states",
        "keep_text",
    )

    def __init__(
        self,
        request_id: str,
        prepared: Prepared,
        choices: list[TokenChoice],
        req: GenerateRequest,
    ) -> None:
        self._prepared, self._choices = prepared, choices
        self._states: list[ChoiceState] = list(choices)  # for usage()
        self.keep_text = not req.stream  # the unary answer carries every logprob
        self._head = {"request_id": request_id, "model": prepared.model.name}
        opts = req.stream_options
        self._include_usage = opts is not None and opts.include_usage
        self._continuous = self._include_usage and opts is not None and opts.continuous_usage_stats

    def head(self) -> bytes:
        return b""

    def chunks(self, batch: list[Event]) -> bytes:
        out = []
        for state, _text, logprobs, finish, num_tokens in batch:
            assert isinstance(state, TokenChoice)
            ids = state.token_ids[state.num_sent : num_tokens]
            state.num_sent = num_tokens
            if not ids and finish is None:
                continue
            chunk: dict[str, Any] = {**self._head, "choices": [_choice(state, ids, logprobs)]}
            chunk["choices"][0]["finish_reason"] = finish
            if self._continuous:
                chunk["usage"] = usage(self._prepared, self._states, at=(state, num_tokens))
            out.append(b"data: " + _json.encode(chunk) + b"\n\n")
        return b"".join(out)

    def tail(self) -> bytes:
        done = b"data: [DONE]\n\n"
        if not self._include_usage:
            return done
        last = {**self._head, "choices": [], "usage": usage(self._prepared, self._states)}
        return b"data: " + _json.encode(last) + b"\n\n" + done

    def failed(self, exc: ServingError) -> bytes | None:
        return None  # the app writes it as one SSE error event, then the end marker

    def body(self) -> bytes:
        choices = [_choice(s, s.token_ids, s.all_logprobs) for s in self._choices]
        return _json.encode(
            {
                **self._head,
                "choices": choices,
                "usage": usage(self._prepared, self._states),
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        )


def _choice(state: TokenChoice, ids: list[int], logprobs: Any) -> dict[str, Any]:
    return {
        "index": state.index,
        "token_ids": ids,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": state.finish_reason,
    }
