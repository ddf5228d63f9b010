"""`BracketScanner`: where a bracket closes in a text that only grows, resumed where the last
look stopped, so a streamed call costs time in proportion to its length, not its square."""

from __future__ import annotations

import re

_JSON_OUTSIDE = re.compile(r'["()\[\]{}]')
_PY_OUTSIDE = re.compile(r"[\"'()\[\]{}]")
_IN_STRING = {'"': re.compile(r'[\\"]'), "'": re.compile(r"[\\']")}
_OPEN, _CLOSE = "([{", ")]}"


class BracketScanner:
    """Tracks brackets and string literals from the bracket at `start` on: JSON strings
    (`"`, backslash escapes) or, with `python`, Python's (`'`, `"`, triple quotes)."""

    __slots__ = ("_inside", "_pos", "_python", "depth", "end")

    def __init__(self, start: int, *, python: bool = False) -> None:
        self._pos, self.depth, self._python = start + 1, 1, python
        self._inside = ""  # the open string literal's quote ("" outside strings)
        self.end = -1  # index after the closing bracket, once seen

    def scan(self, text: str) -> int:
        """Index after the closing bracket in `text` (which extends the last text), or -1."""
        if self.end != -1:
            return self.end
        pos, n = self._pos, len(text)
        while pos < n:
            if self._inside:
                quote = self._inside
                found = _IN_STRING[quote[0]].search(text, pos)
                if found is None:
                    pos = n
                    break
                stop = found.start()
                if text[stop] == "\\":
                    if stop + 1 >= n:
                        pos = stop  # the escaped character has not come yet
                        break
                    pos = stop + 2
                    continue
                if len(quote) == 3 and not text.startswith(quote, stop):
                    if n - stop < 3 and quote.startswith(text[stop:]):
                        pos = stop  # maybe the closing triple quote, not all here
                        break
                    pos = stop + 1
                    continue
                pos, self._inside = stop + len(quote), ""
                continue
            match = (_PY_OUTSIDE if self._python else _JSON_OUTSIDE).search(text, pos)
            if match is None:
                pos = n
                break
            pos, ch = match.start(), match.group()
            if ch in "\"'":
                if self._python and n - pos < 3 and text[pos:] == ch * (n - pos):
                    break  # a triple quote may be starting
                triple = self._python and text.startswith(ch * 3, pos)
                self._inside = ch * 3 if triple else ch
                pos += len(self._inside)
            elif ch in _OPEN:
                self.depth += 1
                pos += 1
            else:
                self.depth -= 1
                pos += 1
                if self.depth == 0:
                    self.end = pos
                    return pos
        self._pos = pos
        return -1
