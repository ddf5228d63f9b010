"""`POST /v1/chat/completions` and `/v1/completions` on the generate pipeline, and
`POST /v1/route/explain` (the router's choice for such a body, routing nothing).

Flow per request (DESIGN.md §3): decode + validate → admit (fan-out: prompts × n) →
preprocess → route and stream over the request plane (with migration) → postprocess per
choice → SSE chunks or one JSON body (`ChatOutput`, `completion_format.ResponseFormat`)."""

from __future__ import annotations

import logging
import uuid

import msgspec

from tandem.errors import InvalidRequest, ServingError
from tandem.frontend import errors as http_errors
from tandem.frontend.api.completion_format import ResponseFormat, usage
from tandem.frontend.api.request_input import (
    client_request_id,
    completion_decoder,
    decode_body,
    decode_completion,
    new_request_id,
)
from tandem.frontend.http.message import HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry
from tandem.frontend.observability.metrics import count_as
from tandem.frontend.pipeline.generate import (
    GeneratePipeline,
    choice_state,
    request_context,
    step_span,
)
from tandem.frontend.pipeline.parsers.choice import OutputParser
from tandem.frontend.pipeline.postprocess import ChoiceState, Event, best_candidates
from tandem.frontend.pipeline.preprocess import Prepared
from tandem.protocols.openai import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_json = msgspec.json.Encoder()


class ChatEndpoints:
    """The chat and completions handlers of one frontend; safe for concurrent requests."""

    def __init__(self, registry: ModelRegistry, pipeline: GeneratePipeline) -> None:
        self.registry, self.pipeline = registry, pipeline
        self._client_request_ids: set[str] = set()  # X-Request-IDs of requests in flight

    async def chat_completions(self, request: HttpRequest, response: HttpResponse) -> None:
        req = decode_body(_chat_decoder, request.body)
        await self._generate(request, response, req, ResponseFormat(chat=True))

    async def completions(self, request: HttpRequest, response: HttpResponse) -> None:
        req = decode_completion(request.body)
        await self._generate(request, response, req, ResponseFormat(chat=False))

    async def _generate(
        self,
        http: HttpRequest,
        response: HttpResponse,
        req: ChatCompletionRequest | CompletionRequest,
        fmt: ResponseFormat,
    ) -> None:
        model = self.registry.get(req.model)
        count_as(model.name, stream=req.stream)
        model.require_task("generate", "/v1/chat/completions" if fmt.chat else "/v1/completions")
        client_id = self._unique_client_id(http)
        admission = self.pipeline.admission
        with admission.slots(admission.fan_out(req)), self._client_id_held(client_id):
            prefix = "chatcmpl" if fmt.chat else "cmpl"
            request_id = f"{prefix}-{client_id or new_request_id()}"
            with request_context(http, request_id, model.name):
                logger.debug("request_id=%s %s model=%s", request_id, http.path, model.name)
                await model.ready()
                with step_span("preprocess"):
                    prepared = await self.pipeline.preprocess(http, req, model, request_id)
                _log_end_user(request_id, req)
                fmt.bind(request_id, model.name)
                states = _choice_states(prepared)
                output = ChatOutput(req, prepared, states, fmt)
                await self.pipeline.run(response, prepared, states, output, stream=req.stream)

    def _unique_client_id(self, http: HttpRequest) -> str | None:
        """The client's X-Request-ID; InvalidRequest when a request with it is in flight."""
        client_id = client_request_id(http.headers)
        if client_id is not None and client_id in self._client_request_ids:
            raise InvalidRequest(
                f"X-Request-ID={client_id!r} is already in flight; expected a unique id",
                param="X-Request-ID",
            )
        return client_id

    def _client_id_held(self, client_id: str | None) -> _HeldId:
        return _HeldId(self._client_request_ids, client_id)

    async def route_explain(self, request: HttpRequest, response: HttpResponse) -> None:
        """`POST /v1/route/explain` with a chat (has `messages`) or completions body: the
        router's `explain` of its first engine request (a remote router's service answers
        through `explain_choice`), routing nothing. 404 when the policy cannot explain."""
        try:
            is_chat = "messages" in msgspec.json.decode(request.body)
        except (*http_errors.BODY_ERRORS, TypeError):
            is_chat = False  # the completions decoder below names what is wrong
        req = decode_body(_chat_decoder if is_chat else completion_decoder, request.body)
        model = self.registry.get(req.model)
        await model.ready()
        request_id = f"explain-{uuid.uuid4().hex}"
        prepared = await self.pipeline.preprocess(request, req, model, request_id)
        try:
            result = await model.router.explain_choice(prepared.requests[0])
        except NotImplementedError:
            err = InvalidRequest(f"the router of model '{model.name}' cannot explain its choice")
            err.status_code = 404
            raise err from None
        await response.send(200, _json.encode(result))


