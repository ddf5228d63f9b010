"""/v1/messages with the official `anthropic` SDK against mocker workers (in one process):
thinking through the model's reasoning parser, tool_use from the model's tool-call parser,
an engine failure after the stream started as Anthropic's `error` event, the same prompt as
the chat request's tokens and cached blocks (text, and image blocks through the multimodal
path), x-api-key, refusals in Anthropic's shape, and /openapi.json."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from tests.support.frontend_stack import FrontendStack
from tests.support.images import data_url, synthetic_png
from tests.support.model_outputs import TOOLS
from tests.support.scripted_engine import ScriptedEngine
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.protocols.engine import EngineOutput, PreprocessedRequest

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"
ASK = [{"role": "user", "content": "Capital of France?"}]
READY = {"model": MODEL, "messages": ASK, "max_tokens": 1}
KEY = "sk-test-key"
R1_OUT = "The user wants the capital. It is Paris.\n</think>\n\nParis."
MISTRAL_OUT = 'Checking.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris"}'


class FailingEngine(ScriptedEngine):
    """Answers its text's first tokens, then fails (a one-token request, the stack's readiness
    probe, is answered)."""

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest, **_: Any
    ) -> AsyncGenerator[EngineOutput, None]:
        yield EngineOutput(token_ids=self.ids[:3])
        if request.stop.max_tokens == 1:
            yield EngineOutput(finish_reason="length")
            return
        yield EngineOutput(finish_reason="error", error="the GPU caught fire")


@asynccontextmanager
async def _stack(engine: MockerEngine, **worker: Any) -> AsyncIterator[tuple[FrontendStack, Any]]:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        w = Worker(engine, await s.runtime(), WorkerConfig(**worker))
        await w.start()
        exit_stack.push_async_callback(w.stop, 0)
        await s.start_frontend(READY)
        client = anthropic.AsyncAnthropic(base_url=s.base, api_key="x", max_retries=0)
        async with client:
            yield s, client


async def test_thinking_comes_from_the_reasoning_parser_whole_and_streamed() -> None:
    thinking = {"type": "enabled", "budget_tokens": 1024}
    async with _stack(ScriptedEngine(R1_OUT), reasoning_parser="deepseek_r1") as (_, client):
        message = await client.messages.create(
            model=MODEL, messages=ASK, max_tokens=2048, thinking=thinking
        )
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "The user wants the capital. It is Paris.\n"  # type: ignore[union-attr]
        assert message.content[1].text == "Paris."  # type: ignore[union-attr]
        async with client.messages.stream(
            model=MODEL, messages=ASK, max_tokens=2048, thinking=thinking
        ) as stream:
            deltas = {e.delta.type async for e in stream if e.type == "content_block_delta"}
            streamed = await stream.get_final_message()
        assert deltas == {"thinking_delta", "text_delta"}
        assert streamed.model_dump(exclude={"id"}) == message.model_dump(exclude={"id"})
        # not asked for: a model that thinks anyway has its thinking dropped, tags and all
        quiet = await client.messages.create(model=MODEL, messages=ASK, max_tokens=2048)
        assert [(b.type, b.text) for b in quiet.content] == [("text", "Paris.")]  # type: ignore[union-attr]


async def test_tool_use_comes_from_the_models_tool_call_parser() -> None:
    tools = [{"name": t.name, "input_schema": t.parameters} for t in TOOLS[:2]]
    async with _stack(ScriptedEngine(MISTRAL_OUT), tool_call_parser="mistral") as (_, client):
        message = await client.messages.create(
            model=MODEL,
            messages=ASK,
            max_tokens=256,
            tools=tools,  # type: ignore[arg-type]
        )
        assert message.stop_reason == "tool_use"
        text, call = message.content
        assert text.type == "text" and text.text == "Checking."
        assert call.type == "tool_use" and call.name == "get_current_weather"
        assert call.input == {"location": "Paris"}
        async with client.messages.stream(
            model=MODEL,
            messages=ASK,
            max_tokens=256,
            tools=tools,  # type: ignore[arg-type]
        ) as stream:
            streamed = await stream.get_final_message()
        assert streamed.content[1].input == call.input  # type: ignore[union-attr]
        assert streamed.stop_reason == "tool_use"


async def test_an_engine_failure_mid_stream_is_an_error_event() -> None:
    async with _stack(FailingEngine("one two three four five")) as (s, client):
        stream = await client.messages.create(model=MODEL, messages=ASK, max_tokens=8, stream=True)
        seen = []
        with pytest.raises(anthropic.APIStatusError) as info:
            async for event in stream:
                seen.append(event.type)
        assert seen[:2] == ["message_start", "content_block_start"]
        assert info.value.body["type"] == "error"  # type: ignore[index]
        assert "GPU caught fire" in info.value.body["error"]["message"]  # type: ignore[index]
        status, body, headers = await s.post("/v1/messages", {**READY, "model": "nope"})
        assert status == 404 and body["error"]["type"] == "not_found_error"
        assert body["request_id"] is None and "request-id" not in headers


async def test_an_image_block_is_the_same_tokens_and_blocks_as_chats_image_url() -> None:
    png = synthetic_png(seed=7)
    block = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": data_url(png).split(",")[1],
        },
    }
    text = {"type": "text", "text": "What is in this picture? Describe it in detail please."}
    mocker = MockerConfig(
        speedup_ratio=0,
        block_size=4,
        tokenizer=f"gguf:{smollm2_gguf()}",
        model_name=MODEL,
        mm_num_tokens_per_image=8,
    )
    async with _stack(MockerEngine(mocker)) as (s, client):
        chat_client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="x", max_retries=0)
        image_url = {"type": "image_url", "image_url": {"url": data_url(png)}}
        chat = await chat_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [image_url, text]}],  # type: ignore[list-item]
            max_tokens=2,
        )
        assert chat.usage is not None
        turn = [{"role": "user", "content": [block, text]}]
        counted = await client.messages.count_tokens(model=MODEL, messages=turn)  # type: ignore[arg-type]
        assert counted.input_tokens == chat.usage.prompt_tokens
        message = await client.messages.create(model=MODEL, messages=turn, max_tokens=2)  # type: ignore[arg-type]
        usage = message.usage
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
        assert (usage.cache_read_input_tokens or 0) >= chat.usage.prompt_tokens - 4

        assert s.http is not None
        async with s.http.get(f"{s.base}/openapi.json") as resp:
            doc = await resp.json()
        op = doc["paths"]["/v1/messages"]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        validator = jsonschema.Draft202012Validator({**schema, "components": doc["components"]})
        validator.validate({"model": MODEL, "messages": turn, "max_tokens": 2})
        assert "post" in doc["paths"]["/v1/messages/count_tokens"]


async def test_the_same_prompt_is_the_same_tokens_as_chat_and_reads_its_cache() -> None:
    """Routing equivalence: a Messages request and its chat twin render the same prompt, so the
    second finds the first's blocks cached (the KV router and the prefix cache key on the same
    token ids); count_tokens counts that prompt. Also x-api-key, and refusals in Anthropic's
    shape: a wrong key (401), an unknown model (404), an unknown beta or version (400)."""
    mocker = MockerConfig(
        speedup_ratio=0, block_size=4, tokenizer=f"gguf:{smollm2_gguf()}", model_name=MODEL
    )
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        await s.add_worker(MockerEngine(mocker))
        await s.start_frontend(READY, api_keys=(KEY,))
        chat_client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key=KEY, max_retries=0)
        client = anthropic.AsyncAnthropic(base_url=s.base, api_key=KEY, max_retries=0)
        await exit_stack.enter_async_context(chat_client)
        await exit_stack.enter_async_context(client)
        system = "You are a careful assistant who answers in one sentence."
        chat = await chat_client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": system}, *ASK], max_tokens=2
        )
        assert chat.usage is not None
        prompt_tokens = chat.usage.prompt_tokens
        counted = await client.messages.count_tokens(model=MODEL, system=system, messages=ASK)  # type: ignore[arg-type]
        assert counted.input_tokens == prompt_tokens
        message = await client.messages.create(
            model=MODEL,
            system=system,
            messages=ASK,
            max_tokens=2,  # type: ignore[arg-type]
        )
        cached = message.usage.cache_read_input_tokens or 0
        assert message.usage.input_tokens + cached == prompt_tokens
        assert cached >= prompt_tokens - 4  # every full block (block_size 4)

        bad = anthropic.AsyncAnthropic(base_url=s.base, api_key="nope", max_retries=0)
        await exit_stack.enter_async_context(bad)
        with pytest.raises(anthropic.AuthenticationError) as auth:
            await bad.messages.create(model=MODEL, messages=ASK, max_tokens=2)  # type: ignore[arg-type]
        assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.messages.create(model="nope", messages=ASK, max_tokens=2)  # type: ignore[arg-type]
        assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        for header, value in (
            ("anthropic-beta", "context-1m-2025-08-07"),
            ("anthropic-version", "2022-01-01"),
        ):
            with pytest.raises(anthropic.BadRequestError) as refused:
                await client.messages.create(
                    model=MODEL,
                    messages=ASK,  # type: ignore[arg-type]
                    max_tokens=2,
                    extra_headers={header: value},
                )
            body = refused.value.body
            assert body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
            assert value in body["error"]["message"]  # type: ignore[index]
