"""`POST /inference/v1/generate` (tokens in, tokens out) and the render endpoints on mocker
workers in one process (memory discovery/events, TCP request plane): KV-aware routing sees
the ids, a worker lost mid-stream is migrated, disaggregated prefill/decode serves it, and bad
input is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import msgspec
import pytest
from tests.integration.test_frontend_openai import SCRIPT
from tests.integration.test_frontend_openai import _start as start_fake_workers
from tests.integration.test_frontend_utility import _validator
from tests.support.eventually import eventually
from tests.support.frontend_stack import COMPLETIONS, FrontendStack, start_frontend_task
from tests.support.smollm2 import smollm2_mocker

from tandem.disagg.config import DisaggRouteConfig, DisaggWorkerConfig
from tandem.disagg.worker_engine import DisaggEngine
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.frontend.config import FrontendConfig
from tandem.protocols.tokens_generate import (
    UNSUPPORTED_SAMPLING,
    GenerateRequest,
    GenerateResponse,
)

pytestmark = pytest.mark.timeout(60)
GENERATE = "/inference/v1/generate"
MODEL = "smollm2"
PROMPT = list(range(1000, 1064))  # four 16-token blocks
_response = msgspec.json.Decoder(GenerateResponse)


def mocker() -> MockerEngine:
    return smollm2_mocker(MODEL)


def body(token_ids: list[int] = PROMPT, **sampling: Any) -> dict[str, Any]:
    params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, **sampling}
    return {"model": MODEL, "token_ids": token_ids, "sampling_params": params}


def events(text: str) -> list[GenerateResponse]:
    lines = [x.removeprefix("data: ") for x in text.split("\n\n") if x.startswith("data: ")]
    assert lines[-1] == "[DONE]", text
    return [_response.decode(x) for x in lines[:-1]]


async def test_ids_in_ids_out_routed_by_kv_streamed_and_rendered() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        workers = [await s.add_worker(mocker()), await s.add_worker(mocker())]
        await s.start_frontend(body(), ready_path=GENERATE, router_policy="kv")
        status, first, _ = await s.post(GENERATE, {**body(), "request_id": "mine-1"})
        assert status == 200, first
        got = _response.decode(json.dumps(first))
        assert got.request_id == "mine-1" and got.model == MODEL
        [choice] = got.choices
        assert len(choice.token_ids) == 4 and choice.finish_reason == "length"
        assert choice.logprobs is None and "text" not in json.dumps(first)
        assert got.usage is not None and got.usage.prompt_tokens == len(PROMPT)
        # the same prefix again: the router sends it where its blocks are cached
        await eventually(lambda: any(w.engine.load().num_cached_blocks for w in workers))
        status, second, _ = await s.post(GENERATE, body([*PROMPT, 7, 8, 9]))
        details = second["usage"]["prompt_tokens_details"]
        assert status == 200 and details["cached_tokens"] >= 48, second

        # streamed: one event per engine chunk with its new ids, then usage, then [DONE]
        stream = {**body(), "stream": True, "stream_options": {"include_usage": True}}
        status, text, headers = await s.post(GENERATE, stream)
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        chunks = events(text)
        ids = [t for c in chunks for ch in c.choices for t in ch.token_ids]
        assert ids == choice.token_ids
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4

        # n choices, each with its ids; the completions endpoint given the ids as its prompt
        # sends the same engine request (the mocker is greedy-deterministic per prompt)
        status, two, _ = await s.post(GENERATE, body(n=2))
        assert [c["index"] for c in two["choices"]] == [0, 1]
        status, text_answer, _ = await s.post(
            COMPLETIONS, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        )
        assert status == 200 and text_answer["usage"]["completion_tokens"] == 4

        # render: the completions body as the tokens-in request, which generates the same ids
        status, rendered, _ = await s.post(
            "/v1/completions/render",
            {"model": MODEL, "prompt": [PROMPT, PROMPT[:20]], "max_tokens": 4, "temperature": 0},
        )
        assert status == 200, rendered
        requests = msgspec.json.decode(json.dumps(rendered), type=list[GenerateRequest])
        assert [r.token_ids for r in requests] == [PROMPT, PROMPT[:20]]
        assert requests[0].sampling_params.max_tokens == 4
        status, again, _ = await s.post(GENERATE, {**rendered[0], "sampling_params": {
            **rendered[0]["sampling_params"], "ignore_eos": True}})  # fmt: skip
        assert status == 200 and again["choices"][0]["token_ids"] == choice.token_ids
        # what render cannot express is a 400 naming it; a bad body is chat's own 400
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        for path, extra, param in (
            ("/v1/completions/render", {"prompt": "a", "echo": True}, "echo"),
            ("/v1/completions/render", {"prompt": "a", "best_of": 2}, "best_of"),
            ("/v1/chat/completions/render", {**chat, "temperature": 7}, "temperature"),
            ("/v1/chat/completions/render", {**chat, "response_format": {"type": "json_object"}},
             "response_format"),
        ):  # fmt: skip
            status, error, _ = await s.post(path, {"model": MODEL, **extra})
            assert status == 400 and error["error"]["param"] == param, error

        # cache_salt: another salt shares no cached block, the same salt does
        salted = [await s.post(GENERATE, {**body(), "cache_salt": "s1"}) for _ in range(2)]
        cached = [out["usage"]["prompt_tokens_details"]["cached_tokens"] for _, out, _ in salted]
        assert cached[0] == 0 and cached[1] >= 48, cached


async def test_openapi_documents_the_routes_and_real_bodies_validate() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        await s.add_worker(mocker())
        await s.start_frontend(body(), ready_path=GENERATE)
        status, text = await s.get("/openapi.json")
        doc = json.loads(text)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        samples = [
            (GENERATE, body(logprobs=2)),
            ("/v1/completions/render", {"model": MODEL, "prompt": ["a b", "c"], "max_tokens": 3}),
            ("/v1/chat/completions/render", chat),
        ]
        for path, sent in samples:
            op = doc["paths"][path]["post"]
            assert "(undocumented)" not in op["summary"]
            _validator(doc, op["requestBody"]["content"]["application/json"]["schema"]).validate(
                sent
            )
            status, got, _ = await s.post(path, sent)
            assert status == 200, got
            ok = op["responses"]["200"]["content"]
            _validator(doc, ok["application/json"]["schema"]).validate(got)
        status, text, _ = await s.post(GENERATE, {**body(logprobs=1), "stream": True})
        ok = doc["paths"][GENERATE]["post"]["responses"]["200"]["content"]
        chunk = _validator(doc, ok["text/event-stream"]["x-sse-data"])
        for event in text.split("\n\n")[:-2]:  # each but the [DONE]
            chunk.validate(json.loads(event.removeprefix("data: ")))


async def test_a_worker_lost_mid_stream_is_migrated() -> None:
    async with AsyncExitStack() as stack:
        # the first worker to serve a request dies after 5 tokens; one death allowed
        s = await start_fake_workers(stack, 2, migration_limit=1, die_after=5, deaths={"left": 1})
        script_ids = s.tokenizer.encode(SCRIPT)
        prompt = [7] * len(script_ids)
        base = s.base_url.removesuffix("/v1")
        async with aiohttp.ClientSession() as http:
            req = {"model": MODEL, "token_ids": prompt, "sampling_params": {"max_tokens": 20}}
            async with http.post(f"{base}{GENERATE}", json={**req, "stream": True}) as resp:
                text = await resp.text()
        ids = [t for c in events(text) for ch in c.choices for t in ch.token_ids]
        assert ids == script_ids[:20]
        served = [r for w in s.workers for r in w.requests]
        [moved] = [r for r in served if r.request_id.endswith("-m1")]
        assert moved.token_ids == prompt + script_ids[:5] and moved.stop.max_tokens == 15


async def test_disaggregated_prefill_and_decode_serve_it() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        engines = {}
        for mode, component in (("prefill", "prefill"), ("decode", "backend")):
            engine = DisaggEngine(mocker(), DisaggWorkerConfig(mode=mode, backends=("shm", "tcp")))
            worker = Worker(engine, await s.runtime(), WorkerConfig(component=component))
            await worker.start()
            exit_stack.push_async_callback(worker.stop, 0)
            engines[mode] = engine
        await s.start_frontend(body(), ready_path=GENERATE, disagg=DisaggRouteConfig(enabled=True))
        status, out, _ = await s.post(GENERATE, body(max_tokens=6))
        assert status == 200 and len(out["choices"][0]["token_ids"]) == 6, out
        prefill_agent = engines["prefill"].agent
        assert prefill_agent is not None and prefill_agent.stats.num_created >= 2


BAD_INPUT = [  # (what the body changes, the param named, a word of the message)
    ({"token_ids": [1, 2, 10**6]}, "token_ids", "1000000"),
    ({"token_ids": [1, -3]}, "token_ids", "-3"),
    ({"token_ids": []}, "token_ids", "empty"),
    ({"token_ids": [5] * 9000}, "token_ids", "9000"),  # over the context (8192)
    ({"sampling_params": {"max_tokens": 4, "min_pp": 0.1}}, "sampling_params.min_pp", "min_pp"),
    ({"sampling_params": {"min_p": 0.1}}, "sampling_params.min_p", "0.1"),
    ({"sampling_params": {"temperature": 9}}, "sampling_params.temperature", "9"),
    ({"sampling_params": {"n": 500}}, "sampling_params.n", "500"),
    ({"sampling_params": {"output_kind": 7}}, "sampling_params.output_kind", "7"),
    ({"sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens", "0"),
    ({"sampling_params": {"logprobs": -1}}, "sampling_params.logprobs", "-1"),
    ({"sampling_params": {"stop_token_ids": [10**6]}}, "stop_token_ids[0]", "1000000"),
    ({"sampling_params": {"stop": ["x"], "detokenize": False}}, "sampling_params.stop", "x"),
    ({"prompt": [1, 2]}, "prompt", "prompt"),
    ({"features": {"mm_hashes": {}}}, "features", "features"),
    ({"priority": 3}, "priority", "3"),
    ({"request_id": "has space"}, "request_id", "has space"),
    ({"model": "other"}, "model", "other"),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params", "--disagg"),
    ({"cache_salt": ""}, "cache_salt", "''"),
]
# a value vLLM defines that asks for something tandem does not do, per sampling field
REFUSED_SAMPLING = {
    "min_p": 0.1,
    "prompt_logprobs": 1,
    "allowed_token_ids": [1, 2],
    "bad_words": ["cat"],
    "structured_outputs": {"regex": "a+"},
    "logits_processors": ["my.processor"],
    "extra_args": {"x": 1},
    "truncate_prompt_tokens": 8,
    "flat_logprobs": True,
    "logprob_token_ids": [3],
    "prompt_logprob_token_ids": [[3]],
    "prompt_logprob_start": 2,
    "stream_interval": 4,
    "skip_reading_prefix_cache": True,
    "thinking_token_budget": 100,
    "repetition_detection": {"max_pattern_size": 4},
    "routed_experts_prompt_start": 5,
    "trace_decode_token_ids": [3],
    "watermarking": {"key": 1},
    "output_text_buffer_length": 3,
}


async def test_bad_input_is_a_400_naming_the_field() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        await s.add_worker(mocker())
        await s.start_frontend(body(), ready_path=GENERATE)
        for change, param, named in BAD_INPUT:
            status, error, _ = await s.post(GENERATE, {**body(), **change})
            assert status in (400, 404), (change, error)
            assert (error["error"]["param"] or "").endswith(param), (change, error)
            assert named in error["error"]["message"], (change, error)
        assert set(REFUSED_SAMPLING) == set(UNSUPPORTED_SAMPLING)
        for name, value in REFUSED_SAMPLING.items():
            status, error, _ = await s.post(GENERATE, body(**{name: value}))
            assert status == 400 and error["error"]["param"] == f"sampling_params.{name}", error
            assert "not supported" in error["error"]["message"], error
        # vLLM's SamplingParams() as msgspec encodes it (vLLM 0.32), and other defaults
        defaults = {"stop": [], "stop_token_ids": [], "bad_words": []}
        defaults |= {"skip_reading_prefix_cache": False, "min_p": 0.0, "flat_logprobs": False}
        defaults |= {"skip_clone": True, "stream_interval": 1, "routed_experts_prompt_start": 0}
        status, out, _ = await s.post(GENERATE, body(**defaults))
        assert status == 200, out
        # msgspec.json.encode of vLLM 0.32's SamplingParams(max_tokens=4, temperature=0.0,
        # seed=3, logprobs=1, stop_token_ids=[2]): vLLM's internal fields ride along
        vllm_encoded = (
            b'{"temperature":0.0,"seed":3,"stop":[],"stop_token_ids":[2],"max_tokens":4,'
            b'"logprobs":1,"_all_stop_token_ids":[2],"bad_words":[],'
            b'"skip_reading_prefix_cache":false}'
        )
        raw = b'{"token_ids":[1,2,3],"sampling_params":' + vllm_encoded + b"}"
        status, out, _ = await s.post(GENERATE, raw)
        assert status == 200 and len(out["choices"][0]["token_ids"]) <= 4, out
        assert await s.inflight_on_workers() in ([], [0.0])


async def test_the_routes_need_an_api_key_when_keys_are_configured() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        await s.add_worker(mocker())
        s.base, s.http = await start_frontend_task(
            exit_stack, await s.runtime(), FrontendConfig(port=0, api_keys=("k1",))
        )
        assert s.http is not None
        for path, sent in (
            (GENERATE, body()),
            ("/v1/completions/render", {"model": MODEL, "prompt": "a"}),
            ("/v1/chat/completions/render", {"model": MODEL, "messages": []}),
        ):
            status, error, _ = await s.post(path, sent)
            assert status == 401 and error["error"]["code"] == "invalid_api_key", error
        async with asyncio.timeout(30):
            while True:  # the worker is discovered
                async with s.http.post(
                    f"{s.base}{GENERATE}", json=body(), headers={"Authorization": "Bearer k1"}
                ) as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.05)
