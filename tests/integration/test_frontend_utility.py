"""Utility routes on a real frontend with a mocker worker: /tokenize and /detokenize (vLLM's
shapes), GET /v1/models/{id}, X-Request-ID, and /openapi.json, whose generated schemas the
real responses must validate against."""

from __future__ import annotations

import json
import logging
from contextlib import AsyncExitStack
from typing import Any

import jsonschema
import openai
import pytest
from tests.support.frontend_stack import CHAT, COMPLETIONS, FrontendStack
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.tokens.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def _stack(exit_stack: AsyncExitStack) -> FrontendStack:
    s = FrontendStack(exit_stack)
    config = MockerConfig(num_blocks=256, block_size=16, speedup_ratio=0)
    await s.add_worker(MockerEngine(config))
    await s.start_frontend(CHAT_BODY)
    return s


async def _request(
    s: FrontendStack,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, dict[str, str]]:
    assert s.http is not None
    data = None if body is None else json.dumps(body).encode()
    async with s.http.request(method, f"{s.base}{path}", data=data, headers=headers) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text), dict(resp.headers)
        except ValueError:
            return resp.status, text, dict(resp.headers)


async def test_tokenize_and_detokenize_round_trip_like_vllm() -> None:
    tok = load_tokenizer(f"gguf:{smollm2_gguf()}")
    async with AsyncExitStack() as exit_stack:
        s = await _stack(exit_stack)
        status, body, _ = await s.post("/tokenize", {"model": MODEL, "prompt": "Hello world"})
        assert status == 200, body
        assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
        assert body["max_model_len"] > 0
        chat = {"model": MODEL, "messages": CHAT_BODY["messages"], "return_token_strs": True}
        status, templated, _ = await s.post("/tokenize", chat)
        assert status == 200 and templated["count"] > body["count"]  # the template's tokens
        assert "".join(templated["token_strs"]).startswith("<|im_start|>")
        no_prompt = {**chat, "add_generation_prompt": False}
        status, shorter, _ = await s.post("/tokenize", no_prompt)
        assert shorter["count"] < templated["count"]
        status, text, _ = await s.post("/detokenize", {"model": MODEL, "tokens": body["tokens"]})
        assert status == 200 and text == {"prompt": "Hello world"}
        status, err, _ = await s.post("/detokenize", {"model": MODEL, "tokens": [1, 10**6]})
        assert status == 400 and err["error"]["param"] == "tokens[1]"
        status, err, _ = await s.post("/tokenize", {"model": MODEL})
        assert status == 400 and "exactly one of prompt and messages" in err["error"]["message"]


async def test_models_by_id_and_unknown_ids_get_openai_404s() -> None:
    async with AsyncExitStack() as exit_stack:
        s = await _stack(exit_stack)
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="x", max_retries=0)
        model = await client.models.retrieve(MODEL)
        assert model.id == MODEL and model.object == "model" and model.owned_by == "tandem"
        with pytest.raises(openai.NotFoundError) as info:
            await client.models.retrieve("org/other-model")
        error = info.value.body
        assert isinstance(error, dict) and error["code"] == "model_not_found"
        assert "org/other-model" in error["message"]


async def test_x_request_id_is_echoed_used_as_the_id_and_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with AsyncExitStack() as exit_stack:
        s = await _stack(exit_stack)
        headers = {"X-Request-ID": "trace-abc.123"}
        with caplog.at_level(logging.DEBUG, logger="tandem"):
            status, body, got = await _request(s, "POST", CHAT, {**CHAT_BODY, "user": "u"}, headers)
        assert status == 200 and got["X-Request-ID"] == "trace-abc.123"
        assert body["id"] == "chatcmpl-trace-abc.123"
        assert "request_id=chatcmpl-trace-abc.123" in caplog.text
        status, _, got = await _request(s, "GET", "/v1/models", None, headers)
        assert status == 200 and got["X-Request-ID"] == "trace-abc.123"
        for bad in ("x" * 129, "has space", "tab\there"):
            status, err, _ = await _request(s, "POST", CHAT, CHAT_BODY, {"X-Request-ID": bad})
            assert status == 400 and err["error"]["param"] == "X-Request-ID", bad


