"""Frontend + fake workers in one process (memory discovery/events, TCP request plane),
driven by the official `openai` SDK."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import aiohttp
import openai
import pytest
from tests.support.smollm2 import smollm2_gguf

from tandem.frontend.config import FrontendConfig
from tandem.frontend.serve import serve_frontend
from tandem.protocols.discovery import ModelCard
from tandem.protocols.engine import EngineOutput, TopLogprob, decode_request, encode
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import Runtime, open_runtime
from tandem.tokens.tokenizer import ModelTokenizer, load_tokenizer

MODEL = "smollm2"
ALT_TOKEN = 28  # any id; the fake worker's second-best alternative
SCRIPT = "Hello world! The answer is 42. STOP here, then more text ✓ 日本 follows and follows."


@dataclass
class FakeWorker:
    """Streams SCRIPT's tokens (cycling), one per chunk; records what it saw."""

    tokenizer: ModelTokenizer
    delay_s: float = 0.0
    die_after: int | None = None  # stop this worker's server after this many tokens
    fail_after: int | None = None  # an engine error output after this many tokens
    deaths: dict = field(default_factory=lambda: {"left": 0})  # shared death budget
    runtime: Runtime | None = None
    requests: list = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    finished: list = field(default_factory=list)

    async def handler(self, payload: bytes, ctx) -> AsyncIterator[bytes]:
        req = decode_request(payload)
        self.requests.append(req)
        script = self.tokenizer.encode(SCRIPT)
        done = False
        try:
            yield encode(EngineOutput(num_cached_tokens=len(req.token_ids) // 2))
            for i in range(req.stop.max_tokens):
                if i == self.die_after and self.runtime and self.deaths["left"] > 0:
                    self.deaths["left"] -= 1
                    asyncio.get_running_loop().call_soon(
                        asyncio.ensure_future, self.runtime.server.stop(0.0)
                    )
                    await asyncio.Event().wait()
                if i == self.fail_after:
                    yield encode(EngineOutput(finish_reason="error", error="the engine broke"))
                    return
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i + 1 == req.stop.max_tokens
                tok = script[(len(req.token_ids) + i) % len(script)]
                out = EngineOutput(token_ids=[tok], finish_reason="length" if last else None)
                if req.sampling.logprobs is not None:  # fake but checkable: -(i+1)/8 per token
                    out.logprobs = [-(i + 1) / 8]
                    out.top_logprobs = [
                        [TopLogprob(tok, -(i + 1) / 8), TopLogprob(ALT_TOKEN, -(i + 9) / 8)][
                            : req.sampling.logprobs
                        ]
                    ]
                yield encode(out)
            done = True
        finally:
            self.finished.append((req.request_id, done))
            if not done:
                self.cancelled.set()


@dataclass
class Stack:
    base_url: str
    workers: list[FakeWorker]
    tokenizer: ModelTokenizer

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="x", max_retries=0)


async def _start(
    stack: AsyncExitStack, num_workers: int = 1, *, migration_limit: int = 0, **worker_kw
) -> Stack:
    tok = load_tokenizer(f"gguf:{smollm2_gguf()}")
    discovery, events = MemoryDiscovery(), MemoryEventBus()
    card = ModelCard(
        name=MODEL,
        context_length=512,
        block_size=16,
        num_total_blocks=1024,
        tokenizer=f"gguf:{smollm2_gguf()}",
    )
    workers = []
    for _ in range(num_workers):
        rt = await stack.enter_async_context(
            open_runtime(RuntimeConfig(), discovery=discovery, events=events)
        )
        worker = FakeWorker(tok, runtime=rt, **worker_kw)
        await rt.serve_endpoint("backend", "generate", worker.handler, model=card)
        workers.append(worker)
    front_rt = await stack.enter_async_context(
        open_runtime(RuntimeConfig(), discovery=discovery, events=events)
    )
    ready, stop, bound = asyncio.Event(), asyncio.Event(), []
    config = FrontendConfig(port=0, migration_limit=migration_limit)
    task = asyncio.create_task(
        serve_frontend(config, front_rt, ready=ready, stop=stop, bound=bound)
    )

    async def shutdown() -> None:
        stop.set()
        await task

    stack.push_async_callback(shutdown)
    await asyncio.wait_for(ready.wait(), 10)
    host, port = bound[0]
    base = f"http://{host}:{port}/v1"
    async with aiohttp.ClientSession() as http:  # wait until the workers are discovered
        for _ in range(500):
            async with http.get(f"http://{host}:{port}/health") as resp:
                if resp.status == 200:
                    break
            await asyncio.sleep(0.01)
    return Stack(base, workers, tok)


@pytest.mark.timeout(30)
async def test_chat_stream_with_usage_and_models() -> None:
    async with AsyncExitStack() as stack:
        s = await _start(stack)
        client = s.client()
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        req = s.workers[0].requests[0]
        expected_ids = s.tokenizer.encode(SCRIPT)
        n = len(req.token_ids)
        assert text == s.tokenizer.decode(
            [expected_ids[(n + i) % len(expected_ids)] for i in range(8)]
        )
        assert finish == "length"
        assert usage.completion_tokens == 8
        assert usage.prompt_tokens == n
        assert usage.prompt_tokens_details.cached_tokens == n // 2
        assert req.token_ids[-4:] == s.tokenizer.encode("<|im_start|>assistant\n")
        url = s.base_url.removesuffix("/v1") + "/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            metrics = await resp.text()
        line = 'tandem_frontend_requests_total{model="smollm2",endpoint="chat_completions",'
        assert line + 'request_type="stream",status="success",status_code="200"} 1' in metrics
        assert 'tandem_frontend_output_tokens_total{model="smollm2"} 8' in metrics
        assert "tandem_frontend_time_to_first_token_seconds_count" in metrics
        assert 'tandem_frontend_worker_load{model="smollm2"' in metrics


@pytest.mark.timeout(30)
async def test_a_burst_of_tokens_streams_as_one_chunk_each_with_its_own_usage() -> None:
    """The fake worker sends its tokens back to back, so they reach the frontend in bursts
    that are handed on in batches. Each token is still its own chunk, and with
    continuous_usage_stats each chunk counts the tokens up to itself (not its batch's)."""
    async with AsyncExitStack() as stack:
        s = await _start(stack)
        stream = await s.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
        counts = [c.usage.completion_tokens async for c in stream if c.choices and c.usage]
        # strictly rising to 24 (a token ending inside a UTF-8 character has no chunk)
        assert counts[-1] == 24 and len(counts) >= 20
        assert all(a < b for a, b in itertools.pairwise(counts))


@pytest.mark.timeout(30)
async def test_an_engine_error_after_a_burst_streams_the_tokens_before_it() -> None:
    """An engine error that arrives in the same burst as tokens: those tokens' chunks still
    go out, then the error event."""
    async with AsyncExitStack() as stack:
        s = await _start(stack, fail_after=5)
        url, body = f"{s.base_url}/completions", {"model": MODEL, "prompt": [7] * 8}
        async with (
            aiohttp.ClientSession() as http,
            http.post(url, json={**body, "max_tokens": 20, "stream": True}) as resp,
        ):
            events = [line async for line in resp.content if line.startswith(b"data: {")]
        texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
        script = s.tokenizer.encode(SCRIPT)
        assert "".join(texts) == s.tokenizer.decode(script[8:13])
        assert b"the engine broke" in events[-1] and b'"error"' in events[-1]


@pytest.mark.timeout(30)
async def test_completions_text_and_token_prompts_n2_and_stop() -> None:
    async with AsyncExitStack() as stack:
        s = await _start(stack)
        client = s.client()
        script_ids = s.tokenizer.encode(SCRIPT)
        # prompt ids chosen so the worker starts the script at position 0
        prompt = [7] * len(script_ids)
        out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=2)
        assert [c.index for c in out.choices] == [0, 1]
        assert all(c.text == s.tokenizer.decode(script_ids[:12]) for c in out.choices)
        assert out.usage.completion_tokens == 24
        # stop string spanning token boundaries: nothing after it is emitted
        out = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, stop=["STOP"]
        )
        assert out.choices[0].text == "Hello world! The answer is 42. "
        assert out.choices[0].finish_reason == "stop"
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, stop=["is 4"], stream=True
        )
        pieces = [c.choices[0].text async for c in stream if c.choices]
        assert "".join(pieces) == "Hello world! The answer "


