"""JSON request bodies into their request Structs, with the OpenAI 400 that names what is
wrong (`errors.decode_error`) for a body that does not decode."""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.frontend import errors as http_errors
from tandem.frontend.pipeline.prompt_ids import U32TokenIds, split_prompt
from tandem.protocols.openai import CompletionIdsRequest, CompletionRequest

completion_decoder = msgspec.json.Decoder(CompletionRequest)
completion_ids_decoder = msgspec.json.Decoder(CompletionIdsRequest)


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
