"""`/v1/rerank` and `/v1/score` on the real SmolLM2 (native engine) behind a real frontend: each
score is the cosine of the vectors `/v1/embeddings` returns for the same texts, so the
ranking is the embedding model's. The one quality asserted is the one the embeddings test
already shows SmolLM2's mean-pooled vectors have (a paraphrase well above an unrelated
sentence); nothing claims a trained reranker's judgement."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

import numpy as np
import pytest
from tests.support.frontend_stack import FrontendStack

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine

pytestmark = [pytest.mark.native, pytest.mark.timeout(180)]
MODEL = "smollm2"
CAT = "The cat sat on the mat."
PARAPHRASE = "A cat was sitting on the mat."
UNRELATED = "Stock markets fell sharply today."


async def _post(s: FrontendStack, path: str, body: dict[str, Any]) -> Any:
    assert s.http is not None
    async with s.http.post(f"{s.base}{path}", data=json.dumps(body)) as resp:
        out = await resp.json()
        assert resp.status == 200, out
        return out


async def test_scores_are_the_cosines_of_the_embeddings_and_rank_as_they_do() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        config = NativeConfig(num_blocks=64, max_num_batched_tokens=64, num_threads=1)
        engine = NativeEngine(config)
        await s.add_worker(engine)
        await s.start_frontend({"model": MODEL, "input": "ready"}, ready_path="/v1/embeddings")
        texts = [CAT, UNRELATED, PARAPHRASE]
        out = await _post(s, "/v1/embeddings", {"model": MODEL, "input": texts})
        cat, other, para = np.array([d["embedding"] for d in out["data"]], dtype=np.float64)
        expected = {1: float(cat @ other), 2: float(cat @ para)}  # unit vectors
        for path in ("/v1/rerank", "/v2/rerank"):
            body = {"model": MODEL, "query": CAT, "documents": [UNRELATED, PARAPHRASE]}
            ranked = await _post(s, path, body)
            # a batch of other texts moves a vector by rounding only (see the embeddings test)
            got = {1 + r["index"]: r["relevance_score"] for r in ranked["results"]}
            assert got == pytest.approx(expected, abs=1e-4), (got, expected)
            assert [r["document"]["text"] for r in ranked["results"]] == [PARAPHRASE, UNRELATED]
        scored = await _post(
            s, "/v1/score", {"model": MODEL, "text_1": CAT, "text_2": [UNRELATED, PARAPHRASE]}
        )
        assert [d["score"] for d in scored["data"]] == pytest.approx(
            [expected[1], expected[2]], abs=1e-4
        )
        assert all(-1.0 <= d["score"] <= 1.0 for d in scored["data"])
        assert engine.core is not None  # an embedding never takes or caches a KV block
        assert engine.core.block_manager.num_active_blocks == 0
        assert engine.core.block_manager.num_free_blocks == 64
        assert all(w.num_inflight == 0 for w in s.workers)
