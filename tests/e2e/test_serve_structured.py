"""Structured outputs and tool calling (issue 11) through `tandem serve --engine native` on
SmolLM2 as a real process, driven by the official `openai` SDK: schema-constrained answers that
validate (`jsonschema`) and that `chat.completions.parse()` accepts, streamed and not;
json_object; forced tool calls (required, named) whose arguments validate; a full tool round
trip; streamed tool-call deltas that reassemble to the same call; 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from tests.support.services import free_port
from tests.support.tandem_procs import MODEL, TandemProcess, start_tandem

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    tmp = tmp_path_factory.mktemp("structured")
    port = free_port()
    args = ["serve", "--engine", "native", "--workers", "1", "--num-blocks", "256"]
    args += ["--port", str(port), "--run-dir", str(tmp / "run"), "--log-level", "INFO"]
    proc: TandemProcess = start_tandem("serve", args, tmp)
    try:
        proc.wait_log(r"tandem serve ready", timeout_s=120)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    finally:
        code = proc.stop()
        log = proc.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-5000:]


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
        "required": ["name", "address"],
    },
    "enum_and_bounds": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "age": {"type": "integer", "minimum": 18, "maximum": 30},
        },
        "required": ["color", "age"],
    },
    "array": {
        "type": "object",
        "properties": {
            "primes": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 2,
                "maxItems": 4,
            },
            "done": {"type": "boolean"},
        },
        "required": ["primes", "done"],
    },
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates(client: openai.OpenAI, name: str, stream: bool) -> None:
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 120, "temperature": 0.0}
    messages = ask(f"Answer in JSON: an example of {name}.")
    if stream:
        chunks = client.chat.completions.create(
            messages=messages, response_format=fmt, stream=True, **kw
        )
        text, finish = "", None
        for chunk in chunks:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
    else:
        resp = client.chat.completions.create(messages=messages, response_format=fmt, **kw)
        text, finish = resp.choices[0].message.content or "", resp.choices[0].finish_reason
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


class Color(StrEnum):
    red = "red"
    green = "green"


class City(BaseModel):
    name: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)


class Trip(BaseModel):
    traveller: str = Field(max_length=24)
    favourite: Color
    cities: list[City] = Field(max_length=2)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI, temperature: float) -> None:
    resp = client.chat.completions.parse(
        model=MODEL,
        messages=ask("Alice travels to Paris and Rome. Answer in JSON."),
        response_format=Trip,
        max_tokens=160,
        temperature=temperature,
        seed=7,
    )
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Trip), resp.choices[0].message.content
    assert len(parsed.cities) <= 2


def test_sdk_streamed_parse(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=MODEL,
        messages=ask("Alice travels to Paris and Rome. Answer in JSON."),
        response_format=Trip,
        max_tokens=160,
        temperature=0.0,
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Trip)


def test_json_object_parses_and_n_choices_each_parse(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=ask("Give me a JSON object describing a cat."),
        response_format={"type": "json_object"},
        max_tokens=80,
        temperature=0.9,
        seed=3,
        n=2,
        extra_body={"top_k": 20},  # a short tail: the small model closes its strings
    )
    for choice in resp.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content or ""), dict)
        else:  # cut at max_tokens: still a JSON object in progress
            assert (choice.message.content or "").startswith("{")


def test_completions_take_response_format(client: openai.OpenAI) -> None:
    schema = SCHEMAS["enum_and_bounds"]
    resp = client.completions.create(
        model=MODEL,
        prompt="The answer as JSON:",
        max_tokens=40,
        temperature=0.0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            }
        },
    )
    jsonschema.validate(json.loads(resp.choices[0].text), schema)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        },
    },
}
PARAMS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]}


def check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    if name is not None:
        assert call.function.name == name
    args = json.loads(call.function.arguments)
    tool = WEATHER if call.function.name == "get_weather" else TIME
    jsonschema.validate(args, tool["function"]["parameters"])  # type: ignore[index]
    return args


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_call_is_valid(client: openai.OpenAI, choice: Any) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=ask("What is the weather in Paris?"),
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0.0,
    )
    msg, finish = resp.choices[0].message, resp.choices[0].finish_reason
    assert finish == "tool_calls", msg
    assert msg.content is None and msg.tool_calls is not None and len(msg.tool_calls) == 1
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    check_call(msg.tool_calls[0], named)


def test_streamed_tool_call_deltas_reassemble(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": ask("What is the weather in Paris?"),
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "max_tokens": 80,
        "temperature": 0.0,
    }
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert whole is not None
    calls: dict[int, dict[str, Any]] = {}
    content, finish, num_arg_deltas = "", None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id is not None:
                    call["id"], call["name"] = d.id, d.function.name  # type: ignore[union-attr]
                if d.function is not None and d.function.arguments:
                    call["arguments"] += d.function.arguments
                    num_arg_deltas += 1
    assert "<tool_call>" not in content and content.strip() == ""
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == whole[0].function.name == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(whole[0].function.arguments)
    assert num_arg_deltas >= 2  # arguments arrive in pieces, not in one final delta


def test_tool_round_trip(client: openai.OpenAI) -> None:
    messages: list[Any] = ask("What is the weather in Paris? Use the tool.")
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=80,
        temperature=0.0,
    )
    calls = first.choices[0].message.tool_calls
    assert calls
    check_call(calls[0], "get_weather")
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    for call in calls:
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call.id,
                "content": '{"temperature": 21, "sky": "sun"}',
            }
        )
    final = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=40,
        temperature=0.0,
    )
    answer = final.choices[0].message
    assert answer.tool_calls is None and answer.content
    assert final.choices[0].finish_reason in ("stop", "length")


def bad(client: openai.OpenAI, **kw: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=4, **kw)
    body = info.value.body
    assert isinstance(body, dict)
    return body


def test_bad_requests_name_the_field(client: openai.OpenAI) -> None:
    schema = {"type": "objectx"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert bad(client, response_format=fmt)["param"] == "response_format.json_schema.schema"
    assert bad(client, response_format={"type": "yaml"})["param"] == "response_format.type"
    unknown = {"type": "function", "function": {"name": "nope"}}
    body = bad(client, tools=[WEATHER], tool_choice=unknown)
    assert body["param"] == "tool_choice.function.name" and "get_weather" in body["message"]
    broken = {"type": "function", "function": {"parameters": {}}}
    assert bad(client, tools=[broken])["param"] == "tools[0].function.name"
    bad_params = {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
    assert bad(client, tools=[bad_params])["param"] == "tools[0].function.parameters"
    legacy = [{"name": "f", "parameters": {"type": "object"}}]
    assert bad(client, functions=legacy)["param"] == "functions"
    orphan = [*ask("hi"), {"role": "tool", "tool_call_id": "call_x", "content": "1"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=orphan, max_tokens=4)
    assert info.value.body["param"] == "messages[1].tool_call_id"  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_never_leaks_markup(client: openai.OpenAI, stream: bool) -> None:
    """tool_choice auto: the model decides. Whatever it writes, the markup of a call never
    reaches content, and a call it makes is well formed."""
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": ask("What is the weather in Paris? Call get_weather."),
        "tools": [WEATHER],
        "max_tokens": 60,
        "temperature": 0.0,
    }
    if stream:
        content, names = "", []
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                names += [d.function.name for d in c.delta.tool_calls or [] if d.id]  # type: ignore[union-attr]
    else:
        msg = client.chat.completions.create(**kw).choices[0].message
        content, names = msg.content or "", [c.function.name for c in msg.tool_calls or []]  # type: ignore[union-attr]
        for call in msg.tool_calls or []:
            json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert "<tool_call>\n{" not in content
    assert all(n == "get_weather" for n in names)
