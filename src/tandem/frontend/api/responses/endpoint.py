"""`/v1/responses` (OpenAI's Responses API, text) on top of the chat path.

POST, per request:
1. Decode; refuse fields OpenAI defines that tandem does not honour (400 naming the field,
   `protocols/openai_responses.py`); check ranges.
2. Build chat messages: `instructions` as a system message, then the conversation stored
   under `previous_response_id` (400 `previous_response_not_found` when unknown or expired),
   then the `input` items (developer → system).
3. Run them as a chat completion: the same admission, preprocess (chat template, context
   check), routing, migration and detokenization as `/v1/chat/completions` (the generate
   pipeline, `frontend.pipeline.generate`), one choice.
4. Answer with a Response object (`events.ResponseBuilder`), or stream its events.
5. With `store` (OpenAI's default: true) keep the object and the conversation in the
   frontend's `ResponseStore` (bounded; see `store.py`) for `previous_response_id`,
   `GET /v1/responses/{id}` and `DELETE /v1/responses/{id}`; `store: false` keeps nothing.
   A stored response belongs to the tenant or API key that made it (`frontend/ownership.py`):
   to anyone else its id is unknown (404; `previous_response_not_found`).
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from tandem.errors import InvalidRequest, ServingError
from tandem.frontend import errors as http_errors
from tandem.frontend.api.responses.events import ResponseBuilder, new_response_id
from tandem.frontend.api.responses.store import ResponseStore
from tandem.frontend.http.message import HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry
from tandem.frontend.observability.metrics import count_as
from tandem.frontend.ownership import Ownership
from tandem.frontend.pipeline.generate import (
    GeneratePipeline,
    choice_state,
    request_context,
    step_span,
)
from tandem.frontend.pipeline.parsers.choice import OutputParser
from tandem.frontend.pipeline.postprocess import ChoiceState, Event
from tandem.frontend.pipeline.preprocess import Prepared
from tandem.protocols.openai import ChatCompletionRequest, show_value
from tandem.protocols.openai_responses import (
    ResponsesRequest,
    input_messages,
    response_format,
    unsupported_fields,
    validate_responses,
)

Handler = Callable[[HttpRequest, HttpResponse], Awaitable[None]]
PREFIX = "/v1/responses/"
_decoder = msgspec.json.Decoder(ResponsesRequest)
_json = msgspec.json.Encoder()


class ResponsesEndpoint:
    """The `/v1/responses` routes of one frontend; safe for concurrent requests."""

    def __init__(
        self,
        registry: ModelRegistry,
        pipeline: GeneratePipeline,
        store: ResponseStore | None = None,
    ) -> None:
        self.registry, self.pipeline = registry, pipeline
        self.store = store or ResponseStore()
        self.owners = Ownership()  # who may read what is stored (set by the wiring)
        # several frontend processes share the port (SO_REUSEPORT): each has its own store
        self.shared_port = False

    def route(self, method: str, path: str) -> Handler | None:
        """The handler of `GET`/`DELETE /v1/responses/{id}`, or None."""
        if not path.startswith(PREFIX) or "/" in path[len(PREFIX) :]:
            return None
        return {"GET": self.retrieve, "DELETE": self.delete}.get(method)

    async def retrieve(self, http: HttpRequest, response: HttpResponse) -> None:
        for name, values in urllib.parse.parse_qs(http.query, keep_blank_values=True).items():
            if not (name == "stream" and values == ["false"]):  # OpenAI: stream, include[], ...
                raise InvalidRequest(
                    f"query parameter {name}={show_value(values)} is not supported on "
                    "GET /v1/responses/{id}; the stored response is returned whole, unstreamed",
                    param=name,
                )
        entry = self.store.get(http.path[len(PREFIX) :], self.owners.owner_of(http))
        if entry is None:
            raise _not_found(http.path[len(PREFIX) :])
        await response.send(200, entry.body)

    async def delete(self, http: HttpRequest, response: HttpResponse) -> None:
        response_id = http.path[len(PREFIX) :]
        if not self.store.delete(response_id, self.owners.owner_of(http)):
            raise _not_found(response_id)
        body = {"id": response_id, "object": "response", "deleted": True}
        await response.send(200, _json.encode(body))

    async def create(self, http: HttpRequest, response: HttpResponse) -> None:
        req = _decode(http.body)
        owner = self.owners.owner_of(http)
        history = self._history(req, owner)
        messages = [*history, *input_messages(req.input)]
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat = ChatCompletionRequest(
            model=req.model,
            messages=[*system, *messages],
            max_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stream=req.stream,
            user=req.user,
            cache_salt=req.cache_salt,
            response_format=response_format(req.text),  # structured outputs, as chat's
        )
        model = self.registry.get(req.model)
        model.require_task("generate", "/v1/responses")
        count_as(model.name, stream=req.stream)

        def save(b: ResponseBuilder) -> None:
            """Store the finished response before the client can see it end, so a follow-up
            naming it never races the store."""
            if req.store:
                turn = {"role": "assistant", "content": b.text}
                self.store.put(b.id, b.body(), [*messages, turn], owner)

        pipeline = self.pipeline
        with pipeline.admission.slots(pipeline.admission.fan_out(chat)):
            builder = ResponseBuilder(req, model.name, new_response_id())
            with request_context(http, builder.id, model.name):
                await model.ready()
                with step_span("preprocess"):
                    prepared = await _as_input_errors(
                        pipeline.preprocess(http, chat, model, builder.id),
                        len(system),
                        len(history),
                    )
                state = choice_state(prepared)
                output = ResponsesOutput(prepared, state, builder, save)
                await pipeline.run(response, prepared, [state], output, stream=req.stream)

    def _history(self, req: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
        """The stored conversation `previous_response_id` names ([] without one), if `owner`'s."""
        if req.previous_response_id is None:
            return []
        entry = self.store.get(req.previous_response_id, owner)
        if entry is None:
            err = InvalidRequest(
                f"Previous response with id '{req.previous_response_id}' not found "
                "(never stored, stored by another API key or tenant, stored with store=false, "
                "deleted, expired or evicted from this frontend's bounded store); resend the "
                "conversation in input"
                + (
                    "; this frontend is one of several processes on its port "
                    "(tandem serve --frontend-processes N) and each keeps its own store: run "
                    "--frontend-processes 1 to use previous_response_id"
                    if self.shared_port
                    else ""
                ),
                param="previous_response_id",
            )
            err.code = "previous_response_not_found"  # type: ignore[attr-defined]
            raise err
        return list(entry.messages)