@pytest.mark.timeout(30)
async def test_errors_bad_field_unknown_model_context() -> None:
    async with AsyncExitStack() as stack:
        s = await _start(stack)
        client = s.client()
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=5
            )
        assert bad.value.body["param"] == "temperature"
        assert "temperature=5" in bad.value.body["message"]
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(
                model=MODEL, prompt="x", extra_body={"max_tokens": "lots"}
            )
        assert bad.value.body["param"] == "max_tokens" and "'lots'" in bad.value.body["message"]
        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="gpt-9", prompt="x")
        assert "gpt-9" in missing.value.body["message"]
        with pytest.raises(openai.BadRequestError) as long:
            await client.completions.create(model=MODEL, prompt=[5] * 600)
        assert long.value.body["message"] == "prompt has 600 tokens; model context is 512"


@pytest.mark.timeout(30)
async def test_client_disconnect_cancels_worker_request() -> None:
    async with AsyncExitStack() as stack:
        s = await _start(stack, delay_s=0.01)
        client = s.client()
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=400, stream=True
        )
        got = 0
        async for _chunk in stream:
            got += 1
            if got == 3:
                break
        await stream.close()
        await asyncio.wait_for(s.workers[0].cancelled.wait(), 5)
        assert s.workers[0].finished[0][1] is False


