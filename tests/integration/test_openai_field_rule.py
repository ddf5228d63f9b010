"""The request-field rule, field by field, with the official `openai` SDK against a real
frontend and the real SmolLM2 native engine: every field OpenAI defines for
/v1/chat/completions and /v1/completions either has its documented effect (observed here)
or gets a 400 naming the field.

The field lists are the request bodies of "Create chat completion" and "Create completion"
in the OpenAI API reference (platform.openai.com/docs/api-reference/chat/create and
/completions/create). The official `openai` SDK is generated from OpenAI's OpenAPI spec of
that reference, so its `CompletionCreateParamsStreaming` TypedDicts carry the same names;
`test_the_lists_match_the_sdk` checks the lists against the installed SDK, so a field a newer
SDK adds fails here until it is given a rule.
"""

from __future__ import annotations

import functools
import json
import logging
import typing
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from tests.support.frontend_stack import CHAT, FrontendStack
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.tokens.tokenizer import ModelTokenizer, load_tokenizer

pytestmark = [pytest.mark.native, pytest.mark.timeout(240)]
MODEL = "smollm2"
MESSAGES = [{"role": "user", "content": "Write the word cat twenty times."}]
PROMPT = "Write the word cat twenty times: cat cat cat cat"

CHAT_FIELDS = (
    "messages", "model", "audio", "moderation", "prompt_cache_options", "prompt_cache_retention",
    "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop",
    "store", "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
    "top_p", "user", "verbosity", "web_search_options",
)  # fmt: skip
COMPLETION_FIELDS = (
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user",
)  # fmt: skip
# field -> a value OpenAI defines that tandem does not offer (each must be a 400 naming it)
CHAT_REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"},
    "metadata": {"project": "x"},
    "modalities": ["text", "audio"],
    "moderation": {"model": "omni-moderation-latest"},
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "prediction": {"type": "content", "content": "the cat"},
    "reasoning_effort": "high",
    "service_tier": "flex",
    "store": True,
    "verbosity": "low",
    "web_search_options": {},
}
COMPLETION_REFUSED = {
    "suffix": " and then",
}

Client = openai.AsyncOpenAI
Check = Callable[[Client, dict[str, Any]], Awaitable[None]]


@functools.cache
def _tokenizer() -> ModelTokenizer:
    return load_tokenizer(f"gguf:{smollm2_gguf()}")


def test_the_lists_match_the_sdk() -> None:
    chat = set(typing.get_type_hints(chat_create_params.CompletionCreateParamsStreaming))
    legacy = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsStreaming))
    assert chat == set(CHAT_FIELDS)
    assert legacy == set(COMPLETION_FIELDS)


async def _chat(client: Client, **kw: Any) -> Any:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, **kw}
    extra = {"ignore_eos": True}
    return await client.chat.completions.create(**body, extra_body=extra)


async def _text(client: Client, **kw: Any) -> Any:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **kw}
    return await client.completions.create(**body, extra_body={"ignore_eos": True})


def _content(resp: Any) -> str:
    return resp.choices[0].message.content


