"""The Qwen3-Coder XML tool-call format:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is converted by the type the tool's JSON schema gives that
parameter (integer, number, boolean, null, object/array as JSON or a Python literal; a string
or an unknown parameter stays text; a value that does not convert stays text too). One
newline after `<parameter=...>` and before `</parameter>` is markup, not value. Streamed: the
head once `<function=name>` is complete, then `{`, one `"name": value` piece per closed
parameter (a text parameter's value as it is written), and `}` at `</function>`.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from tandem.frontend.pipeline.parsers.base import partial_suffix
from tandem.frontend.pipeline.parsers.json_call import skip_blank
from tandem.frontend.pipeline.parsers.region import PartialCall, RegionToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]{1,64})>")
_PARAMETER = re.compile(r"<parameter=([^>\n]{1,128})>")
_END_PARAMETER, _END_FUNCTION = "</parameter>", "</function>"


class Qwen3CoderToolParser(RegionToolParser):
    markers: ClassVar[tuple[str, ...]] = (OPEN,)

    def __init__(self, *, max_calls: int | None = None, tools: Sequence[Any] = ()) -> None:
        super().__init__(max_calls=max_calls, tools=tools)
        # parameter name -> its JSON schema type, per tool name
        self._types = {t.name: _param_types(t.parameters) for t in tools}
        self._progress: dict[int, tuple[list[str], int]] = {}  # by the call's offset
        self._escaped: dict[int, tuple[int, str]] = {}  # an open value's JSON so far

    def forget_region(self) -> None:
        super().forget_region()
        self._progress.clear()
        self._escaped.clear()

    def scan(self, region: str, *, final: bool) -> list[PartialCall] | None:
        calls: list[PartialCall] = []
        pos = 0
        while True:
            pos = skip_blank(region, pos)
            if pos == len(region) or (OPEN.startswith(region[pos:]) and not final):
                return calls
            if not region.startswith(OPEN, pos):
                return None  # text after the calls
            pos = skip_blank(region, pos + len(OPEN))
            read = self._call(region, pos)
            if read is None:
                return None
            call, end = read
            if call is not None:
                calls.append(call)
            if end == -1:
                return calls
            pos = end

    def _call(self, region: str, pos: int) -> tuple[PartialCall | None, int] | None:
        """The call at `pos` (after `<tool_call>`) and where its block ends (-1: not yet)."""
        head = _FUNCTION.match(region, pos)
        if head is None:
            rest = region[pos:]
            maybe = "<function=".startswith(rest) or (
                rest.startswith("<function=") and ">" not in rest and "\n" not in rest
            )
            return (None, -1) if maybe else None
        name, types = head.group(1).strip(), self._types.get(head.group(1).strip(), {})
        # the closed parameters are read once: where they end and their JSON pieces
        pieces, pos = self._progress.get(head.end(), ([], head.end()))
        pieces = list(pieces)
        while True:
            pos = skip_blank(region, pos)
            param = _PARAMETER.match(region, pos)
            close = region.find(_END_PARAMETER, param.end()) if param is not None else -1
            if param is None or close == -1:
                break
            key = param.group(1).strip()
            value = _convert(_strip_newline(region[param.end() : close]), types.get(key))
            sep = "{" if not pieces else ", "
            pieces.append(sep + json.dumps(key, ensure_ascii=False) + ": " + value)
            pos = close + len(_END_PARAMETER)
            self._progress[head.end()] = (list(pieces), pos)
        if region.startswith(_END_FUNCTION, pos):
            end = skip_blank(region, pos + len(_END_FUNCTION))
            if not region.startswith(CLOSE, end):
                if CLOSE.startswith(region[end:]):
                    return PartialCall(name, "".join(pieces) or "{", done=False), -1
                return None
            args = "".join(pieces) + "}" if pieces else "{}"
            return PartialCall(name, args, done=True), end + len(CLOSE)
        if not _may_continue(region[pos:]):
            return None
        if param is not None and types.get(param.group(1).strip()) in (None, "string"):
            # a text value streams as it is written (its JSON string, still unclosed)
            key, value = param.group(1).strip(), _open_value(region[param.end() :])
            sep = "{" if not pieces else ", "
            text = self._escaped_prefix(param.end(), value)
            pieces = [*pieces, sep + json.dumps(key, ensure_ascii=False) + ": " + text]
        return PartialCall(name, "".join(pieces), done=False), -1

    def _escaped_prefix(self, at: int, value: str) -> str:
        """`json.dumps(value)` without its closing quote, escaping only what is new since
        the last look at the value at `at` (it only grows; JSON escapes per character)."""
        done, text = self._escaped.get(at, (0, '"'))
        text += json.dumps(value[done:], ensure_ascii=False)[1:-1]
        self._escaped[at] = (len(value), text)
        return text


def _may_continue(rest: str) -> bool:
    """Whether the text after a call's last parameter may still become more of the call."""
    if "<parameter=".startswith(rest) or _END_FUNCTION.startswith(rest):
        return True
    return rest.startswith("<parameter=") and "</parameter>" not in rest


def _open_value(raw: str) -> str:
    """The part of a parameter's value so far that is value whatever follows: not a start of
    `</parameter>`, nor a last newline that may be the markup's."""
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[: len(raw) - partial_suffix(raw, _END_PARAMETER)]
    return raw[:-1] if raw.endswith("\n") else raw


def _strip_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _param_types(schema: Any) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return {}
    return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}


def _convert(value: str, kind: Any) -> str:
    """`value` as JSON text of the schema type `kind` (a type name or a list of them)."""
    kinds = kind if isinstance(kind, list) else [kind]
    text = value.strip()
    for k in kinds:
        converted = _as_type(text, k)
        if converted is not None:
            return converted
    return json.dumps(value, ensure_ascii=False)


def _as_type(text: str, kind: Any) -> str | None:
    if kind == "null" and text.lower() in ("null", "none"):
        return "null"
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower()
    if kind in ("integer", "number"):
        if re.fullmatch(r"[+-]?\d{1,300}", text):
            return str(int(text))
        try:
            number = float(text) if kind == "number" else math.nan
        except ValueError:
            return None
        return json.dumps(number) if math.isfinite(number) else None
    if kind in ("object", "array"):
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):
            try:
                parsed = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return None
        wanted = dict if kind == "object" else list
        return json.dumps(parsed, ensure_ascii=False) if isinstance(parsed, wanted) else None
    return None
