"""SSE chunk bytes: the template of the common text chunk equals the general encoding."""

from __future__ import annotations

import json

import pytest

from tandem.frontend.api.completion_format import ResponseFormat

TEXTS = ["a", " hello", 'quote " and \\ backslash', "é日本🎉", "\n\t\x00\x1f", "\u2028\u2029"]


@pytest.mark.parametrize("chat", [True, False])
def test_text_chunk_template_writes_the_general_bytes(chat: bool) -> None:
    fmt = ResponseFormat(chat=chat)
    fmt.bind("cmpl-1", "m")
    for index in (0, 1, 12):
        for text in TEXTS:
            fast = fmt.chunk(index, text, None, None)
            assert fast == fmt._chunk(index, text, None, None, None, None)
            body = json.loads(fast.removeprefix(b"data: ").strip())
            [choice] = body["choices"]
            assert choice["index"] == index and choice["finish_reason"] is None
            assert (choice["delta"]["content"] if chat else choice["text"]) == text


@pytest.mark.parametrize("chat", [True, False])
def test_other_chunks_keep_their_fields(chat: bool) -> None:
    fmt = ResponseFormat(chat=chat)
    fmt.bind("cmpl-2", "m")
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    last = json.loads(fmt.chunk(0, "x", None, "stop").removeprefix(b"data: "))
    assert last["choices"][0]["finish_reason"] == "stop"
    running = json.loads(fmt.chunk(0, "x", None, None, usage).removeprefix(b"data: "))
    assert running["usage"] == usage
    if chat:
        calls = [{"index": 0, "id": "c", "type": "function", "function": {"name": "f"}}]
        chunk = json.loads(fmt.chunk(0, "x", None, None, None, calls).removeprefix(b"data: "))
        assert chunk["choices"][0]["delta"]["tool_calls"] == calls
    fmt.bind("cmpl-3", "m")  # a re-bound format forgets the old request's templates
    assert b'"cmpl-3"' in fmt.chunk(0, "x", None, None)
