"""Recorded-style outputs of tool-calling and reasoning models, as their tool-call parsers
see them (special tokens kept where the format needs them): well-formed ones with the content
and calls they mean, and malformed or cut ones, which must come back as text."""

from __future__ import annotations

from typing import Any

from tandem.frontend.pipeline.tools import Tool

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
        "include_hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string"}},
        "threshold": {"type": ["number", "null"]},
    },
    "required": ["location"],
}
TOOLS = [
    Tool("get_current_weather", "Current weather", WEATHER_SCHEMA, False),
    Tool(
        "get_time", None, {"type": "object", "properties": {"timezone": {"type": "string"}}}, False
    ),
    Tool(
        "write_file",
        None,
        {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        },
        False,
    ),
]

Call = tuple[str, dict[str, Any]]
# format -> (output, content, calls)
WELL_FORMED: dict[str, list[tuple[str, str | None, list[Call]]]] = {
    "hermes": [
        (
            '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris, '
            'France", "unit": "celsius"}}\n</tool_call>',
            None,
            [("get_current_weather", {"location": "Paris, France", "unit": "celsius"})],
        ),
    ],
    "llama3_json": [
        (  # Llama 3.1 8B, special tokens skipped
            '{"name": "get_current_weather", "parameters": {"location": "San Francisco, CA", '
            '"unit": "fahrenheit"}}',
            None,
            [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})],
        ),
        (  # Llama 3.2 3B, special tokens kept
            '<|python_tag|>{"name": "get_current_weather", "parameters": {"location": '
            '"Paris, France", "unit": "celsius"}}',
            None,
            [("get_current_weather", {"location": "Paris, France", "unit": "celsius"})],
        ),
        (  # Llama 3.3 70B, two calls
            '{"name": "get_current_weather", "parameters": {"location": "Boston, MA"}}; '
            '{"name": "get_time", "parameters": {"timezone": "America/New_York"}}',
            None,
            [
                ("get_current_weather", {"location": "Boston, MA"}),
                ("get_time", {"timezone": "America/New_York"}),
            ],
        ),
        (  # arguments, nested objects, braces inside strings
            '\n{"name": "write_file", "arguments": {"path": "a.json", "content": "{\\"k\\": '
            '[1, {\\"x\\": 2}]}"}}',
            None,
            [("write_file", {"path": "a.json", "content": '{"k": [1, {"x": 2}]}'})],
        ),
        ("The weather in Paris is sunny, 21 °C.", "The weather in Paris is sunny, 21 °C.", []),
        ('{"temperature": 21, "unit": "celsius"}', '{"temperature": 21, "unit": "celsius"}', []),
    ],
    "mistral": [
        (  # Mistral-7B-Instruct-v0.3
            '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, '
            'France", "unit": "celsius"}}]',
            None,
            [("get_current_weather", {"location": "Paris, France", "unit": "celsius"})],
        ),
        (  # Mistral-Small-3.2 (v11 tokenizer)
            '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "unit": "celsius"}',
            None,
            [("get_current_weather", {"location": "Paris, France", "unit": "celsius"})],
        ),
        (
            'I\'ll check both for you.[TOOL_CALLS]get_current_weather[ARGS]{"location": '
            '"Paris"}[TOOL_CALLS]get_time[ARGS]{"timezone": "Europe/Paris"}',
            "I'll check both for you.",
            [
                ("get_current_weather", {"location": "Paris"}),
                ("get_time", {"timezone": "Europe/Paris"}),
            ],
        ),
        (  # v13: a call id between name and arguments
            '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"timezone": "UTC"}',
            None,
            [("get_time", {"timezone": "UTC"})],
        ),
        ("Paris is the capital of France.", "Paris is the capital of France.", []),
    ],
    "qwen3_coder": [
        (
            "I'll look that up.\n\n<tool_call>\n<function=get_current_weather>\n"
            "<parameter=location>\nParis, France\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=include_hourly>\nfalse\n</parameter>\n"
            '<parameter=fields>\n["temperature", "wind"]\n</parameter>\n'
            "<parameter=threshold>\n0.5\n</parameter>\n</function>\n</tool_call>",
            "I'll look that up.",
            [
                (
                    "get_current_weather",
                    {
                        "location": "Paris, France",
                        "days": 3,
                        "include_hourly": False,
                        "fields": ["temperature", "wind"],
                        "threshold": 0.5,
                    },
                )
            ],
        ),
        (
            "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n"
            '<parameter=content>\ndef main():\n    print("<hi>")\n\n</parameter>\n'
            "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n"
            "</tool_call>",
            None,
            [
                (
                    "write_file",
                    {"path": "src/main.py", "content": 'def main():\n    print("<hi>")\n'},
                ),
                ("get_time", {}),
            ],
        ),
        (  # a value that does not convert to its type stays text; unknown parameters too
            "<tool_call>\n<function=get_current_weather>\n<parameter=days>\nthree\n"
            "</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>",
            None,
            [("get_current_weather", {"days": "three", "extra": "42"})],
        ),
    ],
    "pythonic": [
        (  # Llama 3.2 (pythonic prompt)
            '[get_current_weather(location="Paris, France", unit="celsius"), '
            'get_time(timezone="Europe/Paris")]',
            None,
            [
                ("get_current_weather", {"location": "Paris, France", "unit": "celsius"}),
                ("get_time", {"timezone": "Europe/Paris"}),
            ],
        ),
        (  # Llama 4, special tokens kept
            "<|python_start|>[get_current_weather(location='Paris', days=3, include_hourly=True, "
            "fields=['temp', \"wind\"], threshold=None)]<|python_end|>",
            None,
            [
                (
                    "get_current_weather",
                    {
                        "location": "Paris",
                        "days": 3,
                        "include_hourly": True,
                        "fields": ["temp", "wind"],
                        "threshold": None,
                    },
                )
            ],
        ),
        ('[get_time(timezone="a)b]c\\"d")]', None, [("get_time", {"timezone": 'a)b]c"d'})]),
        (  # brackets and quotes inside a triple-quoted string
            "[write_file(path='a.py', content='''print(\"(\", ']')\n''')]",
            None,
            [("write_file", {"path": "a.py", "content": "print(\"(\", ']')\n"})],
        ),
        ("[1] Paris is the capital of France.", "[1] Paris is the capital of France.", []),
    ],
}

