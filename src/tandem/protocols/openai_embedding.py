"""The `/v1/embeddings` request (OpenAI's shape), and the checks on its inputs' form.

Value checks that need the model (vocabulary, context length, `dimensions`) are in
`tandem.frontend.api.embeddings`."""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.errors import InvalidRequest
from tandem.protocols.openai import show_value

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
MAX_TOTAL_TOKENS = 300_000  # OpenAI's limit on the tokens of one request, summed over inputs
ENCODING_FORMATS = ("float", "base64")


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """Every field OpenAI defines for `POST /v1/embeddings`; each has its effect."""

    model: str
    # str | list[str] | list[int] | list[list[int]]; checked by `embedding_inputs`
    input: str | list[Any]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted; tandem keeps no per-user state


def embedding_inputs(value: str | list[Any]) -> tuple[list[str | list[int]], list[str]]:
    """The inputs (each a string or a list of token ids) and each one's `param` name for
    errors. Raises InvalidRequest naming the field for an empty input, too many inputs or a
    malformed item."""
    if isinstance(value, str):
        _check_text(value, "input")
        return [value], ["input"]
    if not value:
        raise InvalidRequest("input is an empty list; expected at least one input", param="input")
    if all(_is_token_id(t) for t in value):
        return [list(value)], ["input"]
    if len(value) > MAX_INPUTS:
        raise InvalidRequest(
            f"input has {len(value)} items; at most {MAX_INPUTS} per request (split it)",
            param="input",
        )
    inputs: list[str | list[int]] = []
    texts = isinstance(value[0], str)  # OpenAI's schema: all strings or all token-id lists
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if texts and isinstance(item, str):
            _check_text(item, param)
            inputs.append(item)
        elif not texts and isinstance(item, list) and item and all(map(_is_token_id, item)):
            inputs.append(list(item))
        else:
            raise InvalidRequest(
                f"{param}={show_value(item)} is invalid; expected a non-empty string or a "
                "non-empty list of token ids (all items strings, or all lists of token ids)",
                param=param,
            )
    return inputs, [f"input[{i}]" for i in range(len(inputs))]


def validate_embedding(req: EmbeddingRequest) -> None:
    if not req.model:
        raise InvalidRequest("model='' is invalid; expected a non-empty model name", param="model")
    if req.encoding_format not in ENCODING_FORMATS:
        raise InvalidRequest(
            f"encoding_format={show_value(req.encoding_format)} is invalid; expected one of: "
            f"{', '.join(ENCODING_FORMATS)}",
            param="encoding_format",
        )
    if req.dimensions is not None and req.dimensions < 1:
        raise InvalidRequest(
            f"dimensions={req.dimensions} is invalid; expected an integer >= 1",
            param="dimensions",
        )


def _check_text(text: str, param: str) -> None:
    if not text:
        raise InvalidRequest(f"{param} is an empty string; expected text to embed", param=param)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
