"""`/v1/responses` through a real frontend to mocker workers (one process, TCP request plane),
driven by the official `openai` SDK: the Response object, the streamed events as the SDK parses
them, multi-turn through `previous_response_id` (the conversation the worker receives), the
store's `store: false`, GET and DELETE, the 400s, and an error in the middle of a stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import openai
import pytest
from tests.support.frontend_stack import FrontendStack
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.errors import EngineError
from tandem.frontend.api.responses.store import ResponseStoreConfig
from tandem.frontend.http.config import HttpConfig
from tandem.protocols.discovery import ModelCard
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    decode_request,
    encode,
    prompt_array,
)
from tandem.tokens.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"
RESPONSES = "/v1/responses"
READY = {"model": MODEL, "input": "hi", "max_output_tokens": 1}


@asynccontextmanager
async def _stack(
    **config: Any,
) -> AsyncIterator[tuple[FrontendStack, list[PreprocessedRequest], openai.AsyncOpenAI]]:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        engine = MockerEngine(MockerConfig(speedup_ratio=0))
        seen: list[PreprocessedRequest] = []
        generate = engine.generate

        def recording(request: PreprocessedRequest, **kw: Any) -> Any:
            seen.append(request)
            return generate(request, **kw)

        engine.generate = recording  # type: ignore[method-assign]
        await s.add_worker(engine)
        await s.start_frontend(READY, ready_path=RESPONSES, **config)
        seen.clear()
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="none", max_retries=0)
        exit_stack.push_async_callback(client.close)
        yield s, seen, client


async def test_a_response_object_with_usage_and_an_incomplete_status_at_max_output_tokens() -> None:
    async with _stack() as (s, seen, client):
        r = await client.responses.create(
            model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=5
        )
        assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
        assert r.status == "incomplete"  # the mocker always runs to max_tokens
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].type == "message" and r.output[0].role == "assistant"
        assert r.output_text and r.instructions == "Be brief."
        assert r.usage is not None and r.usage.output_tokens == 5
        assert r.usage.input_tokens == len(prompt_array(seen[0]).tolist())
        assert r.usage.total_tokens == r.usage.input_tokens + 5
        assert seen[0].stop.max_tokens == 5
        prompt = _text(prompt_array(seen[0]).tolist())
        assert "Be brief." in prompt and "Hello" in prompt
        assert s.workers[0].num_inflight == 0


async def test_sampling_fields_reach_the_engine() -> None:
    async with _stack() as (_, seen, client):
        await client.responses.create(
            model=MODEL, input="x", max_output_tokens=2, temperature=0.3, top_p=0.5
        )
        assert seen[0].sampling.temperature == 0.3 and seen[0].sampling.top_p == 0.5


async def test_the_sdk_parses_the_stream_and_events_come_in_openais_order() -> None:
    async with _stack() as (_, _seen, client):
        stream = await client.responses.create(
            model=MODEL, input="Hello", max_output_tokens=4, stream=True
        )
        events = [event async for event in stream]
        kinds = [e.type for e in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert deltas and kinds.count("response.output_text.delta") == len(kinds) - 8
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response  # type: ignore[union-attr]
        assert final.output_text == "".join(deltas)
        assert final.usage is not None and final.usage.output_tokens == 4


async def test_previous_response_id_continues_the_conversation_without_old_instructions() -> None:
    async with _stack() as (_, seen, client):
        first = await client.responses.create(
            model=MODEL, input="My name is Ada.", instructions="SECRET-RULE", max_output_tokens=3
        )
        second = await client.responses.create(
            model=MODEL,
            input="What is my name?",
            previous_response_id=first.id,
            max_output_tokens=3,
        )
        assert second.previous_response_id == first.id
        prompt = _text(prompt_array(seen[1]).tolist())
        order = [
            prompt.index(t) for t in ("My name is Ada.", first.output_text, "What is my name?")
        ]
        assert order == sorted(order), prompt
        assert "SECRET-RULE" not in prompt  # instructions are not carried over (as OpenAI)
        third = await client.responses.create(
            model=MODEL, input="And again?", previous_response_id=second.id, max_output_tokens=3
        )
        assert third.status == "incomplete"
        prompt = _text(prompt_array(seen[2]).tolist())
        assert all(t in prompt for t in ("My name is Ada.", second.output_text, "And again?"))


async def test_store_false_get_delete_and_unknown_ids() -> None:
    async with _stack() as (s, _seen, client):
        kept = await client.responses.create(model=MODEL, input="a", max_output_tokens=2)
        got = await client.responses.retrieve(kept.id)
        assert got.id == kept.id and got.output_text == kept.output_text
        gone = await client.responses.create(
            model=MODEL, input="b", max_output_tokens=2, store=False
        )
        assert gone.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(gone.id)
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(
                model=MODEL, input="c", previous_response_id=gone.id, max_output_tokens=2
            )
        assert err.value.code == "previous_response_not_found"
        assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
        status, err = await s.get(f"/v1/responses/{kept.id}?stream=true")
        assert status == 400 and json.loads(err)["error"]["param"] == "stream", err
        assert (await s.get(f"/v1/responses/{kept.id}?stream=false"))[0] == 200
        await client.responses.delete(kept.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(kept.id)


async def test_a_stored_response_is_invisible_to_another_api_key() -> None:
    """Ownership (issue 33): GET, DELETE and previous_response_id by a second key find
    nothing (404 / previous_response_not_found), while the owner still reads it."""
    async with _stack(api_keys=("sk-alice", "sk-bob")) as (s, _seen, _):
        alice, bob = (
            openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key=key, max_retries=0)
            for key in ("sk-alice", "sk-bob")
        )
        try:
            kept = await alice.responses.create(model=MODEL, input="secret", max_output_tokens=2)
            with pytest.raises(openai.NotFoundError):
                await bob.responses.retrieve(kept.id)
            with pytest.raises(openai.NotFoundError):
                await bob.responses.delete(kept.id)
            with pytest.raises(openai.BadRequestError) as err:
                await bob.responses.create(
                    model=MODEL, input="more", previous_response_id=kept.id, max_output_tokens=2
                )
            assert err.value.code == "previous_response_not_found"
            assert (await alice.responses.retrieve(kept.id)).output_text == kept.output_text
            await alice.responses.delete(kept.id)
        finally:
            await alice.close()
            await bob.close()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"text": {"verbosity": "low"}}, "text"),
        (
            {"text": {"format": {"type": "json_schema", "name": "n", "schema": 5}}},
            "text.format.schema",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 9000}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
            "input[0].type",
        ),
        ({"input": "word " * 9000}, "input"),
        ({"model": "nope"}, "model"),
    ],
)
async def test_bad_requests_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    async with _stack() as (s, seen, _):
        status, err, _ = await s.post(RESPONSES, {"model": MODEL, "input": "x", **body})
        assert status == (404 if param == "model" else 400), err
        assert err["error"]["param"] == param, err
        assert not seen and s.workers[0].num_inflight == 0


async def test_an_error_mid_stream_is_an_error_event_then_response_failed() -> None:
    async def failing(payload: bytes, ctx: Any) -> AsyncIterator[bytes]:
        if decode_request(payload).stop.max_tokens == 1:  # the stack's readiness probe
            yield encode(EngineOutput(token_ids=[28], finish_reason="length"))
            return
        yield encode(EngineOutput(token_ids=[28]))
        yield encode(EngineOutput(token_ids=[29]))
        raise EngineError("the engine broke")

    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        card = ModelCard(
            name=MODEL,
            context_length=4096,
            block_size=16,
            num_total_blocks=100,
            tokenizer=f"gguf:{smollm2_gguf()}",
        )
        await s.add_handler(failing, card)
        ready = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        await s.start_frontend(ready)
        status, text, headers = await s.post(
            RESPONSES, {"model": MODEL, "input": "x", "stream": True}
        )
        assert status == 200 and headers["Content-Type"] == "text/event-stream"
        events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert "the engine broke" in events[-2]["message"]
        assert events[-1]["response"]["status"] == "failed"
        assert "[DONE]" not in text
        _, metrics = await s.get("/metrics")
        failed = 'endpoint="responses",request_type="stream",status="error",status_code="200"} 1'
        assert failed in metrics
        assert 'tandem_frontend_inflight_requests{model="smollm2"} 0' in metrics
        assert 'tandem_frontend_queued_requests{model="smollm2"} 0' in metrics


_tokenizer = None


def _text(ids: list[int]) -> str:
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = load_tokenizer(f"gguf:{smollm2_gguf()}")
    return str(_tokenizer.decode(ids, skip_special_tokens=False))


async def test_the_store_keeps_at_most_its_configured_entries() -> None:
    store = ResponseStoreConfig(max_entries=2)
    async with _stack(responses_store=store) as (_, _seen, client):
        ids = [
            (await client.responses.create(model=MODEL, input=t, max_output_tokens=1)).id
            for t in ("a", "b", "c")
        ]
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(ids[0])  # least recently used, evicted
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(
                model=MODEL, input="d", previous_response_id=ids[0], max_output_tokens=1
            )
        assert err.value.code == "previous_response_not_found"
        for kept in ids[1:]:
            assert (await client.responses.retrieve(kept)).id == kept


async def test_a_replica_on_a_shared_port_says_why_a_previous_response_is_unknown() -> None:
    async with _stack(http=HttpConfig(reuse_port=True)) as (s, _seen, _):
        body = {"model": MODEL, "input": "x", "previous_response_id": "resp_elsewhere"}
        status, err, _ = await s.post(RESPONSES, body)
        assert status == 400 and err["error"]["code"] == "previous_response_not_found"
        assert "--frontend-processes 1" in err["error"]["message"]
