"""What an endpoint reads of an HTTP request: its JSON body into the request Struct, with the
OpenAI 400 that names what is wrong (`errors.decode_error`) for a body that does not decode,
and its request id (the X-Request-ID header, validated, or one generated)."""

from __future__ import annotations

import itertools
import os
import re
from typing import Any

import msgspec

from tandem.errors import InvalidRequest
from tandem.frontend import errors as http_errors
from tandem.frontend.pipeline.prompt_ids import U32TokenIds, split_prompt
from tandem.protocols.openai import CompletionIdsRequest, CompletionRequest, show_value

completion_decoder = msgspec.json.Decoder(CompletionRequest)
completion_ids_decoder = msgspec.json.Decoder(CompletionIdsRequest)

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except http_errors.BODY_ERRORS as exc:
        raise http_errors.decode_error(exc, body) from exc


def decode_completion(body: bytes) -> CompletionRequest:
    """A /v1/completions body; a prompt that is one list of token ids comes back as a
    CompletionIdsRequest: parsed straight into u32s (its prompt a `U32TokenIds`) when it is a
    flat array of plain integers, else checked while msgspec parses it (no Python pass over
    the ids either way). An array of such arrays comes back with a list of `U32TokenIds`.
    Raises InvalidRequest exactly as decoding a plain CompletionRequest does."""
    if (split := split_prompt(body)) is not None:
        rest, prompt = split
        decoder = completion_ids_decoder if isinstance(prompt, U32TokenIds) else completion_decoder
        try:
            parsed = decoder.decode(rest)  # every field but the prompt
        except http_errors.BODY_ERRORS:
            pass  # the decodes below say what is wrong, about the body as sent
        else:
            parsed.prompt = prompt  # type: ignore[assignment]  # read as the list(s) of ids
            return parsed
    try:
        return completion_ids_decoder.decode(body)
    except http_errors.BODY_ERRORS:  # text, a batch, or a bad body: the general decode
        req: CompletionRequest = decode_body(completion_decoder, body)  # says what is wrong
        return req


class _IdSource:
    """32 hex digits: a random prefix per process (drawn again in a forked child) and a
    counter. uuid4 reads os.urandom per id, a syscall per request on the hot path."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count(1)

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):016x}"


new_request_id = _IdSource()


def client_request_id(headers: dict[str, str]) -> str | None:
    """The client's X-Request-ID, or None; raises InvalidRequest for one that is too long or
    not printable ASCII (it lands in logs, ids and a response header)."""
    value = headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    if len(value) > MAX_REQUEST_ID_CHARS or not _REQUEST_ID.fullmatch(value):
        raise InvalidRequest(
            f"X-Request-ID={show_value(value)} is invalid; expected 1 to "
            f"{MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces",
            param="X-Request-ID",
        )
    return value
