"""Tool calling for chat requests: `tools`, `tool_choice`, `parallel_tool_calls`, assistant
`tool_calls` and `role: "tool"` messages.

- Offered: a chat template that takes `tools` (it names the variable) gets them as they are;
  any other template (SmolLM2's) gets a tool prompt in the model's tool-call format
  (`tool_prompt.py`; Hermes unless the model has another parser): a system block listing the
  tools as JSON and showing that format's call markup; assistant `tool_calls` are written
  back in that markup and tool results as `<tool_response>` user turns, so a conversation
  round-trips.
- tool_choice "none": tools are not offered (plain text). "auto" (the default with tools):
  the model decides; its calls are parsed by the model's parser
  (tandem.frontend.pipeline.parsers). "required" or a named function: constrained decoding
  forces the Hermes markup (whatever the model's format; such calls are parsed as Hermes)
  around a JSON object whose `name` is one of the tools (the named one) and whose
  `arguments` match its parameters schema, objects closed to the properties it names (as
  strict mode would).
- parallel_tool_calls false: at most one call (the forcing grammar allows one; the parser
  keeps the first).
- Legacy `functions` / `function_call` are refused with a 400 pointing at `tools`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn

from tandem.errors import InvalidRequest
from tandem.frontend.pipeline import tool_prompt
from tandem.frontend.pipeline.structured import schema_output
from tandem.protocols.engine import StructuredOutput
from tandem.protocols.openai import show_value
from tandem.tokens import grammar
from tandem.tokens.grammar import closed_objects

MAX_TOOLS = 128
CHOICES = ("auto", "none", "required")
FORCED_PARSER = "hermes"  # the markup the forcing grammar writes


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool

    def to_dict(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolPlan:
    """What a chat request's tool fields resolve to."""

    tools: list[Tool]  # offered to the model (empty: tool_choice "none")
    structured: StructuredOutput | None  # the forcing constraint (required / named)
    max_calls: int | None  # 1 with parallel_tool_calls false

    def parser(self, model_parser: str) -> str | None:
        """The format to parse the output with: None when no tools are offered, Hermes for a
        forced call (the grammar writes it), else the model's."""
        if not self.tools:
            return None
        return FORCED_PARSER if self.structured is not None else model_parser


def plan_tools(
    tools: Any, tool_choice: Any, parallel_tool_calls: Any, functions: Any, function_call: Any
) -> ToolPlan | None:
    """Validate the tool fields; None when the request has no tools. Raises InvalidRequest
    naming the field."""
    if functions is not None or function_call is not None:
        param = "functions" if functions is not None else "function_call"
        raise InvalidRequest(
            f"{param} is deprecated and not supported; send the functions as tools="
            '[{"type": "function", "function": {...}}] and choose with tool_choice',
            param=param,
        )
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        _bad("parallel_tool_calls", parallel_tool_calls, "true, false or unset")
    if tools is None:
        if tool_choice not in (None, "none"):
            _bad("tool_choice", tool_choice, "unset or 'none' when the request has no tools")
        return None
    parsed = _tools(tools)
    names = [t.name for t in parsed]
    choice = "auto" if tool_choice is None else tool_choice
    max_calls = 1 if parallel_tool_calls is False else None
    if choice == "none":
        return ToolPlan(tools=[], structured=None, max_calls=max_calls)
    if choice == "auto":
        return ToolPlan(tools=parsed, structured=None, max_calls=max_calls)
    if choice == "required":
        forced = parsed
    else:
        name = _named_choice(choice)
        if name not in names:
            _bad("tool_choice.function.name", name, f"one of the tools: {', '.join(names)}")
        forced = [t for t in parsed if t.name == name]
    return ToolPlan(
        tools=parsed, structured=forcing_grammar(forced, max_calls), max_calls=max_calls
    )


