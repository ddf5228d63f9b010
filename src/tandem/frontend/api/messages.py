"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API on the
generate pipeline.

Per request:
1. Headers: `anthropic-version` absent or one of `API_VERSIONS` (2026-10-21 refuses
   temperature / top_p / top_k, as Anthropic's API does); `anthropic-beta` only with
   values tandem implements (`BETAS`); workspace and user-profile headers refused (tandem has
   neither). Each refusal is a 400 naming the header.
2. Decode (unknown fields refused) and translate into the equivalent chat request
   (`messages_convert.chat_equivalent`): the same template, tokens, tools, images and routing
   as `/v1/chat/completions`; errors name the Messages fields.
3. admit → preprocess → route and stream → stream or collect → account
   (`pipeline.generate`), one choice, answered as a Message or its events
   (`messages_stream.MessageOutput`).
count_tokens preprocesses the same way and answers the prompt's length, routing nothing.
Errors on these routes are Anthropic's shape (the app: `errors.anthropic_error`).
"""

from __future__ import annotations

import logging

import msgspec

from tandem.errors import InvalidRequest
from tandem.frontend.api.messages_convert import (
    ChatEquivalent,
    chat_equivalent,
    no_reasoning_parser,
)
from tandem.frontend.api.messages_stream import MessageOutput
from tandem.frontend.api.request_input import decode_body, new_request_id
from tandem.frontend.http.message import HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry, ServedModel
from tandem.frontend.observability.metrics import count_as
from tandem.frontend.pipeline.generate import (
    GeneratePipeline,
    choice_state,
    request_context,
    step_span,
)
from tandem.frontend.pipeline.parsers.choice import OutputParser
from tandem.frontend.pipeline.preprocess import Prepared
from tandem.protocols.anthropic import API_VERSIONS, CountTokensRequest, MessagesRequest
from tandem.protocols.openai import show_value

logger = logging.getLogger(__name__)

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# betas whose behaviour tandem has anyway: tool input streamed as generated, token counting,
# prompt caching (automatic)
BETAS = frozenset(
    {
        "fine-grained-tool-streaming-2025-05-14",
        "token-counting-2024-11-01",
        "prompt-caching-2024-07-31",
    }
)
REFUSED_HEADERS = {
    "anthropic-workspace-id": "tandem has no workspaces",
    "anthropic-user-profile-id": "tandem has no user profiles",
}
_messages = msgspec.json.Decoder(MessagesRequest)
_count = msgspec.json.Decoder(CountTokensRequest)
_json = msgspec.json.Encoder()


class MessagesEndpoint:
    """The Messages routes of one frontend; safe for concurrent requests."""

    def __init__(self, registry: ModelRegistry, pipeline: GeneratePipeline) -> None:
        self.registry, self.pipeline = registry, pipeline

    async def create(self, http: HttpRequest, response: HttpResponse) -> None:
        version = check_headers(http.headers)
        req: MessagesRequest = decode_body(_messages, http.body)
        equivalent = chat_equivalent(req, stream=req.stream, version=version)
        model = self.registry.get(req.model)
        count_as(model.name, stream=req.stream)
        model.require_task("generate", "/v1/messages")
        pipeline = self.pipeline
        with pipeline.admission.slots(pipeline.admission.fan_out(equivalent.chat)):
            message_id = f"msg_{new_request_id()}"
            response.extra_headers.append(("request-id", message_id))
            with request_context(http, message_id, model.name):
                if equivalent.chat.user is not None:
                    logger.debug("request_id=%s user=%s", message_id, equivalent.chat.user)
                await model.ready()
                with step_span("preprocess"):
                    prepared = await _preprocess(pipeline, http, equivalent, model, message_id)
                if equivalent.thinking and prepared.reasoning_parser is None:
                    raise no_reasoning_parser(req.thinking, model.name)
                state = choice_state(prepared)
                # without `thinking`, a model that thinks anyway (R1 style) has its thinking
                # parsed out and left out of the answer
                hidden = None if equivalent.thinking else model.reasoning_parser
                output = MessageOutput(
                    message_id,
                    model.name,
                    prepared,
                    state,
                    output_parser(prepared, hidden),
                    stream=req.stream,
                    show_thinking=equivalent.thinking,
                )
                await pipeline.run(response, prepared, [state], output, stream=req.stream)

    async def count_tokens(self, http: HttpRequest, response: HttpResponse) -> None:
        """The prompt's token count: the same template and tokenizer as a generation."""
        check_headers(http.headers)
        req: CountTokensRequest = decode_body(_count, http.body)
        equivalent = chat_equivalent(req)
        model = self.registry.get(req.model)
        model.require_task("generate", "/v1/messages/count_tokens")
        await model.ready()
        request_id = f"count_{new_request_id()}"
        prepared = await _preprocess(self.pipeline, http, equivalent, model, request_id)
        if equivalent.thinking and prepared.reasoning_parser is None:
            raise no_reasoning_parser(req.thinking, model.name)
        await response.send(200, _json.encode({"input_tokens": sum(prepared.prompt_lens)}))


def check_headers(headers: dict[str, str]) -> str | None:
    """The request's `anthropic-version`; raises InvalidRequest naming a header tandem does
    not honour."""
    version = headers.get("anthropic-version")
    if version is not None and version not in API_VERSIONS:
        raise InvalidRequest(
            f"anthropic-version={show_value(version)} is not supported; accepted: "
            f"{', '.join(API_VERSIONS)} (or no header)",
            param="anthropic-version",
        )
    betas = [b.strip() for b in headers.get("anthropic-beta", "").split(",") if b.strip()]
    if refused := [b for b in betas if b not in BETAS]:
        raise InvalidRequest(
            f"anthropic-beta {show_value(', '.join(refused))} not supported by this server; "
            f"accepted: {', '.join(sorted(BETAS))}",
            param="anthropic-beta",
        )
    for header, why in REFUSED_HEADERS.items():
        if header in headers:
            raise InvalidRequest(
                f"{header}={show_value(headers[header])} is not supported: {why}; leave it unset",
                param=header,
            )
    return version


async def _preprocess(
    pipeline: GeneratePipeline,
    http: HttpRequest,
    equivalent: ChatEquivalent,
    model: ServedModel,
    request_id: str,
) -> Prepared:
    """The chat path's preprocessing; its errors name the Messages request's fields."""
    try:
        return await pipeline.preprocess(http, equivalent.chat, model, request_id)
    except InvalidRequest as exc:
        raise equivalent.rename(exc) from None


def output_parser(prepared: Prepared, hidden_reasoning: str | None) -> OutputParser | None:
    """The choice's reasoning and tool-call parsers, as chat's output makes them;
    `hidden_reasoning`: the model's reasoning parser where preprocessing turned it off (the
    template was told not to think), to catch thinking the model writes anyway."""
    reasoning, opens_think = prepared.reasoning_parser, prepared.prompt_opens_think
    if reasoning is None:
        reasoning, opens_think = hidden_reasoning, False
    if prepared.tool_parser is None and reasoning is None:
        return None
    return OutputParser.make(
        prepared.tool_parser,
        reasoning,
        max_calls=prepared.max_tool_calls,
        tools=prepared.tools,
        prompt_opens_think=opens_think,
    )