@pytest.mark.timeout(30)
async def test_migration_continues_stream_on_another_worker() -> None:
    async with AsyncExitStack() as stack:
        # the first worker to serve a request dies after 5 tokens; only one death allowed
        s = await _start(stack, 2, migration_limit=1, die_after=5, deaths={"left": 1})
        client = s.client()
        script_ids = s.tokenizer.encode(SCRIPT)
        prompt = [7] * len(script_ids)
        out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
        assert out.choices[0].text == s.tokenizer.decode(script_ids[:20])
        assert out.usage.completion_tokens == 20
        served = [r for w in s.workers for r in w.requests]
        assert len(served) == 2
        [moved] = [r for r in served if r.request_id.endswith("-m1")]
        assert moved.stop.max_tokens == 15
        assert moved.token_ids == prompt + script_ids[:5]


@pytest.mark.timeout(30)
async def test_logprobs_reach_the_client_in_chat_stream_and_completions() -> None:
    async with AsyncExitStack() as stack:
        st = await _start(stack)
        alt = st.tokenizer.decode([ALT_TOKEN])
        chunks = await st.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            logprobs=True,
            top_logprobs=2,
        )
        entries = []
        async for chunk in chunks:
            for choice in chunk.choices:
                if choice.logprobs and choice.logprobs.content:
                    entries += choice.logprobs.content
        assert [e.logprob for e in entries] == [-1 / 8, -2 / 8, -3 / 8, -4 / 8]
        assert all(len(e.top_logprobs) == 2 for e in entries)
        assert all(e.top_logprobs[0].token == e.token for e in entries)
        assert all(e.top_logprobs[1].token == alt for e in entries)
        assert st.workers[0].requests[-1].sampling.logprobs == 2

        done = await st.client().completions.create(
            model=MODEL, prompt="hello", max_tokens=3, logprobs=1
        )
        lp = done.choices[0].logprobs
        assert lp is not None and lp.token_logprobs == [-1 / 8, -2 / 8, -3 / 8]
        assert "".join(lp.tokens or []) == done.choices[0].text
        assert [len(top) for top in lp.top_logprobs or []] == [1, 1, 1]

        plain = await st.client().completions.create(model=MODEL, prompt="hello", max_tokens=2)
        assert plain.choices[0].logprobs is None
        assert st.workers[0].requests[-1].sampling.logprobs is None
