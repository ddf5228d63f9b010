"""The real SmolLM2 native engine behind a real frontend (one process): a temperature too
small to divide the logits by (1e-38, valid per the schema) used to fail the sampler and
leave the engine dead while its worker stayed registered; now it samples greedily and the
worker keeps serving."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import pytest
from tests.support.frontend_stack import CHAT, COMPLETIONS, FrontendStack
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.tokens.tokenizer import load_tokenizer

pytestmark = [pytest.mark.native, pytest.mark.timeout(120)]
MODEL = "smollm2"


def _chat(**kw: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Name a colour."}]
    return {"model": MODEL, "messages": messages, "max_tokens": 6, "ignore_eos": True, **kw}


async def test_a_tiny_temperature_samples_greedily_and_the_engine_keeps_serving() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        config = NativeConfig(num_blocks=128, max_num_batched_tokens=256, num_threads=1)
        worker = await s.add_worker(NativeEngine(config))
        await s.start_frontend(_chat(max_tokens=1))
        status, greedy, _ = await s.post(CHAT, _chat(temperature=0))
        assert status == 200, greedy
        for temperature in (1e-38, 5e-324):
            status, tiny, _ = await s.post(CHAT, _chat(temperature=temperature, seed=7))
            assert status == 200, tiny
            assert tiny["choices"][0]["message"] == greedy["choices"][0]["message"]
        body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "temperature": 1.0}
        status, after, _ = await s.post(COMPLETIONS, body)
        assert status == 200 and after["usage"]["completion_tokens"] == 4, after
        assert await s.instance_ids(MODEL) == [worker.instance_id]
        assert not worker.failed.is_set()


def _repeats(tokens: list[str]) -> int:
    return len(tokens) - len(set(tokens))


async def test_bias_and_penalties_push_greedy_output_the_way_they_should() -> None:
    tok = load_tokenizer(f"gguf:{smollm2_gguf()}")
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        config = NativeConfig(num_blocks=128, max_num_batched_tokens=256, num_threads=1)
        await s.add_worker(NativeEngine(config))
        body = {"model": MODEL, "prompt": "Write the word cat twenty times: cat cat cat cat"}
        body |= {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        await s.start_frontend({**body, "max_tokens": 1}, ready_path=COMPLETIONS)

        async def tokens(**kw: Any) -> list[str]:
            status, resp, _ = await s.post(COMPLETIONS, {**body, **kw})
            assert status == 200, resp
            return list(resp["choices"][0]["logprobs"]["tokens"])

        greedy = await tokens()
        first_id = tok.encode(greedy[0], add_special_tokens=False)[0]
        assert tok.decode([first_id]) == greedy[0]
        banned = await tokens(logit_bias={str(first_id): -100})
        assert greedy[0] not in banned  # -100 removes the token greedy decoding would emit
        forced = await tokens(logit_bias={"42": 100})
        assert forced == [tok.decode([42], skip_special_tokens=False)] * 16  # +100 forces it
        assert _repeats(greedy) > 8, greedy
        for kw in ({"frequency_penalty": 1.5}, {"presence_penalty": 1.5}):
            assert _repeats(await tokens(**kw)) < _repeats(greedy) // 2, kw
        assert _repeats(await tokens(repetition_penalty=1.8)) < _repeats(greedy), greedy