class ResponsesOutput:
    """A Response object, or its events (`Output` of the generate pipeline); `save(b)` runs
    once the response is complete, before its end is sent. A model's reasoning (its reasoning
    parser) becomes a reasoning item before the message."""

    __slots__ = ("_b", "_parser", "_prepared", "_save", "_state")
    keep_text = True

    def __init__(
        self,
        prepared: Prepared,
        state: ChoiceState,
        b: ResponseBuilder,
        save: Callable[[ResponseBuilder], None],
    ) -> None:
        self._prepared, self._state, self._b, self._save = prepared, state, b, save
        self._parser: OutputParser | None = None
        if prepared.reasoning_parser is not None:
            self._parser = OutputParser.make(
                None, prepared.reasoning_parser, prompt_opens_think=prepared.prompt_opens_think
            )
            b.defer_message = True

    def head(self) -> bytes:
        return self._b.start_events()

    def chunks(self, batch: list[Event]) -> bytes:
        b = self._b
        if self._parser is None:
            return b"".join([b.delta_event(event[1]) for event in batch if event[1]])
        return b"".join([self._parsed(event[1], final=False) for event in batch if event[1]])

    def _parsed(self, text: str, *, final: bool) -> bytes:
        assert self._parser is not None
        reasoning, content, _ = self._parser.feed(text, final=final)
        b = self._b
        out = b.reasoning_event(reasoning) if reasoning else b""
        return (out + b.delta_event(content)) if content else out

    def tail(self) -> bytes:
        b = self._b
        flushed = self._parsed("", final=True) if self._parser is not None else b""
        b.finish(self._state.finish_reason, _usage(self._prepared, self._state))
        self._save(b)
        return flushed + b.end_events()

    def failed(self, exc: ServingError) -> bytes:
        """OpenAI's error event, then response.failed."""
        return self._b.error_events(exc.error_type, exc.message, exc.param)

    def body(self) -> bytes:
        b, state = self._b, self._state
        b.text = "".join(state.text_parts)
        if self._parser is not None:
            reasoning, content, _ = self._parser.parse(b.text)
            b.reasoning, b.text = reasoning, content or ""
        b.finish(state.finish_reason, _usage(self._prepared, state))
        self._save(b)
        return b.body()


def _decode(body: bytes) -> ResponsesRequest:
    try:
        raw = msgspec.json.decode(body)
        req = _decoder.decode(body)
    except http_errors.BODY_ERRORS as exc:
        raise http_errors.decode_error(exc, body) from exc
    if isinstance(raw, dict):
        unsupported_fields(raw)
    validate_responses(req)
    return req


async def _as_input_errors(
    preprocessing: Awaitable[Prepared], num_system: int, num_history: int
) -> Prepared:
    """Preprocessing names chat's fields; a client of /v1/responses sent `instructions`, the
    conversation of `previous_response_id`, `input`, `max_output_tokens` and `text.format`
    (chat's messages[k] is one of the first three, by position)."""
    try:
        return await preprocessing
    except InvalidRequest as exc:

        def rename(text: str) -> str:
            def message(m: re.Match[str]) -> str:
                k = int(m.group(1))
                if k < num_system:
                    return "instructions"
                if k < num_system + num_history:
                    return "previous_response_id"
                return f"input[{k - num_system - num_history}]"

            text = re.sub(r"messages\[(\d+)\]", message, text)
            for chat, responses in _CHAT_NAMES:
                text = text.replace(chat, responses)
            return text

        exc.param = rename(exc.param) if exc.param else exc.param
        exc.message = rename(exc.message)
        exc.args = (exc.message,)
        raise


_CHAT_NAMES = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def _not_found(response_id: str) -> ServingError:
    err = InvalidRequest(f"Response with id '{response_id}' not found", param="response_id")
    err.status_code = 404
    return err


def _usage(prepared: Prepared, state: ChoiceState) -> dict[str, Any]:
    num_in, num_out = sum(prepared.prompt_lens), state.num_tokens
    return {
        "input_tokens": num_in,
        # cache_write_tokens counts OpenAI's explicit prompt-cache writes; tandem has none
        "input_tokens_details": {
            "cached_tokens": state.num_cached_tokens or 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": num_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_in + num_out,
    }
