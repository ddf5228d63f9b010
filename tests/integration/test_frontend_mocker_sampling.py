"""Every sampling field a client sends reaches the engine: the mocker records what arrives."""

from __future__ import annotations

from contextlib import AsyncExitStack

import openai
import pytest
from tests.support.frontend_stack import FrontendStack

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"


async def test_sampling_fields_arrive_at_the_engine() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        engine = MockerEngine(MockerConfig(num_blocks=256, block_size=16, speedup_ratio=0))
        await s.add_worker(engine)
        messages = [{"role": "user", "content": "hi"}]
        await s.start_frontend({"model": MODEL, "messages": messages, "max_tokens": 1})
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="x", max_retries=0)
        resp = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=6,
            n=2,
            seed=5,
            temperature=0.7,
            top_p=0.9,
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            logit_bias={"17": -100, "42": 3},
            extra_body={
                "repetition_penalty": 1.2,
                "min_tokens": 2,
                "stop_token_ids": [99],
                "top_k": 20,
            },
        )
        assert len(resp.choices) == 2
        got = list(engine.received)[-2:]
        assert sorted(r.sampling.seed for r in got) == [5, 6]  # choice i: seed + i
        for r in got:
            sp, stop = r.sampling, r.stop
            assert (sp.temperature, sp.top_p, sp.top_k) == (0.7, 0.9, 20)
            assert (sp.presence_penalty, sp.frequency_penalty) == (0.5, -0.25)
            assert sp.repetition_penalty == 1.2
            assert sp.logit_bias == {17: -100.0, 42: 3.0}
            assert (stop.max_tokens, stop.min_tokens, stop.stop_token_ids) == (6, 2, [99])


async def test_echo_puts_each_prompt_in_front_of_its_choices_streaming_or_not() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        engine = MockerEngine(MockerConfig(num_blocks=256, block_size=16, speedup_ratio=0))
        await s.add_worker(engine)
        ready = {"model": MODEL, "prompt": "a", "max_tokens": 1}
        await s.start_frontend(ready, ready_path="/v1/completions")
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="x", max_retries=0)
        prompts = ["Hello there", "Bye now"]
        resp = await client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=3, n=2, echo=True
        )
        assert [c.text.startswith(prompts[c.index // 2]) for c in resp.choices] == [True] * 4
        stream = await client.completions.create(
            model=MODEL, prompt="Hello there", max_tokens=3, echo=True, stream=True
        )
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        assert text.startswith("Hello there") and len(text) > len("Hello there")
