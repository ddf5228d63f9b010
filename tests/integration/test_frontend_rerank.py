"""`/v1/rerank` and `/v1/score` (and vLLM's aliases) through a real frontend to mocker workers:
scores are the cosine of the vectors `/v1/embeddings` gives, one embed call per request, the
response bodies validate against /openapi.json, bad bodies are 400s naming the field, and a
worker that cannot embed is refused naming the model and the route. (The mocker's vectors
are hash-seeded: its scores say nothing about meaning; `test_frontend_rerank_native.py` runs
the real model.)"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import cohere
import jsonschema
import msgspec
import numpy as np
import pytest
from tests.support.eventually import eventually
from tests.support.frontend_stack import CHAT, FrontendStack

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.protocols.openai_embedding import MAX_INPUTS
from tandem.protocols.rerank import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"
DOCS = ["The cat sat on the mat.", "Stock markets fell.", "A cat was sitting on the mat."]
QUERY = "Where did the cat sit?"


@asynccontextmanager
async def _stack(**mocker: Any) -> AsyncIterator[FrontendStack]:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        await s.add_worker(MockerEngine(MockerConfig(speedup_ratio=0, **mocker)))
        ready = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        await s.start_frontend(ready, ready_path=CHAT)
        yield s


async def _post(s: FrontendStack, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    assert s.http is not None
    async with s.http.post(f"{s.base}{path}", data=json.dumps(body)) as resp:
        return resp.status, await resp.json()


async def _vectors(s: FrontendStack, texts: list[str]) -> np.ndarray:
    status, out = await _post(s, "/v1/embeddings", {"model": MODEL, "input": texts})
    assert status == 200, out
    return np.array([d["embedding"] for d in out["data"]], dtype=np.float64)


async def test_rerank_scores_are_embedding_cosines_sorted_on_every_alias() -> None:
    async with _stack() as s:
        vecs = await _vectors(s, [QUERY, *DOCS])
        expected = vecs[1:] @ vecs[0]
        order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            status, out = await _post(s, path, {"model": MODEL, "query": QUERY, "documents": DOCS})
            assert status == 200, out
            msgspec.convert(out, RerankResponse)  # no field beyond the documented ones
            assert out["id"].startswith("rerank-") and out["model"] == MODEL
            assert [r["index"] for r in out["results"]] == order
            for r in out["results"]:
                assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
                assert r["document"] == {"text": DOCS[r["index"]]}
            num_tokens = out["usage"]["prompt_tokens"]
            assert num_tokens == out["usage"]["total_tokens"] > len(DOCS) + 1
        # {"text": ...} documents, top_n, return_documents: false
        objects = [{"text": d} for d in DOCS]
        body = {"model": MODEL, "query": QUERY, "documents": objects}
        status, out = await _post(s, "/v1/rerank", {**body, "top_n": 2, "return_documents": False})
        assert status == 200, out
        assert [r["index"] for r in out["results"]] == order[:2]
        assert all("document" not in r for r in out["results"])
        # a document equal to the query: the same token ids, the same vector, score 1
        status, out = await _post(s, "/v1/rerank", {**body, "documents": ["x y", QUERY]})
        assert out["results"][0] == {
            "index": 1,
            "relevance_score": pytest.approx(1.0, abs=1e-6),
            "document": {"text": QUERY},
        }


async def test_the_cohere_sdk_reranks_on_v1_and_v2() -> None:
    async with _stack() as s:
        _, expected = await _post(
            s, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS}
        )
        best = [(r["index"], r["relevance_score"]) for r in expected["results"]]
        v2 = cohere.AsyncClientV2(api_key="none", base_url=s.base, max_retries=0)
        out = await v2.rerank(model=MODEL, query=QUERY, documents=DOCS, top_n=2)
        assert [(r.index, r.relevance_score) for r in out.results] == best[:2]
        v1 = cohere.AsyncClient(api_key="none", base_url=s.base, max_retries=0)
        old = await v1.rerank(model=MODEL, query=QUERY, documents=DOCS, return_documents=True)
        assert [(r.index, r.relevance_score) for r in old.results] == best
        assert [r.document.text for r in old.results if r.document] == [DOCS[i] for i, _ in best]
        with pytest.raises(cohere.BadRequestError) as info:
            await v2.rerank(model=MODEL, query=QUERY, documents=DOCS, max_tokens_per_doc=-1)
        assert info.value.body["error"]["param"] == "max_tokens_per_doc"


async def test_score_pairs_one_to_one_one_to_many_and_many_to_many() -> None:
    async with _stack() as s:
        a, b = ["a b c", "the cat"], ["a b c", "stock markets"]
        vecs = await _vectors(s, [*a, *b])
        for path in ("/v1/score", "/score"):
            status, out = await _post(s, path, {"model": MODEL, "text_1": a, "text_2": b})
            assert status == 200, out
            msgspec.convert(out, ScoreResponse)
            assert out["object"] == "list" and out["id"].startswith("score-")
            assert [d["index"] for d in out["data"]] == [0, 1]
            assert all(d["object"] == "score" for d in out["data"])
            assert out["data"][0]["score"] == pytest.approx(1.0, abs=1e-6)  # equal texts
            assert out["data"][1]["score"] == pytest.approx(vecs[1] @ vecs[3], abs=1e-5)
        status, out = await _post(s, "/v1/score", {"model": MODEL, "text_1": a[1], "text_2": b})
        assert [d["score"] for d in out["data"]] == pytest.approx(vecs[2:] @ vecs[1], abs=1e-5)
        status, one = await _post(s, "/v1/score", {"model": MODEL, "text_1": a[1], "text_2": b[1]})
        assert [d["score"] for d in one["data"]] == pytest.approx([out["data"][1]["score"]])
        # vLLM's other names for the two sides
        for first, second in (("queries", "documents"), ("data_1", "data_2"), ("queries", "items")):
            body = {"model": MODEL, first: a[1], second: b}
            status, alias = await _post(s, "/v1/score", body)
            assert status == 200 and alias["data"] == out["data"], alias


async def test_a_request_is_one_embed_call_on_the_worker() -> None:
    async with _stack() as s:
        engine = s.workers[0].engine
        calls: list[int] = []
        original = engine.embed  # type: ignore[attr-defined]

        async def counted(inputs: list[list[int]]) -> Any:
            calls.append(len(inputs))
            return await original(inputs)

        engine.embed = counted  # type: ignore[attr-defined]
        await _post(s, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS})
        await _post(s, "/v1/score", {"model": MODEL, "text_1": DOCS, "text_2": DOCS})
        assert calls == [1 + len(DOCS), 2 * len(DOCS)]
        assert all(w.num_inflight == 0 for w in s.workers)


BAD_RERANK = [
    ({"query": ""}, "query"),
    ({"query": 5}, "query"),
    ({"documents": []}, "documents"),
    ({"documents": ["ok", ""]}, "documents[1]"),
    ({"documents": ["ok", {"content": "x"}]}, "documents[1]"),
    ({"documents": ["x"] * MAX_INPUTS}, "documents"),
    ({"top_n": -1}, "top_n"),
    ({"max_tokens_per_doc": -1}, "max_tokens_per_doc"),
    ({"instruction": "Judge relevance"}, "instruction"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"rank_fields": ["title"]}, "rank_fields"),
    ({"max_chunks_per_doc": 2}, "max_chunks_per_doc"),
    ({"use_activation": True}, "use_activation"),
    ({"priority": 5}, "priority"),
    ({"model": ""}, "model"),
]
BAD_SCORE = [
    ({"text_2": []}, "text_2"),
    ({"text_2": ["a", 3]}, "text_2[1]"),
    ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ({"text_1": ["a"] * 1025, "text_2": ["b"] * 1025}, "text_2"),
    ({"text_2": None}, "text_2"),
    ({"queries": "a"}, "queries"),
    ({"softmax": True}, "softmax"),
]


@pytest.mark.parametrize(("path", "change", "param"), [
    *(("/v1/rerank", change, param) for change, param in BAD_RERANK),
    *(("/v1/score", change, param) for change, param in BAD_SCORE),
])  # fmt: skip
async def test_bad_bodies_are_400s_naming_the_field(
    path: str, change: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = (
        {"model": MODEL, "query": QUERY, "documents": DOCS}
        if path == "/v1/rerank"
        else {"model": MODEL, "text_1": "a", "text_2": ["b", "c"]}
    )
    body = {k: v for k, v in {**base, **change}.items() if v is not None}
    async with _stack() as s:
        status, out = await _post(s, path, body)
        assert status == 400, out
        assert out["error"]["param"] == param, out


async def test_too_long_inputs_are_named_or_cut_as_asked() -> None:
    async with _stack(context_length=64) as s:
        long = "The first words differ. " + "filler " * 80 + "and so do the last ones."
        body = {"model": MODEL, "query": QUERY, "documents": ["ok", long]}
        status, out = await _post(s, "/v1/rerank", body)
        assert status == 400 and out["error"]["param"] == "documents[1]", out
        score = {"model": MODEL, "text_1": long, "text_2": "ok"}
        status, out = await _post(s, "/v1/score", score)
        assert status == 400 and out["error"]["param"] == "text_1", out
        ids = {}
        for text in (QUERY, "ok", long):
            status, out = await _post(s, "/tokenize", {"model": MODEL, "prompt": text})
            ids[text] = out["tokens"]
        assert len(ids[QUERY]) <= 8
        head, tail = ids[long][:8], ids[long][-8:]
        status, out = await _post(
            s, "/v1/embeddings", {"model": MODEL, "input": [ids[QUERY], head, tail]}
        )
        q, h, t = np.array([d["embedding"] for d in out["data"]], dtype=np.float64)
        # max_tokens_per_doc keeps a document's first N tokens, truncate_prompt_tokens every
        # text's last N (or its first N, truncation_side right); usage counts what was embedded
        cuts = (
            ({"max_tokens_per_doc": 8}, h),
            ({"truncate_prompt_tokens": 8}, t),
            ({"truncate_prompt_tokens": 8, "truncation_side": "right"}, h),
        )
        for fields, kept in cuts:
            status, out = await _post(s, "/v1/rerank", {**body, **fields, "request_id": "r-7"})
            assert status == 200, out
            (got,) = [r["relevance_score"] for r in out["results"] if r["index"] == 1]
            assert got == pytest.approx(q @ kept, abs=1e-5), fields
            assert out["usage"]["prompt_tokens"] == len(ids[QUERY]) + len(ids["ok"]) + 8
            assert out["id"] == "rerank-r-7"  # vLLM's request_id


async def test_a_model_whose_workers_cannot_embed_is_refused_by_name() -> None:
    async with _stack(embedding_dim=0) as s:
        for path, body in (
            ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"]}),
            ("/v2/rerank", {"model": MODEL, "query": "q", "documents": ["d"]}),
            ("/v1/score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
        ):
            status, out = await _post(s, path, body)
            assert status == 400, out
            assert out["error"]["param"] == "model"
            assert f"model '{MODEL}' does not serve {path}" in out["error"]["message"], out
            assert "generate" in out["error"]["message"]  # what its workers do serve


async def test_openapi_documents_the_routes_and_real_bodies_validate() -> None:
    async with _stack() as s:
        assert s.http is not None
        async with s.http.get(f"{s.base}/openapi.json") as resp:
            doc = await resp.json()
        samples = [
            ("/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 1}),
            ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS}),
            ("/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 0}),
            ("/v1/score", {"model": MODEL, "text_1": "a", "text_2": ["b", "c"]}),
            ("/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": ["b", "c"]}),
        ]  # fmt: skip
        for path, body in samples:
            op = doc["paths"][path]["post"]
            assert "(undocumented)" not in op["summary"]
            _validator(doc, op["requestBody"]["content"]["application/json"]["schema"]).validate(
                body
            )
            status, got = await _post(s, path, body)
            assert status == 200, got
            schema = op["responses"]["200"]["content"]["application/json"]["schema"]
            _validator(doc, schema).validate(got)


def _validator(doc: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


HOSTILE: list[Any] = [
    None, True, 0, -1, 2**31, 2**64, 1e308, "", "x" * 3000, "\x00", [], [[]], [None], [1, "a"],
    [""], ["a", 5], [{"text": 5}], [{"text": ""}], {}, {"mode": "enabled"}, "left", "right",
]  # fmt: skip


async def test_random_bodies_never_get_a_5xx_and_every_400_names_its_field() -> None:
    """Seeded and bounded (100 bodies per route): hostile values in any field."""
    rng = random.Random(20261128)
    fields = {
        "/v1/rerank": [f.name for f in msgspec.structs.fields(RerankRequest)],
        "/v1/score": [f.name for f in msgspec.structs.fields(ScoreRequest)],
    }
    bodies = []
    for _ in range(100):
        for path, names in fields.items():
            body: dict[str, Any] = (
                {"model": MODEL, "query": "q", "documents": ["a", "b c"]}
                if path == "/v1/rerank"
                else {"model": MODEL, "text_1": "q", "text_2": ["a", "b"]}
            )
            for _ in range(rng.randint(1, 3)):
                body[rng.choice(names)] = rng.choice(HOSTILE)
            bodies.append((path, body))
    async with _stack(context_length=256) as s:
        statuses: dict[int, int] = {}
        sem = asyncio.Semaphore(4)

        async def send(path: str, body: dict[str, Any]) -> None:
            async with sem, asyncio.timeout(15):
                status, out = await _post(s, path, body)
            statuses[status] = statuses.get(status, 0) + 1
            unknown_model = body["model"] != MODEL and out.get("error", {}).get("param") == "model"
            assert status in (200, 400) or (status == 404 and unknown_model), (path, body, out)
            if status == 400:
                error = out["error"]
                assert error["message"] and (error["param"] or "body" in error["message"]), out

        async with asyncio.timeout(60):
            await asyncio.gather(*(send(p, b) for p, b in bodies))
        assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses
        await eventually(lambda: s.workers[0].num_inflight == 0, timeout_s=5)
        assert s.http is not None
        async with s.http.get(f"{s.base}/metrics") as resp:
            metrics = await resp.text()
        for endpoint in ("rerank", "score"):  # counted under their own endpoint label
            assert f'endpoint="{endpoint}"' in metrics, endpoint