def forcing_grammar(tools: list[Tool], max_calls: int | None) -> StructuredOutput:
    """A Lark grammar (llguidance) for one call (or several, one per block) of `tools`, in
    Hermes markup, with arguments that validate against each tool's parameters."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.name},
                # closed even without strict: a small model offered open objects keeps
                # inventing properties until max_tokens
                "arguments": closed_objects(t.parameters),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    repeat = "" if max_calls == 1 else ' ("\\n" call)*'
    lark = (
        f"start: call{repeat}\n"
        'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
        f"body: %json {json.dumps(schema)}\n"
    )
    out = StructuredOutput(kind="grammar", spec=lark)
    grammar.validate(out)
    return out


def render_messages(
    messages: list[dict[str, Any]],
    plan: ToolPlan | None,
    *,
    template_takes_tools: bool,
    parser: str = "hermes",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: tool_calls and tool results written in the
    markup of tool-call format `parser` (the prompt's calls: Hermes when they are forced)
    unless the template takes tools itself. Validates both message kinds."""
    offered = [t.to_dict() for t in plan.tools] if plan is not None and plan.tools else None
    markup = None if template_takes_tools else parser
    if markup is not None and plan is not None and plan.structured is not None:
        markup = FORCED_PARSER
    out: list[dict[str, Any]] = []
    known_ids: set[str] = set()
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = _tool_calls(i, message["tool_calls"])
            known_ids.update(c["id"] for c in calls)
            out.append(_assistant(message, calls, markup))
        elif role == "tool":
            out.append(_tool_result(i, message, known_ids, as_user_turn=markup is not None))
        else:
            out.append(message)
    if offered is None or markup is None:
        return out, offered
    block = tool_prompt.system_block(offered, markup)
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None


def _tools(tools: Any) -> list[Tool]:
    if not isinstance(tools, list) or not tools:
        _bad("tools", tools, "a non-empty list of {'type': 'function', 'function': {...}}")
    if len(tools) > MAX_TOOLS:
        _bad("tools", f"{len(tools)} tools", f"at most {MAX_TOOLS}")
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            _bad(
                f"{param}.type", tool.get("type") if isinstance(tool, dict) else tool, "'function'"
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            _bad(f"{param}.function", fn, "an object with 'name' and 'parameters'")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            _bad(f"{param}.function.name", name, "a name of 1-64 characters")
        if any(t.name == name for t in out):
            _bad(f"{param}.function.name", name, "a name no other tool has")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            _bad(f"{param}.function.description", description, "a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            _bad(f"{param}.function.strict", strict, "true, false or unset")
        schema_output(params, f"{param}.function.parameters", strict=bool(strict))
        out.append(Tool(name, description, params, bool(strict)))
    return out


def _named_choice(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        _bad(
            "tool_choice",
            choice,
            "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        )
    name = fn.get("name")
    if not isinstance(name, str):
        _bad("tool_choice.function.name", name, "the name of one of the tools")
    return name


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        _bad(param, calls, "a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            _bad(f"{p}.function", fn, "an object with 'name' and 'arguments'")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            _bad(f"{p}.function.arguments", args, "a JSON object encoded as a string")
        if not isinstance(parsed, dict):
            _bad(f"{p}.function.arguments", args, "a JSON object encoded as a string")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            _bad(f"{p}.id", call_id, "the call's id (a non-empty string)")
        out.append({"id": call_id, "name": fn["name"], "arguments": parsed})
    return out


def _assistant(message: dict[str, Any], calls: list[dict[str, Any]], markup: str | None) -> Any:
    if markup is None:  # templates that take tools mostly read arguments as a mapping
        tool_calls = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in calls
        ]
        return {**message, "tool_calls": tool_calls}
    written = tool_prompt.calls_text(calls, markup)
    content = message.get("content") or ""
    text = "\n".join([content, written] if isinstance(content, str) and content else [written])
    return {"role": "assistant", "content": text}


def _tool_result(i: int, message: dict[str, Any], known: set[str], *, as_user_turn: bool) -> Any:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or call_id not in known:
        expected = "the id of a tool call in an earlier assistant message"
        _bad(f"messages[{i}].tool_call_id", call_id, expected)
    if not as_user_turn:
        return message
    content = message.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        _bad(f"messages[{i}].content", content, "the tool's result as a string")
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


def _bad(param: str, value: Any, expected: str) -> NoReturn:
    raise InvalidRequest(
        f"{param}={show_value(value)} is invalid; expected {expected}", param=param
    )
