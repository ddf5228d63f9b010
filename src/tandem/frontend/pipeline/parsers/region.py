"""`RegionToolParser`: the base of the formats whose calls fill the rest of the output once
a start marker appears (Llama 3 JSON, Mistral, Qwen3-Coder XML, pythonic).

A format says where its call region opens (`markers` anywhere in the text, `leading` only as
the output's first non-blank text) and how to read a region (`scan`). Streaming re-reads the
region as it grows and sends what is new: a call's head once its name is known, then each
piece its arguments grew by. `scan` must be prefix-stable (the arguments it reads for a call
only grow as the region does), so that a text streamed in any pieces yields what `parse` of
the whole text does. A region that turns out not to be calls is content after all, marker
and all; one cut before its first call was announced too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from tandem.frontend.pipeline.parsers.base import (
    ToolCall,
    args_delta,
    head_delta,
    new_call_id,
    partial_suffix,
)
from tandem.frontend.pipeline.parsers.brackets import BracketScanner


@dataclass(slots=True)
class PartialCall:
    """A call as far as the region shows it."""

    name: str
    arguments: str  # JSON text so far; grows only (the whole object once `done`)
    done: bool


class RegionToolParser:
    """One per choice; `feed` and `parse` are alternatives, not to be mixed on one
    instance. Subclasses set `markers`/`leading` and implement `scan`."""

    markers: ClassVar[tuple[str, ...]] = ()
    leading: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, max_calls: int | None = None, tools: Sequence[Any] = ()) -> None:
        self.max_calls = max_calls  # parallel_tool_calls=false: 1
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet emitted (a possible marker prefix)
        self._region: str | None = None  # the call region so far, from its marker on
        self._at_start = True  # nothing but blanks emitted: a `leading` marker may still come
        self._sent: list[int] = []  # argument characters sent, per call
        self.is_malformed = False  # final: the region was not (all) well-formed calls
        self._scanners: dict[int, BracketScanner] = {}  # by the region offset they start at
        self._json: dict[int, tuple[Any, int]] = {}  # closed JSON values, by offset

    def scan(self, region: str, *, final: bool) -> list[PartialCall] | None:
        """The calls `region` (which starts with its marker) holds so far; None when it
        cannot be calls. With `final`, every call it returns must be `done`, or None."""
        raise NotImplementedError

    def new_id(self) -> str:
        return new_call_id()

    def forget_region(self) -> None:
        """Drop what was read of a region that turned out to be text (its offsets would
        mislead the reading of a region opened later); subclasses with caches extend it."""
        self._scanners.clear()
        self._json.clear()

    def bracket_end(self, region: str, start: int, *, python: bool = False) -> int:
        """Index after the bracket at `region[start]` closes (-1: not yet), resumed where the
        last look at the same bracket stopped (the region only grows)."""
        scanner = self._scanners.get(start)
        if scanner is None:
            scanner = self._scanners[start] = BracketScanner(start, python=python)
        return scanner.scan(region)

    def json_at(self, region: str, start: int) -> tuple[Any, int]:
        """(the JSON object or array at `region[start]`, the index after it), (None, -1)
        while it is open; ValueError once it closed and is not JSON. Decoded once."""
        done = self._json.get(start)
        if done is not None:
            return done
        end = self.bracket_end(region, start)
        if end == -1:
            return None, -1
        try:
            value = json.loads(region[start:end])
        except RecursionError as exc:  # nested deeper than Python's stack: not a call either
            raise ValueError("JSON nested too deep") from exc
        self._json[start] = (value, end)
        return value, end

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, _ = self.feed(text, final=True)
        if self.is_malformed:
            self.calls = []
            return text, []
        if not self.calls:
            return content, []
        return content.strip() or None, self.calls

    def feed(self, text: str, *, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        content = ""
        if self._region is None:
            self._buf += text
            content, start = self._find_region(final)
            if start is None:
                return content, []
            self._region, self._buf = self._buf[start:], ""
        else:
            self._region += text
        flushed, deltas = self._read_region(final)
        text_out = content + flushed
        if self.calls and not text_out.strip():
            text_out = ""  # blanks around calls are not content
        return text_out, deltas

    def _find_region(self, final: bool) -> tuple[str, int | None]:
        """(content to emit, where the region starts in the buffer or None)."""
        buf = self._buf
        if self._at_start and self.leading:
            blank = len(buf) - len(buf.lstrip())
            rest = buf[blank:]
            if any(rest.startswith(m) for m in self.leading):
                return buf[:blank], blank
            if not final and (not rest or any(m.startswith(rest) for m in self.leading)):
                return "", None  # undecided: hold
            self._at_start = not rest
        found = [i for m in self.markers if (i := buf.find(m)) != -1]
        if found:
            start = min(found)
            self._at_start = False
            return buf[:start], start
        keep = 0 if final else max((partial_suffix(buf, m) for m in self.markers), default=0)
        self._buf = buf[len(buf) - keep :]
        if buf[: len(buf) - keep].strip():
            self._at_start = False
        return buf[: len(buf) - keep], None

    def _read_region(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        assert self._region is not None
        found = self.scan(self._region, final=final)
        if found is not None and final and not (found and all(c.done for c in found)):
            found = None  # ended inside a call, or a marker with no call after it
        if found is None:
            if final:
                self.is_malformed = True
            if not self.calls:  # not calls after all: the region is text
                region, self._region = self._region, None
                self.forget_region()
                if final:
                    return region, []
                self._buf, self._at_start = "", False
                return region, []
            return "", []  # a call was announced: it stays one
        return "", self._deltas(found)

    def _deltas(self, found: list[PartialCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, partial in enumerate(found):
            if i == len(self.calls):
                if self.max_calls is not None and i >= self.max_calls:
                    break
                self.calls.append(ToolCall(partial.name, "", id=self.new_id()))
                self._sent.append(0)
                out.append(head_delta(i, self.calls[i]))
            piece = partial.arguments[self._sent[i] :]
            if piece:
                self._sent[i] = len(partial.arguments)
                self.calls[i].arguments += piece
                out.append(args_delta(i, piece))
        return out
