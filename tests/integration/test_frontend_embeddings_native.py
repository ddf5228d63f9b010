"""`/v1/embeddings` on the real SmolLM2 (native engine, mean pooling) behind a real frontend,
driven by the official `openai` SDK: a paraphrase ranks above an unrelated sentence, float
and base64 give the same vectors, a batch gives what single requests give, token ids give
what their text gives, usage counts the tokens, no KV block is kept, and bad requests are
400s."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import numpy as np
import openai
import pytest
from tests.support.frontend_stack import FrontendStack

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine

pytestmark = [pytest.mark.native, pytest.mark.timeout(180)]
MODEL = "smollm2"
CAT = "The cat sat on the mat."
PARAPHRASE = "A cat was sitting on the mat."
UNRELATED = "Stock markets fell sharply today."
MAX_MODEL_LEN = 256


@asynccontextmanager
async def _stack() -> AsyncIterator[tuple[FrontendStack, NativeEngine, openai.AsyncOpenAI]]:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        config = NativeConfig(
            num_blocks=64, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN, num_threads=1
        )
        engine = NativeEngine(config)
        await s.add_worker(engine)
        await s.start_frontend({"model": MODEL, "input": "ready"}, ready_path="/v1/embeddings")
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="none", max_retries=0)
        exit_stack.push_async_callback(client.close)
        yield s, engine, client


def _vector(embedding: list[float] | str) -> np.ndarray:
    """A float list, or the base64 string the SDK hands back as is when asked for base64
    explicitly (it decodes only the base64 it asked for by default)."""
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.array(embedding, dtype=np.float32)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


async def test_paraphrase_ranks_above_unrelated_batched_or_not_float_or_base64() -> None:
    async with _stack() as (s, engine, client):
        texts = [CAT, PARAPHRASE, UNRELATED]
        batch = {}
        for fmt in ("float", "base64"):
            out = await client.embeddings.create(model=MODEL, input=texts, encoding_format=fmt)
            batch[fmt] = np.stack([_vector(d.embedding) for d in out.data])
        assert np.array_equal(batch["float"], batch["base64"])
        cat, para, other = batch["float"]
        assert all(abs(float(np.linalg.norm(v)) - 1.0) < 1e-5 for v in batch["float"])
        assert _cos(cat, para) > _cos(cat, other) + 0.1, (_cos(cat, para), _cos(cat, other))
        assert _cos(cat, para) > _cos(para, other) + 0.1
        singles = []
        for text in texts:  # SDK default: base64, decoded by the SDK
            out = await client.embeddings.create(model=MODEL, input=text)
            singles.append(np.array(out.data[0].embedding, dtype=np.float32))
        assert np.allclose(np.stack(singles), batch["float"], atol=1e-4)
        assert engine.core is not None
        assert engine.core.block_manager.num_active_blocks == 0
        assert engine.core.block_manager.num_free_blocks == 64  # no block taken, none cached
        engine.core.block_manager.check_integrity()
        assert all(w.num_inflight == 0 for w in s.workers)


async def test_token_ids_match_their_text_and_usage_counts_tokens() -> None:
    async with _stack() as (s, _, client):
        model = s.workers[0].info
        assert model is not None and model.tokenizer is not None
        from tandem.tokens.tokenizer import load_tokenizer

        tok = load_tokenizer(model.tokenizer)
        ids = [tok.encode(t, add_special_tokens=True) for t in (CAT, UNRELATED)]
        by_text = await client.embeddings.create(
            model=MODEL, input=[CAT, UNRELATED], encoding_format="float"
        )
        by_ids = await client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
        assert np.allclose(
            [d.embedding for d in by_text.data], [d.embedding for d in by_ids.data], atol=1e-6
        )
        num = sum(map(len, ids))
        assert by_text.usage.prompt_tokens == by_text.usage.total_tokens == num
        assert by_ids.usage.prompt_tokens == num


async def test_context_vocab_and_dimensions_errors_are_400s() -> None:
    async with _stack() as (s, _, client):
        with pytest.raises(openai.BadRequestError) as err:
            await client.embeddings.create(model=MODEL, input=["ok", [1] * (MAX_MODEL_LEN + 1)])
        assert err.value.body["param"] == "input[1]"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as err:
            await client.embeddings.create(model=MODEL, input=[[1, 2], [49152]])
        assert err.value.body["param"] == "input[1]"  # type: ignore[index]
        # SmolLM2 was not trained to make prefixes of its vectors meaningful: no `dimensions`
        with pytest.raises(openai.BadRequestError) as err:
            await client.embeddings.create(model=MODEL, input="x", dimensions=64)
        assert err.value.body["param"] == "dimensions"  # type: ignore[index]
        assert "Matryoshka" in err.value.body["message"]  # type: ignore[index]
        same = await client.embeddings.create(model=MODEL, input="x", dimensions=576)
        assert len(same.data[0].embedding) == 576
        assert all(w.num_inflight == 0 for w in s.workers)
