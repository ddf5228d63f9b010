"""The Llama 3.1/3.2/3.3 JSON tool-call format: the output is one call object (or several,
separated by `;`), after `<|python_tag|>` or from its first character on:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}
    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

`parameters` or `arguments` (string-encoded JSON too). `<|python_tag|>` is a special token:
with special tokens skipped (the default) the output starts at the `{`. An output that starts
with JSON that is not a call (`{"answer": 42}`) is content, held back until complete.
"""

from __future__ import annotations

from typing import ClassVar

from tandem.frontend.pipeline.parsers.json_call import read_json_calls, skip_blank
from tandem.frontend.pipeline.parsers.region import PartialCall, RegionToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(RegionToolParser):
    markers: ClassVar[tuple[str, ...]] = (PYTHON_TAG,)
    leading: ClassVar[tuple[str, ...]] = ("{", PYTHON_TAG)

    def scan(self, region: str, *, final: bool) -> list[PartialCall] | None:
        pos = len(PYTHON_TAG) if region.startswith(PYTHON_TAG) else 0
        if skip_blank(region, pos) == len(region):
            return None if final else []
        read = read_json_calls(region, pos, ";", None, lambda i: self.json_at(region, i))
        if read is None:
            return None
        calls, stopped = read
        if stopped != -1:  # text after the calls: not this format
            return None
        return calls
