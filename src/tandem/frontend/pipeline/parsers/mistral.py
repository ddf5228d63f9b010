"""The Mistral tool-call formats, after the `[TOOL_CALLS]` control token:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (pre-v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}     (v11+)
    [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}              (v13)

`[TOOL_CALLS]` is a special token: a request parsed with this format keeps special tokens
in its text (as vLLM does). Call ids are 9 letters or digits, which Mistral's templates
require when the calls come back in the history.
"""

from __future__ import annotations

import re
from typing import ClassVar

from tandem.frontend.pipeline.parsers.base import new_mistral_call_id, partial_suffix
from tandem.frontend.pipeline.parsers.json_call import read_json_calls, skip_blank
from tandem.frontend.pipeline.parsers.region import PartialCall, RegionToolParser

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})\s*(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")
_NAME_SO_FAR = re.compile(r"\s*[A-Za-z0-9_.\-]{0,64}\s*(?:\[CALL_ID\][A-Za-z0-9]*)?\Z")


class MistralToolParser(RegionToolParser):
    needs_special_tokens: ClassVar[bool] = True
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)

    def new_id(self) -> str:
        return new_mistral_call_id()

    def scan(self, region: str, *, final: bool) -> list[PartialCall] | None:
        pos = skip_blank(region, len(TOOL_CALLS))
        if pos == len(region):
            return None if final else []
        if region[pos] == "[":  # pre-v11: a JSON list of call objects
            read = read_json_calls(region, pos + 1, ",", "]", lambda i: self.json_at(region, i))
            if read is None:
                return None
            calls, stopped = read
            if stopped == -1:  # the list is not closed yet
                return None if final else calls
            return calls if stopped == len(region.rstrip()) else None
        return self._named_calls(region)

    def _named_calls(self, region: str) -> list[PartialCall] | None:
        """v11+: `[TOOL_CALLS]name[ARGS]{...}` repeated."""
        calls: list[PartialCall] = []
        pos = 0
        while pos < len(region):
            if not region.startswith(TOOL_CALLS, pos):
                rest = region[pos:]
                if rest.strip() and not TOOL_CALLS.startswith(rest.lstrip()):
                    return None  # text after a call
                return calls
            pos += len(TOOL_CALLS)
            head = _NAME.match(region, pos)
            if head is None:
                return calls if _name_so_far(region[pos:]) else None
            args_at = skip_blank(region, head.end())
            raw = region[args_at:]
            if raw and not raw.startswith("{"):
                return None
            try:
                value, end = self.json_at(region, args_at) if raw else (None, -1)
            except ValueError:
                return None
            if end == -1:
                return [*calls, PartialCall(head.group(1), raw, done=False)]
            if not isinstance(value, dict):
                return None
            calls.append(PartialCall(head.group(1), region[args_at:end], done=True))
            pos = skip_blank(region, end)
        return calls


def _name_so_far(text: str) -> bool:
    """Whether `text` may still become `name[CALL_ID]id[ARGS]`."""
    if ARGS in text:
        return False
    text = text[: len(text) - max(partial_suffix(text, ARGS), partial_suffix(text, CALL_ID))]
    return _NAME_SO_FAR.match(text) is not None
