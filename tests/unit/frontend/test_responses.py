"""Errors the chat path raises are renamed to what a /v1/responses client sent."""

from __future__ import annotations

import pytest

from tandem.errors import InvalidRequest
from tandem.frontend.api.responses.endpoint import _as_input_errors


async def _raise(param: str, message: str) -> None:
    raise InvalidRequest(message, param=param)


@pytest.mark.parametrize(
    ("param", "expected"),
    [
        ("messages[0].content", "instructions.content"),
        ("messages[2].content", "previous_response_id.content"),
        ("messages[3].content[1]", "input[0].content[1]"),
        ("messages", "input"),
        ("max_tokens", "max_output_tokens"),
        ("response_format.json_schema.schema", "text.format.schema"),
    ],
)
async def test_chat_names_become_responses_names(param: str, expected: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        await _as_input_errors(_raise(param, f"{param} is bad"), 1, 2)
    assert err.value.param == expected
    assert err.value.message == f"{expected} is bad"
