"""The tool prompt for a chat template that does not take `tools`: a system block listing
the tools as JSON and showing the call markup of the model's tool-call format (the format
its parser reads, `parsers/registry.py`), and earlier calls written back in that markup so a
conversation round-trips. A template that takes `tools` renders all of this itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

SYSTEM = (
    "You can call functions. Their signatures are listed as JSON inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, {how}"
)

# per format: how the system block asks for calls
_HOW = {
    "hermes": "answer with one JSON object per call inside <tool_call></tool_call> tags, "
    'exactly like this:\n<tool_call>\n{"name": "<function name>", "arguments": '
    "<arguments as a JSON object>}\n</tool_call>",
    "llama3_json": "answer with only a JSON object, exactly like this:\n"
    '{"name": "<function name>", "parameters": <arguments as a JSON object>}\n'
    'Separate several calls with "; ".',
    "mistral": "answer with [TOOL_CALLS] and a JSON list of the calls, exactly like this:\n"
    '[TOOL_CALLS][{"name": "<function name>", "arguments": <arguments as a JSON object>}]',
    "pythonic": "answer with only a Python list of calls with keyword arguments, exactly like "
    "this:\n[<function name>(<argument>=<value>, ...), ...]",
    "qwen3_coder": "answer with one block per call, exactly like this:\n<tool_call>\n"
    "<function=<function name>>\n<parameter=<argument name>>\n<value>\n</parameter>\n"
    "</function>\n</tool_call>",
}


def system_block(tools: list[dict[str, Any]], parser: str) -> str:
    """The system prompt text offering `tools` (OpenAI tool objects) in format `parser`."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return SYSTEM.format(tools=listing, how=_HOW[parser])


def calls_text(calls: list[dict[str, Any]], parser: str) -> str:
    """Earlier calls (each {"name", "arguments": dict}) in format `parser`'s markup."""
    return _WRITERS[parser](calls)


def _hermes(calls: list[dict[str, Any]]) -> str:
    return "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in calls
    )


def _llama3_json(calls: list[dict[str, Any]]) -> str:
    return "; ".join(
        json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
        for c in calls
    )


def _mistral(calls: list[dict[str, Any]]) -> str:
    listed = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
    return "[TOOL_CALLS]" + json.dumps(listed, ensure_ascii=False)


def _pythonic(calls: list[dict[str, Any]]) -> str:
    def one(c: dict[str, Any]) -> str:
        args = ", ".join(f"{k}={_python(v)}" for k, v in c["arguments"].items())
        return f"{c['name']}({args})"

    return "[" + ", ".join(one(c) for c in calls) + "]"


def _python(value: Any) -> str:
    """A JSON value as a Python literal."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_python(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def _qwen3_coder(calls: list[dict[str, Any]]) -> str:
    def value(v: Any) -> str:
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

    return "\n".join(
        f"<tool_call>\n<function={c['name']}>\n"
        + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in c["arguments"].items())
        + "</function>\n</tool_call>"
        for c in calls
    )


_WRITERS: dict[str, Callable[[list[dict[str, Any]]], str]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
    "mistral": _mistral,
    "pythonic": _pythonic,
    "qwen3_coder": _qwen3_coder,
}
