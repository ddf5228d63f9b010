"""A tool call written as a JSON object, `{"name": ..., "arguments" | "parameters": {...}}`,
read from a growing text (the Llama 3 JSON and the older Mistral formats).

While the object is incomplete, its arguments are the text after `"arguments":` as the model
writes it (once that value opens with `{`); complete, they are that value's exact text, so
what was streamed is a prefix of the final arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from tandem.frontend.pipeline.parsers.region import PartialCall

_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_BLANK = re.compile(r"\s*")
JsonAt = Callable[[int], tuple[Any, int]]  # RegionToolParser.json_at on the text


class NotACall(ValueError):
    """The text holds a complete JSON value that is not a tool call."""


def skip_blank(text: str, pos: int) -> int:
    match = _BLANK.match(text, pos)
    assert match is not None  # \s* always matches
    return match.end()


def read_json_call(text: str, pos: int, json_at: JsonAt) -> tuple[PartialCall | None, int]:
    """The call whose object starts at `text[pos]` (a `{`) and where it ends (-1: not yet).
    None for the call: its name is not known yet. Raises NotACall for a complete object that
    is not a call. `json_at(i)`: the JSON value at `text[i]` and its end ((None, -1): open)."""
    obj, end = _decoded(pos, json_at)
    head = _HEAD.match(text, pos)
    if head is None:
        if end == -1:
            return None, -1
        return _whole_call(obj), end
    name = json.loads(head.group(1))
    args_at = head.end()
    value, args_end = None, -1
    if text.startswith("{", args_at):
        value, args_end = _decoded(args_at, json_at)
    if end == -1:
        if args_end == -1 and not text.startswith("{", args_at):
            return PartialCall(name, "", done=False), -1
        raw = text[args_at:] if args_end == -1 else text[args_at:args_end]
        return PartialCall(name, raw if raw.startswith("{") else "", done=False), -1
    call = _whole_call(obj)
    if isinstance(value, dict):  # the exact text, so that the streamed prefix stays one
        return PartialCall(call.name, text[args_at:args_end], done=True), end
    return call, end


def _decoded(pos: int, json_at: JsonAt) -> tuple[Any, int]:
    try:
        return json_at(pos)
    except ValueError as exc:
        raise NotACall("not JSON") from exc


def _whole_call(obj: Any) -> PartialCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise NotACall("not a tool call object")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments JSON-encoded once more
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as exc:
            raise NotACall("arguments are not JSON") from exc
    if not isinstance(args, dict):
        raise NotACall("arguments are not an object")
    return PartialCall(obj["name"], json.dumps(args, ensure_ascii=False), done=True)


def read_json_calls(
    text: str, pos: int, separators: str, closer: str | None, json_at: JsonAt
) -> tuple[list[PartialCall], int] | None:
    """Call objects from `pos` on, between `separators` and blanks, up to `closer` (`]`) if
    given; (calls, where reading stopped: -1 when the text may still go on) or None when
    what is there is not calls. A text that ends inside an object ends in a partial call."""
    calls: list[PartialCall] = []
    while True:
        pos = skip_blank(text, pos)
        while pos < len(text) and text[pos] in separators and calls:
            pos = skip_blank(text, pos + 1)
        if pos == len(text):
            return calls, -1
        if closer is not None and text[pos] == closer and calls:
            return calls, pos + 1
        if text[pos] != "{":
            return (calls, pos) if calls else None
        try:
            call, end = read_json_call(text, pos, json_at)
        except NotACall:
            return None
        if end == -1:
            return [*calls, call] if call is not None else calls, -1
        assert call is not None
        calls.append(call)
        pos = end