class _HeldId:
    """Holds a client's X-Request-ID in the in-flight set for a block (None: nothing)."""

    __slots__ = ("_held", "_id")

    def __init__(self, held: set[str], client_id: str | None) -> None:
        self._held, self._id = held, client_id

    def __enter__(self) -> None:
        if self._id is not None:
            self._held.add(self._id)

    def __exit__(self, *exc: object) -> None:
        if self._id is not None:
            self._held.discard(self._id)


def _log_end_user(request_id: str, req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.user is not None or req.safety_identifier is not None:
        logger.debug(
            "request_id=%s user=%s safety_identifier=%s",
            request_id,
            req.user,
            req.safety_identifier,
        )


def _choice_states(prepared: Prepared) -> list[ChoiceState]:
    """One state per engine request; an echoed prompt prefixes its choices' text."""
    states = [choice_state(prepared, i) for i in range(len(prepared.requests))]
    if prepared.echo_texts is not None:  # choices of prompt p: p*k .. p*k+k-1
        per_prompt = len(states) // len(prepared.echo_texts)
        for state in states:
            state.prefix = prepared.echo_texts[state.index // per_prompt]
    return states


class ChatOutput:
    """The chat and completions answer (`Output` of the generate pipeline): SSE chunks, or
    one body with the best candidates; tool-call markup becomes `tool_calls`, and reasoning
    `reasoning_content`."""

    __slots__ = (
        "_continuous",
        "_fmt",
        "_include_usage",
        "_parsers",
        "_prepared",
        "_states",
        "keep_text",
    )

    def __init__(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prepared: Prepared,
        states: list[ChoiceState],
        fmt: ResponseFormat,
    ) -> None:
        self._prepared, self._states, self._fmt = prepared, states, fmt
        self._parsers = _output_parsers(prepared)
        self.keep_text = not req.stream
        opts = req.stream_options
        self._include_usage = opts is not None and opts.include_usage
        self._continuous = self._include_usage and opts is not None and opts.continuous_usage_stats

    def head(self) -> bytes:
        fmt = self._fmt
        return b"".join(fmt.role_chunk(s.index) for s in self._states) if fmt.chat else b""

    def chunks(self, batch: list[Event]) -> bytes:
        """One SSE chunk per engine chunk; a batch's leave in one write."""
        fmt, parsers, out = self._fmt, self._parsers, []
        for state, text, logprobs, finish, num_tokens in batch:
            calls, reasoning = None, ""
            if parsers is not None:  # markup becomes delta.tool_calls / reasoning_content
                parser = parsers[state.index]
                reasoning, text, calls = parser.feed(text, final=finish is not None)
                finish = "tool_calls" if finish == "stop" and parser.calls else finish
            if text or finish is not None or logprobs or calls or reasoning:
                running = None
                if self._continuous:
                    running = usage(self._prepared, self._states, at=(state, num_tokens))
                out.append(
                    fmt.chunk(state.index, text, logprobs, finish, running, calls, reasoning)
                )
        return out[0] if len(out) == 1 else b"".join(out)

    def tail(self) -> bytes:
        done = b"data: [DONE]\n\n"
        if self._include_usage:
            return self._fmt.usage_chunk(usage(self._prepared, self._states)) + done
        return done

    def failed(self, exc: ServingError) -> bytes | None:
        return None  # the app writes it as one SSE error event, then the end marker

    def body(self) -> bytes:
        prepared, states, parsers = self._prepared, self._states, self._parsers
        choices = states
        if prepared.best_of is not None:  # usage still counts every candidate (as OpenAI bills)
            keep = prepared.num_top_logprobs is not None
            position = {id(s): i for i, s in enumerate(states)}
            choices = best_candidates(states, prepared.best_of, prepared.n, keep_logprobs=keep)
            if parsers is not None:  # each chosen candidate keeps its own parser
                parsers = [parsers[position[id(s)]] for s in choices]
        return self._fmt.full_response(choices, usage(prepared, states), parsers)


def _output_parsers(prepared: Prepared) -> list[OutputParser] | None:
    """One output parser per choice when the request offered tools or the model reasons."""
    if prepared.tool_parser is None and prepared.reasoning_parser is None:
        return None
    return [
        OutputParser.make(
            prepared.tool_parser,
            prepared.reasoning_parser,
            max_calls=prepared.max_tool_calls,
            tools=prepared.tools,
            prompt_opens_think=prepared.prompt_opens_think,
        )
        for _ in prepared.requests
    ]
