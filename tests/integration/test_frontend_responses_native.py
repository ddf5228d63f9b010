"""`/v1/responses` on the real SmolLM2 (native engine) behind a real frontend, through the
official `openai` SDK: greedy output equals `/v1/chat/completions` for the same conversation
(the Responses API runs on the chat path; so does a batch of the same chat requests),
`client.responses.stream(...)` and `get_final_response()` work, `previous_response_id`
carries the conversation, and `text.format` json_schema is enforced (`client.responses.parse`)."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack

import openai
import pydantic
import pytest
from tests.support.frontend_stack import FrontendStack

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine

pytestmark = [pytest.mark.native, pytest.mark.timeout(240)]
MODEL = "smollm2"


class Capital(pydantic.BaseModel):
    city: str


async def test_responses_match_chat_stream_with_the_sdk_helper_and_continue() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        config = NativeConfig(num_blocks=256, max_num_batched_tokens=256, num_threads=1)
        engine = NativeEngine(config)
        await s.add_worker(engine)
        await s.start_frontend({"model": MODEL, "input": "hi", "max_output_tokens": 1},
                               ready_path="/v1/responses")  # fmt: skip
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="none", max_retries=0)
        exit_stack.push_async_callback(client.close)
        question = "What is the capital of France?"
        r = await client.responses.create(
            model=MODEL, input=question, instructions="Answer in one sentence.",
            temperature=0, max_output_tokens=64,
        )  # fmt: skip
        assert r.status == "completed", r
        chat = await client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=64,
            messages=[{"role": "system", "content": "Answer in one sentence."},
                      {"role": "user", "content": question}],
        )  # fmt: skip
        assert r.output_text == chat.choices[0].message.content
        assert "Paris" in r.output_text
        assert r.usage is not None and chat.usage is not None
        assert r.usage.input_tokens == chat.usage.prompt_tokens
        assert r.usage.output_tokens == chat.usage.completion_tokens
        async with client.responses.stream(
            model=MODEL, input=question, instructions="Answer in one sentence.",
            temperature=0, max_output_tokens=64,
        ) as stream:  # fmt: skip
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert final.status == "completed" and final.output_text == r.output_text
        assert "".join(deltas) == r.output_text
        follow = await client.responses.create(
            model=MODEL, input="And what is the capital of Italy?", previous_response_id=r.id,
            temperature=0, max_output_tokens=64,
        )  # fmt: skip
        chat2 = await client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=64,
            messages=[{"role": "user", "content": question},
                      {"role": "assistant", "content": r.output_text},
                      {"role": "user", "content": "And what is the capital of Italy?"}],
        )  # fmt: skip
        assert follow.output_text == chat2.choices[0].message.content
        assert "Rome" in follow.output_text
        # the batch lane (issue 33) answers both chat requests as online, greedy: its runner
        # sends each line through the same handler (checked here to share this model load)
        bodies = [
            {"model": MODEL, "temperature": 0, "max_tokens": 64,
             "messages": [{"role": "system", "content": "Answer in one sentence."},
                          {"role": "user", "content": question}]},
            {"model": MODEL, "temperature": 0, "max_tokens": 64,
             "messages": [{"role": "user", "content": question},
                          {"role": "assistant", "content": r.output_text},
                          {"role": "user", "content": "And what is the capital of Italy?"}]},
        ]  # fmt: skip
        url = "/v1/chat/completions"
        lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": url, "body": body})
                 for i, body in enumerate(bodies)]  # fmt: skip
        upload = await client.files.create(file=("q.jsonl", "\n".join(lines).encode()),
                                           purpose="batch")  # fmt: skip
        batch = await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        async with asyncio.timeout(120):
            while (batch := await client.batches.retrieve(batch.id)).status != "completed":  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert batch.output_file_id is not None and batch.error_file_id is None
        out = (await client.files.content(batch.output_file_id)).text.splitlines()
        got = {o["custom_id"]: o["response"]["body"] for o in map(json.loads, out)}
        for custom_id, online in (("q0", chat), ("q1", chat2)):
            assert got[custom_id]["choices"][0]["message"]["content"] == (
                online.choices[0].message.content
            )
        # text.format json_schema is chat's structured output: the SDK's parse() validates it
        parsed = await client.responses.parse(
            model=MODEL, input="Name the capital of France as JSON.", text_format=Capital,
            temperature=0, max_output_tokens=64,
        )  # fmt: skip
        assert parsed.status == "completed", parsed
        assert isinstance(parsed.output_parsed, Capital) and parsed.output_parsed.city
        assert engine.core is not None and engine.core.block_manager.num_active_blocks == 0
