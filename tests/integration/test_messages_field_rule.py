"""The Anthropic Messages API with the official `anthropic` SDK against a real frontend and
the real SmolLM2 native engine: every field of the current Messages request either has its
documented effect (observed here) or is a 400 naming it in Anthropic's error shape; the SDK's
streaming helper accumulates tandem's events; tools round-trip (tool_use → tool_result).
count_tokens, x-api-key and the routing equivalence with chat are shown on the mocker
(tests/integration/test_frontend_messages.py).

The field list is the 2.x SDK's `MessageCreateParamsStreaming` (generated from Anthropic's
API reference); `test_the_list_matches_the_sdk` fails when a newer SDK adds a field, until it
is given a rule here. temperature / top_p / top_k are the fields older clients send (with
anthropic-version 2023-06-01; the 2.x SDK sends 2026-10-21, which removed them: a 400).
"""

from __future__ import annotations

import json
import logging
import typing
from contextlib import AsyncExitStack
from typing import Any

import anthropic
import pytest
from anthropic.types import message_create_params
from tests.support.frontend_stack import FrontendStack

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine

pytestmark = [pytest.mark.native, pytest.mark.timeout(240)]
MODEL = "smollm2"
STORY = [{"role": "user", "content": "Tell me a short story about a fox."}]
FIELDS = (
    "cache_control", "container", "diagnostics", "inference_geo", "max_tokens", "messages",
    "metadata", "model", "output_config", "service_tier", "speed", "stop_sequences", "stream",
    "system", "thinking", "tool_choice", "tools", "user_profile_id", "workspace_id",
)  # fmt: skip
# field -> a value the API defines that tandem does not honour (each a 400 naming it)
REFUSED = {
    "container": "container_1",
    "diagnostics": {"previous_message_id": "msg_1"},
    "inference_geo": "us",
    "speed": "fast",
    "output_config": {"effort": "high"},
    # SmolLM2 has no reasoning parser
    "thinking": {"type": "enabled", "budget_tokens": 1024},
}
REFUSED_HEADERS = {
    "user_profile_id": "anthropic-user-profile-id",
    "workspace_id": "anthropic-workspace-id",
}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
Client = anthropic.AsyncAnthropic
OLD_VERSION = {"anthropic-version": "2023-06-01"}  # an older client: sampling fields allowed


def _old_client(base: str, api_key: str = "x") -> Client:
    return anthropic.AsyncAnthropic(
        base_url=base, api_key=api_key, max_retries=0, default_headers=OLD_VERSION
    )


def test_the_list_matches_the_sdk() -> None:
    assert set(typing.get_type_hints(message_create_params.MessageCreateParamsStreaming)) == set(
        FIELDS
    )


async def _create(client: Client, **kw: Any) -> Any:
    """Greedy (temperature 0) unless asked otherwise, on an old client's version."""
    body: dict[str, Any] = {"model": MODEL, "messages": STORY, "max_tokens": 12, **kw}
    old = client.default_headers.get("anthropic-version") == OLD_VERSION["anthropic-version"]
    extra = {**({"temperature": 0} if old else {}), **body.pop("extra_body", {})}
    return await client.messages.create(**body, extra_body=extra)


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


async def _refused(call: Any, param: str) -> dict[str, Any]:
    with pytest.raises(anthropic.BadRequestError) as info:
        await call
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error", body
    assert param in body["error"]["message"], body
    return body


async def _sampling_effects(client: Client, caplog: pytest.LogCaptureFixture) -> set[str]:
    base = await _create(client)
    greedy = _text(base)
    assert base.model == MODEL and greedy and base.id.startswith("msg_")
    assert base.usage.output_tokens == 12 and base.stop_reason == "max_tokens"  # max_tokens
    short = await _create(client, max_tokens=3)
    assert short.usage.output_tokens == 3
    hot = {"temperature": 1.0}
    samples = {_text(await _create(client, extra_body=hot)) for _ in range(3)}
    assert samples - {greedy}  # temperature
    assert _text(await _create(client, extra_body={**hot, "top_k": 1})) == greedy  # top_k
    assert _text(await _create(client, extra_body={**hot, "top_p": 1e-6})) == greedy  # top_p
    told = await _create(client, system="Answer only in French.")
    assert _text(told) != greedy  # system
    blocks = [{"type": "text", "text": "Answer only "}, {"type": "text", "text": "in French."}]
    assert _text(await _create(client, system=blocks)) == _text(told)
    word = greedy.split()[2]
    cut = await _create(client, stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in _text(cut) and greedy.startswith(_text(cut))  # stop_sequences
    async with client.messages.stream(
        model=MODEL, messages=STORY, max_tokens=12, extra_body={"temperature": 0}
    ) as stream:  # an old client's stream
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert _text(final) == greedy and final.usage.output_tokens == 12  # stream
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    with caplog.at_level(logging.DEBUG, logger="tandem.frontend.api.messages"):
        await _create(client, metadata={"user_id": "user-7"})
    assert "user=user-7" in caplog.text  # metadata
    accepted = await _create(
        client,
        service_tier="standard_only",
        cache_control={"type": "ephemeral", "ttl": "1h"},
        thinking={"type": "disabled"},
    )
    assert _text(accepted) == greedy and accepted.usage.service_tier == "standard"
    return {
        "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "metadata",
        "service_tier", "cache_control",
    }  # fmt: skip


async def _tool_effects(client: Client) -> set[str]:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = await _create(
        client,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        max_tokens=48,
    )
    assert forced.stop_reason == "tool_use", forced
    call = forced.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input.get("city"), str)  # tools, tool_choice
    turns = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in forced.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}],
        },
    ]
    answer = await _create(client, messages=turns, tools=[WEATHER], max_tokens=16)
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    stray = {"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}
    unknown = [*turns[:2], {"role": "user", "content": [stray]}]
    await _refused(_create(client, messages=unknown, tools=[WEATHER]), "tool_use_id")
    async with client.messages.stream(
        model=MODEL,
        messages=ask,
        max_tokens=48,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    ) as stream:
        deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
        streamed = await stream.get_final_message()
    assert "input_json_delta" in deltas and streamed.stop_reason == "tool_use"
    assert streamed.content[-1].input == forced.content[-1].input  # type: ignore[union-attr]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    out = _text(await _create(client, output_config=fmt, max_tokens=24))
    assert isinstance(json.loads(out)["n"], int), out  # output_config
    return {"tools", "tool_choice", "output_config"}


async def test_every_messages_field_has_its_effect_or_a_400_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        config = NativeConfig(num_blocks=256, max_num_batched_tokens=256, num_threads=1)
        await s.add_worker(NativeEngine(config))
        ready = {"model": MODEL, "messages": STORY, "max_tokens": 1}
        await s.start_frontend(ready, ready_path="/v1/messages")
        client = _old_client(s.base)
        current = anthropic.AsyncAnthropic(base_url=s.base, api_key="x", max_retries=0)
        for field, value in REFUSED.items():
            await _refused(_create(current, **{field: value}), field)
        for field, header in REFUSED_HEADERS.items():
            await _refused(_create(current, **{field: "w-1"}), header)
        for field in ("temperature", "top_p", "top_k"):  # removed in the SDK's version
            await _refused(_create(current, extra_body={field: 1}), field)
        assert _text(await _create(current))  # the current SDK's defaults
        done = await _sampling_effects(client, caplog) | set(REFUSED) | set(REFUSED_HEADERS)
        done |= await _tool_effects(client)
        assert set(FIELDS) - done == set()