def _validator(doc: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


async def test_openapi_is_generated_for_every_route_and_real_bodies_validate() -> None:
    async with AsyncExitStack() as exit_stack:
        s = await _stack(exit_stack)
        status, doc, _ = await _request(s, "GET", "/openapi.json")
        assert status == 200 and doc["openapi"].startswith("3.1")
        # the document is built from the app's route table: every route is listed, and one
        # without a RouteDoc (a route added without documenting it) shows as undocumented
        assert "(undocumented)" not in json.dumps(doc)
        app_routes = {("POST", "/v1/chat/completions"), ("GET", "/v1/models/{model}")}
        others = {("POST", "/tokenize"), ("GET", "/openapi.json"), ("POST", "/v1/embeddings")}
        others |= {("POST", "/v1/responses"), ("DELETE", "/v1/responses/{response_id}")}
        for method, path in app_routes | others:
            assert method.lower() in doc["paths"][path], path
        samples = [
            ("POST", "/v1/chat/completions", {**CHAT_BODY, "logprobs": True, "top_logprobs": 2}),
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2}),
            ("POST", "/tokenize", {"model": MODEL, "prompt": "a b"}),
            ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2]}),
            ("POST", "/v1/embeddings", {"model": MODEL, "input": ["a", "b"]}),
            ("POST", "/v1/embeddings", {"model": MODEL, "input": "a", "encoding_format": "base64"}),
            ("GET", "/v1/models", None),
            ("GET", f"/v1/models/{MODEL}", None),
        ]
        for method, path, body in samples:
            op = doc["paths"]["/v1/models/{model}" if path.startswith("/v1/models/") else path]
            op = op[method.lower()]
            if body is not None:
                _validator(
                    doc, op["requestBody"]["content"]["application/json"]["schema"]
                ).validate(body)
            status, got, _ = await _request(s, method, path, body)
            assert status == 200, got
            schema = op["responses"]["200"]["content"]["application/json"]["schema"]
            _validator(doc, schema).validate(got)
        for path, body in [
            (CHAT, {**CHAT_BODY, "logprobs": True, "top_logprobs": 1}),
            (COMPLETIONS, {"model": MODEL, "prompt": "a", "max_tokens": 2, "logprobs": 1}),
        ]:
            stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            status, events, _ = await _request(s, "POST", path, stream_body)
            assert status == 200 and events.endswith("data: [DONE]\n\n")
            chunk_schema = doc["paths"][path]["post"]["responses"]["200"]["content"]
            validator = _validator(doc, chunk_schema["text/event-stream"]["x-sse-data"])
            chunks = [e.removeprefix("data: ") for e in events.split("\n\n") if e]
            for chunk in chunks[:-1]:
                validator.validate(json.loads(chunk))
        status, err, _ = await _request(s, "POST", COMPLETIONS, {"model": MODEL, "prompt": 5})
        assert status == 400
        error_schema = doc["paths"]["/v1/completions"]["post"]["responses"]["default"]
        _validator(doc, error_schema["content"]["application/json"]["schema"]).validate(err)


async def test_an_x_request_id_already_in_flight_is_refused() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        config = MockerConfig(num_blocks=256, block_size=16, speedup_ratio=1.0)
        await s.add_worker(MockerEngine(config))
        await s.start_frontend(CHAT_BODY)
        assert s.http is not None
        headers = {"X-Request-ID": "dup-1"}
        long = {**CHAT_BODY, "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with s.http.post(f"{s.base}{CHAT}", json=long, headers=headers) as held:
            assert held.status == 200
            await held.content.readline()  # in flight now
            status, err, _ = await _request(s, "POST", CHAT, CHAT_BODY, headers)
            assert status == 400 and err["error"]["param"] == "X-Request-ID"
            assert "already in flight" in err["error"]["message"]
            await held.read()
        status, _, _ = await _request(s, "POST", CHAT, CHAT_BODY, headers)
        assert status == 200  # the id is free again once its request ended
