"""`/v1/embeddings` through a real frontend to mocker workers (one process, TCP request plane),
driven by the official `openai` SDK: shapes, encodings, token-id inputs, `dimensions`,
routing and load accounting, the embedding-only worker mode, and the 400s."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import numpy as np
import openai
import pytest
from tests.support.frontend_stack import CHAT, FrontendStack

from tandem.disagg.config import DisaggWorkerConfig
from tandem.disagg.worker_engine import DisaggEngine
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.embedding import hashed_embedding
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.protocols.openai_embedding import MAX_INPUTS

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"
EMBED = "/v1/embeddings"
DIM = 576


def _mocker(**kw: object) -> MockerEngine:
    return MockerEngine(MockerConfig(speedup_ratio=0, **kw))  # type: ignore[arg-type]


@asynccontextmanager
async def _stack(
    num_workers: int = 1, **config: object
) -> AsyncIterator[tuple[FrontendStack, openai.AsyncOpenAI]]:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        for _ in range(num_workers):
            await s.add_worker(_mocker())
        await s.start_frontend({"model": MODEL, "input": "ready"}, ready_path=EMBED, **config)
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="none", max_retries=0)
        exit_stack.push_async_callback(client.close)
        yield s, client


async def test_string_list_and_token_inputs_give_deterministic_unit_vectors() -> None:
    async with _stack() as (s, client):
        tok = s.workers[0].engine.config.tokenizer  # type: ignore[attr-defined]
        assert tok is not None
        one = await client.embeddings.create(model=MODEL, input="The cat sat on the mat.")
        assert one.object == "list" and one.model == MODEL and len(one.data) == 1
        vec = np.array(one.data[0].embedding, dtype=np.float32)
        assert vec.shape == (DIM,) and abs(float(np.linalg.norm(vec)) - 1.0) < 1e-5
        ids = [504, 2644, 2643, 335, 260, 1171, 30]  # the SmolLM2 tokens of that sentence
        assert np.allclose(vec, hashed_embedding(ids, DIM), atol=1e-7)
        assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
        by_ids = await client.embeddings.create(model=MODEL, input=ids)
        assert np.allclose(by_ids.data[0].embedding, vec, atol=1e-7)
        texts = ["a", "The cat sat on the mat.", "b c d"]
        many = await client.embeddings.create(model=MODEL, input=texts)
        assert [d.index for d in many.data] == [0, 1, 2]
        assert np.allclose(many.data[1].embedding, vec, atol=1e-7)
        lists = await client.embeddings.create(model=MODEL, input=[ids, [28, 29]])
        assert np.allclose(lists.data[0].embedding, vec, atol=1e-7)
        assert lists.usage.prompt_tokens == len(ids) + 2


async def test_base64_is_little_endian_float32_of_the_same_vector() -> None:
    async with _stack() as (s, client):
        floats = await client.embeddings.create(model=MODEL, input=["x y", "z"])
        # asked for explicitly, the SDK hands base64 back undecoded; the raw body's bytes are
        # what OpenAI's format promises
        b64 = await client.embeddings.create(
            model=MODEL, input=["x y", "z"], encoding_format="base64"
        )
        status, raw, _ = await s.post(
            EMBED, {"model": MODEL, "input": ["x y", "z"], "encoding_format": "base64"}
        )
        assert status == 200
        for i in range(2):
            decoded = np.frombuffer(base64.b64decode(raw["data"][i]["embedding"]), dtype="<f4")
            assert decoded.shape == (DIM,)
            assert np.array_equal(decoded, np.array(floats.data[i].embedding, dtype=np.float32))
            assert isinstance(b64.data[i].embedding, str)


async def test_sdk_default_request_is_base64_and_decodes_to_the_float_vector() -> None:
    async with _stack() as (_, client):
        default = await client.embeddings.create(model=MODEL, input="hello there")  # SDK: base64
        floats = await client.embeddings.create(
            model=MODEL, input="hello there", encoding_format="float"
        )
        assert np.array_equal(
            np.array(default.data[0].embedding, dtype=np.float32),
            np.array(floats.data[0].embedding, dtype=np.float32),
        )


async def test_dimensions_truncates_and_renormalises_on_a_matryoshka_model() -> None:
    async with _stack() as (_, client):
        full = await client.embeddings.create(model=MODEL, input="abc", encoding_format="float")
        short = await client.embeddings.create(
            model=MODEL, input="abc", dimensions=64, encoding_format="float"
        )
        vec = np.array(short.data[0].embedding)
        assert vec.shape == (64,) and abs(float(np.linalg.norm(vec)) - 1.0) < 1e-5
        prefix = np.array(full.data[0].embedding[:64])
        assert np.allclose(vec, prefix / np.linalg.norm(prefix), atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": ["ok", [1, 2]]}, "input[1]"),
        ({"input": [[1, 2], []]}, "input[1]"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"),
        ({"input": [[1, 2], [3, 49152]]}, "input[1]"),
        ({"input": [-1, 2]}, "input"),
        ({"input": [1] * 8193}, "input"),
        ({"input": ["ok", [1] * 8193]}, "input[1]"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": DIM + 1}, "dimensions"),
        ({"input": "x", "model": "nope"}, "model"),
    ],
)
async def test_bad_inputs_are_400s_naming_the_field(body: dict, param: str) -> None:
    async with _stack() as (s, _):
        status, err, _ = await s.post(EMBED, {"model": MODEL, **body})
        expected = 404 if param == "model" else 400
        assert status == expected, err
        assert err["error"]["param"] == param, err
        assert s.workers[0].num_inflight == 0


async def test_a_batch_is_one_worker_call_and_requests_spread_over_workers() -> None:
    async with _stack(num_workers=2) as (s, client):
        for w in s.workers:
            w.engine.embed_calls = 0  # type: ignore[attr-defined]
            original = w.engine.embed  # type: ignore[attr-defined]

            async def counted(inputs, original=original, w=w):  # type: ignore[no-untyped-def]
                w.engine.embed_calls += 1  # type: ignore[attr-defined]
                return await original(inputs)

            w.engine.embed = counted  # type: ignore[attr-defined]
        await client.embeddings.create(model=MODEL, input=["a", "b", "c", "d"])
        assert sum(w.engine.embed_calls for w in s.workers) == 1  # type: ignore[attr-defined]
        for _ in range(5):
            await client.embeddings.create(model=MODEL, input="x")
        assert all(w.engine.embed_calls > 0 for w in s.workers)  # type: ignore[attr-defined]
        assert await s.inflight_on_workers() == [0.0, 0.0]
        _, text = await s.get("/metrics")
        pattern = (
            r'endpoint="embeddings",request_type="unary",status="success",status_code="200"\} (\d+)'
        )
        assert int(re.findall(pattern, text)[0]) == 7  # the readiness probe + these 6
        assert 'tandem_frontend_inflight_requests{model="smollm2"} 0' in text
        assert 'tandem_frontend_queued_requests{model="smollm2"} 0' in text


async def test_embedding_only_and_generation_only_workers_refuse_the_other_task() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        rt = await s.runtime()
        worker = Worker(_mocker(), rt, WorkerConfig(embedding_only=True))
        await worker.start()
        exit_stack.push_async_callback(worker.stop, 0)
        assert worker.instance is not None and worker.instance.model is not None
        assert worker.instance.model.tasks == ["embed"]
        await s.start_frontend({"model": MODEL, "input": "ready"}, ready_path=EMBED)
        status, err, _ = await s.post(
            CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 400 and err["error"]["param"] == "model", err
        assert "does not serve /v1/chat/completions" in err["error"]["message"]
        assert "embed" in err["error"]["message"]
        # a generation-only worker of another model: embeddings are refused the same way
        gen = Worker(_mocker(model_name="gen", embedding_dim=0), await s.runtime(), WorkerConfig())
        await gen.start()
        exit_stack.push_async_callback(gen.stop, 0)
        assert gen.instance is not None and gen.instance.model is not None
        assert gen.instance.model.tasks == ["generate"]
        body = {"model": "gen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with asyncio.timeout(30):  # the frontend discovers "gen" and loads its tokenizer
            while (await s.post(CHAT, body))[0] != 200:  # noqa: ASYNC110 - over HTTP
                await asyncio.sleep(0.05)
        status, err, _ = await s.post(EMBED, {"model": "gen", "input": "x"})
        assert status == 400 and err["error"]["param"] == "model", err
        assert "does not serve /v1/embeddings" in err["error"]["message"]
        assert json.dumps(err)  # an OpenAI error body


async def test_mixed_fleet_routes_generation_away_from_an_embedding_only_worker() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        embed_only = Worker(_mocker(), await s.runtime(), WorkerConfig(embedding_only=True))
        await embed_only.start()
        exit_stack.push_async_callback(embed_only.stop, 0)
        both = await s.add_worker(_mocker())
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        await s.start_frontend(body, router_policy="round_robin")
        for _ in range(4):
            status, out, _ = await s.post(CHAT, body)
            assert status == 200, out
        assert both.num_inflight == 0 and embed_only.num_inflight == 0


async def test_a_disaggregated_decode_worker_embeds_too() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        engine = DisaggEngine(_mocker(), DisaggWorkerConfig(mode="decode"))
        worker = Worker(engine, await s.runtime(), WorkerConfig())
        await worker.start()
        exit_stack.push_async_callback(worker.stop, 0)
        assert worker.instance is not None and worker.instance.model is not None
        assert worker.instance.model.tasks == ["generate", "embed"]
        await s.start_frontend({"model": MODEL, "input": "ready"}, ready_path=EMBED)
        status, out, _ = await s.post(EMBED, {"model": MODEL, "input": [[5, 6]]})
        assert status == 200 and len(out["data"][0]["embedding"]) == DIM, out


async def test_an_embedding_in_flight_counts_as_load_and_takes_admission() -> None:
    async with _stack(max_inflight_requests=1) as (s, client):
        engine = s.workers[0].engine
        release, entered = asyncio.Event(), asyncio.Event()
        original = engine.embed  # type: ignore[attr-defined]

        async def held(inputs):  # type: ignore[no-untyped-def]
            entered.set()
            await release.wait()
            return await original(inputs)

        engine.embed = held  # type: ignore[attr-defined]
        call = asyncio.create_task(client.embeddings.create(model=MODEL, input=["a", "b"]))
        await asyncio.wait_for(entered.wait(), 10)
        assert await s.inflight_on_workers() == [1.0]  # the router counts it
        assert s.workers[0].num_inflight == 1
        status, err, headers = await s.post(EMBED, {"model": MODEL, "input": "x"})
        assert status == 503 and "retry-after" in {k.lower() for k in headers}, err
        release.set()
        assert len((await call).data) == 2
        assert await s.inflight_on_workers() == [0.0]