async def _refused(call: Awaitable[Any], field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await call
    error = info.value.body
    assert isinstance(error, dict) and error.get("param") == field, error
    assert "not supported" in error["message"] and "accepted" in error["message"], error


async def _chat_effects(client: Client, caplog: pytest.LogCaptureFixture) -> set[str]:
    """Each accepted chat field's documented effect; returns the fields checked."""
    base = await _chat(client)
    greedy = _content(base)
    assert base.model == MODEL and greedy  # model, messages
    first_token = _tokenizer().encode(greedy)[0]
    biased = await _chat(client, logit_bias={str(first_token): -100})
    assert not _content(biased).startswith(greedy[:4]), (greedy, _content(biased))
    for field in ("frequency_penalty", "presence_penalty"):
        assert _content(await _chat(client, **{field: 2.0})) != greedy, field
    lp = await _chat(client, logprobs=True, top_logprobs=3)
    assert len(lp.choices[0].logprobs.content) == 12  # logprobs
    assert all(len(e.top_logprobs) == 3 for e in lp.choices[0].logprobs.content)
    for field in ("max_completion_tokens", "max_tokens"):
        assert (await _chat(client, **{field: 3})).usage.completion_tokens == 3, field
    assert len((await _chat(client, n=2)).choices) == 2
    hot = {"temperature": 1.8, "seed": 11}
    sampled = _content(await _chat(client, **hot))
    assert sampled != greedy  # temperature
    assert _content(await _chat(client, **hot)) == sampled  # seed
    assert _content(await _chat(client, **hot, top_p=1e-6)) == greedy  # top_p keeps the top
    word = greedy.split()[1]
    cut = await _chat(client, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and word not in _content(cut)
    stream = await _chat(client, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy
    assert chunks[-1].usage.completion_tokens == 12  # stream, stream_options
    key = {"prompt_cache_key": "cat-prompts"}
    await _chat(client, **key)
    cached = (await _chat(client, **key)).usage.prompt_tokens_details.cached_tokens
    assert cached > 0  # prompt_cache_key: the prompt's blocks are reused
    with caplog.at_level(logging.DEBUG, logger="tandem.frontend.api.chat"):
        await _chat(client, user="alice-1", safety_identifier="hash-42")
    assert "user=alice-1" in caplog.text and "safety_identifier=hash-42" in caplog.text
    accepted = {"store": False, "service_tier": "auto", "modalities": ["text"]}
    await _chat(client, **accepted, prompt_cache_retention="in_memory")
    return {
        "model", "messages", "logit_bias", "frequency_penalty", "presence_penalty", "logprobs",
        "top_logprobs", "max_completion_tokens", "max_tokens", "n", "temperature", "seed",
        "top_p", "stop", "stream", "stream_options", "prompt_cache_key", "user",
        "safety_identifier",
    }  # fmt: skip


TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


async def _tool_effects(client: Client) -> set[str]:
    """Structured outputs and tool calls, in brief (tests/e2e/test_serve_structured.py has
    them in depth)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "num", "schema": schema}}
    out = _content(await _chat(client, response_format=fmt, max_tokens=24))
    assert isinstance(json.loads(out)["n"], int), out  # response_format
    forced = {"tools": [TOOL], "parallel_tool_calls": False, "max_tokens": 48}
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = await _chat(client, **forced, tool_choice=named)
    calls = resp.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1 and calls[0].function.name == "get_time"
    assert "city" in json.loads(calls[0].function.arguments)  # tools, tool_choice, parallel
    for legacy in ("functions", "function_call"):
        value = [TOOL["function"]] if legacy == "functions" else "auto"
        with pytest.raises(openai.BadRequestError) as info:
            await _chat(client, **{legacy: value})
        assert isinstance(info.value.body, dict) and info.value.body["param"] == legacy
        assert "not supported" in info.value.body["message"]
    return {
        "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions",
        "function_call",
    }  # fmt: skip


async def _completion_effects(client: Client, caplog: pytest.LogCaptureFixture) -> set[str]:
    base = await _text(client)
    greedy = base.choices[0].text
    assert base.model == MODEL and greedy
    first_token = _tokenizer().encode(greedy)[0]
    biased = await _text(client, logit_bias={str(first_token): -100})
    assert not biased.choices[0].text.startswith(greedy[:4])
    for field in ("frequency_penalty", "presence_penalty"):
        assert (await _text(client, **{field: 2.0})).choices[0].text != greedy, field
    lp = await _text(client, logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == 12
    assert all(len(t) == 2 for t in lp.choices[0].logprobs.top_logprobs)
    assert (await _text(client, max_tokens=3)).usage.completion_tokens == 3
    assert len((await _text(client, n=2)).choices) == 2
    hot = {"temperature": 1.8, "seed": 11}
    sampled = (await _text(client, **hot)).choices[0].text
    assert sampled != greedy and (await _text(client, **hot)).choices[0].text == sampled
    assert (await _text(client, **hot, top_p=1e-6)).choices[0].text == greedy
    # best_of: candidate i is seeded seed+i; the answer is the one with the best mean logprob
    candidates = [await _text(client, **{**hot, "seed": 11 + i}, logprobs=0) for i in range(3)]
    means = [sum(c.choices[0].logprobs.token_logprobs) / 12 for c in candidates]
    best = candidates[means.index(max(means))].choices[0].text
    picked = await _text(client, **hot, best_of=3)
    assert picked.choices[0].text == best and picked.choices[0].logprobs is None
    assert picked.usage.completion_tokens == 36  # every candidate counts
    word = greedy.split()[1]
    cut = await _text(client, stop=word)
    assert cut.choices[0].finish_reason == "stop" and word not in cut.choices[0].text
    stream = await _text(client, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy
    assert chunks[-1].usage.completion_tokens == 12
    echoed = await _text(client, echo=True)
    assert echoed.choices[0].text == PROMPT + greedy  # echo
    await _refused(_text(client, echo=True, logprobs=1), "echo")  # no prompt logprobs
    with caplog.at_level(logging.DEBUG, logger="tandem.frontend.api.chat"):
        await _text(client, user="bob-2")
    assert "user=bob-2" in caplog.text
    return {
        "model", "prompt", "logit_bias", "frequency_penalty", "presence_penalty", "logprobs",
        "max_tokens", "n", "temperature", "seed", "top_p", "best_of", "stop", "stream",
        "stream_options", "user", "echo",
    }  # fmt: skip


async def test_every_openai_field_has_its_effect_or_a_400_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        config = NativeConfig(num_blocks=256, max_num_batched_tokens=256, num_threads=1)
        await s.add_worker(NativeEngine(config))
        ready = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
        await s.start_frontend(ready, ready_path=CHAT)
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="x", max_retries=0)
        for field, value in CHAT_REFUSED.items():
            await _refused(_chat(client, **{field: value}), field)
        for field, value in COMPLETION_REFUSED.items():
            await _refused(_text(client, **{field: value}), field)
        chat_done = await _chat_effects(client, caplog) | set(CHAT_REFUSED)
        text_done = await _completion_effects(client, caplog) | set(COMPLETION_REFUSED)
        chat_done |= await _tool_effects(client)
        assert set(CHAT_FIELDS) - chat_done == set()
        assert set(COMPLETION_FIELDS) - text_done == set()