# format -> outputs that are not (all) well-formed calls: each must come back as its text
MALFORMED: dict[str, list[str]] = {
    "hermes": [
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Par',
        "<tool_call>\nnot json\n</tool_call>",
    ],
    "llama3_json": [
        '{"name": "get_current_weather", "parameters": {"location": "Paris"',  # cut
        '{"name": "get_current_weather", "parameters": {"location": Paris}}',  # not JSON
        '{"name": "get_current_weather", "parameters": ["Paris"]}',
        '{"name": "get_time", "parameters": {}} and then some text',
        "<|python_tag|>",
    ],
    "mistral": [
        '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Par',  # cut
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris"}}',
        "[TOOL_CALLS]get the weather now",
        '[TOOL_CALLS]get_current_weather[ARGS]["Paris"]',
        "[TOOL_CALLS]",
        '[TOOL_CALLS][{"arguments": {}}]',
    ],
    "qwen3_coder": [
        "<tool_call>\n<function=get_current_weather>\n<parameter=location>\nPar",  # cut
        "<tool_call>\n<function=get_current_weather>\n<parameter=location>\nParis\n"
        "</parameter>\n</tool_call>",  # no </function>
        "<tool_call>\nnot xml at all\n</tool_call>",
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call> trailing words",
    ],
    "pythonic": [
        '[get_current_weather(location="Paris"',  # cut
        '[get_current_weather("Paris")]',  # positional
        '[get_current_weather(location=open("/etc/passwd"))]',  # not a literal
        '[__import__("os").system("id")]',
        "[get_time(**{'timezone': 'UTC'})]",
        "[get_time(timezone={1, 2})]",  # a set: no JSON for it
    ],
}

# (reasoning parser, the prompt leaves the output inside <think>, output, reasoning, content)
REASONING: list[tuple[str, bool, str, str | None, str]] = [
    (  # DeepSeek-R1: the template put <think> in the prompt
        "deepseek_r1",
        True,
        "Okay, the user asks for 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
        "Okay, the user asks for 2+2. That is 4.\n",
        "The answer is **4**.",
    ),
    (  # an older R1 distill writes <think> itself
        "deepseek_r1",
        False,
        "<think>\nSimple sum.\n</think>\n\n4",
        "\nSimple sum.\n",
        "4",
    ),
    (
        "deepseek_r1",
        True,
        "Still thinking when max_tokens hit",
        "Still thinking when max_tokens hit",
        "",
    ),
    (  # Qwen3 with thinking on
        "qwen3",
        False,
        "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?",
        "\nThe user greets me. I should greet back.\n",
        "Hello! How can I help?",
    ),
    ("qwen3", False, "Hello! How can I help?", None, "Hello! How can I help?"),
    (  # Qwen3 thinking-2507: <think> at the prompt's end
        "qwen3",
        True,
        "Let me recall: Paris.\n</think>\n\nParis.",
        "Let me recall: Paris.\n",
        "Paris.",
    ),
    (  # a tool call while thinking is reasoning; the one after is a call
        "qwen3",
        False,
        '<think>\nMaybe <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>?\n'
        '</think>\n\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": '
        '"Paris"}}\n</tool_call>',
        '\nMaybe <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>?\n',
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris"}}\n'
        "</tool_call>",
    ),
]
