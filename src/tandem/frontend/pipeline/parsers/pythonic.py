"""The pythonic tool-call format (Llama 3.2 / Llama 4 and others prompted for it): the output
is a Python list of calls with keyword arguments,

    [get_weather(city="Paris", days=2), get_time()]

optionally between Llama 4's `<|python_start|>` and `<|python_end|>`. Read with `ast`
(never evaluated): each value must be a literal (string, number, bool, None, list, dict,
tuple); `True`/`None` become JSON's `true`/`null`. Streamed: a call's head once `name(` is
written, its arguments when its `)` closes it.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, ClassVar

from tandem.frontend.pipeline.parsers.region import PartialCall, RegionToolParser

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.]{0,63})\s*\(")
MAX_REGION_CHARS = 1 << 20  # ast on more than this is not worth its memory


class PythonicToolParser(RegionToolParser):
    markers: ClassVar[tuple[str, ...]] = (START,)
    leading: ClassVar[tuple[str, ...]] = ("[", START)

    def scan(self, region: str, *, final: bool) -> list[PartialCall] | None:
        body = region[len(START) :] if region.startswith(START) else region
        if body.rstrip().endswith(END):
            body = body.rstrip()[: -len(END)]
        body = body.strip()
        if len(body) > MAX_REGION_CHARS:
            return None
        if not body:
            return None if final else []
        if body[0] != "[":
            return None
        calls = _whole(body)
        if calls is not None:
            return calls
        return None if final else _partial(body)


def _whole(body: str) -> list[PartialCall] | None:
    """The calls of a complete list; None when it is not one (yet)."""
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = [_call(node) for node in tree.body.elts]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _call(node: ast.expr) -> PartialCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:  # **kwargs
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # a set, bytes, complex, nan: no JSON for it
        return None
    return PartialCall(name, text, done=True)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _partial(body: str) -> list[PartialCall] | None:
    """The calls of a list still being written: the closed ones whole, the open one by name
    (None when what is written cannot become a list of calls)."""
    calls: list[PartialCall] = []
    pos = 1  # after "["
    while True:
        pos = _skip(body, pos, ", \t\n" if calls else " \t\n")
        if pos == len(body):
            return calls
        if body[pos] == "]" and calls:  # the list closed: only its end marker may follow
            return calls if END.startswith(body[pos + 1 :].strip()) else None
        head = _NAME.match(body, pos)
        if head is None:
            rest = body[pos:]
            return calls if re.fullmatch(r"\s*[A-Za-z_][A-Za-z0-9_.]*\s*", rest) else None
        end = _call_end(body, head.end())
        if end == -1:
            return [*calls, PartialCall(head.group(1), "", done=False)]
        one = _whole("[" + body[pos:end] + "]")
        if one is None:
            return None
        calls.extend(one)
        pos = end


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _call_end(text: str, pos: int) -> int:
    """Index after the `)` closing a call whose `(` ends before `pos`; -1 if not written yet.
    Tracks brackets and string literals (quotes and backslash escapes)."""
    depth, quote = 1, ""
    while pos < len(text):
        ch = text[pos]
        if quote:
            if ch == "\\":
                pos += 1
            elif text.startswith(quote, pos):
                pos += len(quote) - 1
                quote = ""
        elif ch in "\"'":
            quote = ch * 3 if text.startswith(ch * 3, pos) else ch
            pos += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    return -1
