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
from collections.abc import Sequence
from typing import Any, ClassVar

from tandem.frontend.pipeline.parsers.json_call import skip_blank
from tandem.frontend.pipeline.parsers.region import PartialCall, RegionToolParser

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.]{0,63})\s*\(")
MAX_REGION_CHARS = 1 << 20  # ast on more than this is not worth its memory


class PythonicToolParser(RegionToolParser):
    markers: ClassVar[tuple[str, ...]] = (START,)
    leading: ClassVar[tuple[str, ...]] = ("[", START)

    def __init__(self, *, max_calls: int | None = None, tools: Sequence[Any] = ()) -> None:
        super().__init__(max_calls=max_calls, tools=tools)
        self._closed: dict[int, PartialCall | None] = {}  # closed calls, by offset

    def forget_region(self) -> None:
        super().forget_region()
        self._closed.clear()

    def scan(self, region: str, *, final: bool) -> list[PartialCall] | None:
        start = skip_blank(region, len(START) if region.startswith(START) else 0)
        if len(region) > MAX_REGION_CHARS:
            return None
        if start == len(region):
            return None if final else []
        if region[start] != "[":
            return None
        end = self.bracket_end(region, start, python=True)
        if end != -1:  # the list closed: only its end marker may follow
            rest = region[end:].strip()
            if rest and rest != END and (final or not END.startswith(rest)):
                return None
            return _whole(region[start:end])
        return None if final else self._partial(region, start + 1)

    def _partial(self, region: str, pos: int) -> list[PartialCall] | None:
        """The calls of a list still being written: the closed ones whole, the open one by
        name (None when what is written cannot become a list of calls)."""
        calls: list[PartialCall] = []
        while True:
            pos = _skip(region, pos, ", \t\n" if calls else " \t\n")
            if pos == len(region):
                return calls
            head = _NAME.match(region, pos)
            if head is None:
                rest = region[pos:]
                return calls if re.fullmatch(r"\s*[A-Za-z_][A-Za-z0-9_.]*\s*", rest) else None
            end = self.bracket_end(region, head.end() - 1, python=True)
            if end == -1:
                return [*calls, PartialCall(head.group(1), "", done=False)]
            if pos not in self._closed:
                one = _whole("[" + region[pos:end] + "]")
                self._closed[pos] = one[0] if one is not None and len(one) == 1 else None
            call = self._closed[pos]
            if call is None:
                return None
            calls.append(call)
            pos = end


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


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos
