"""The rerank and score answers from vectors: cosine per pair, best first, ties in document
order, `top_n`, `return_documents`, and the cuts vLLM's `max_tokens_per_query`,
`max_tokens_per_doc`, `truncate_prompt_tokens` and `truncation_side` ask for."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

from tandem.errors import InvalidRequest
from tandem.frontend.api.embedder import Embedder
from tandem.frontend.api.rerank import (
    _total_param,
    cosines,
    cut_inputs,
    rerank_response,
    score_response,
)
from tandem.protocols.discovery import ModelCard
from tandem.protocols.openai_embedding import MAX_TOTAL_TOKENS
from tandem.protocols.rerank import RerankRequest, ScoreResponse

DOCS = ["d0", "d1", "d2", "d3"]


def _req(**kw: Any) -> RerankRequest:
    return msgspec.convert({"model": "m", "query": "q", "documents": DOCS, **kw}, RerankRequest)


def _answer(scores: list[float], **kw: Any) -> dict[str, Any]:
    body = rerank_response(_req(**kw), "rerank-1", "m", DOCS, np.array(scores), 9)
    out: dict[str, Any] = msgspec.to_builtins(body)
    return out


def test_results_are_best_first_with_ties_in_document_order() -> None:
    out = _answer([0.1, 0.9, 0.5, 0.9])
    assert [r["index"] for r in out["results"]] == [1, 3, 2, 0]
    assert [r["relevance_score"] for r in out["results"]] == [0.9, 0.9, 0.5, 0.1]
    assert [r["document"]["text"] for r in out["results"]] == ["d1", "d3", "d2", "d0"]
    assert out["id"] == "rerank-1" and out["model"] == "m"
    assert out["usage"] == {"prompt_tokens": 9, "total_tokens": 9}


@pytest.mark.parametrize(("top_n", "expected"), [(None, 4), (0, 4), (1, 1), (3, 3), (10, 4)])
def test_top_n_keeps_the_best_n(top_n: int | None, expected: int) -> None:
    out = _answer([0.1, 0.9, 0.5, 0.2], top_n=top_n)
    assert [r["index"] for r in out["results"]] == [1, 2, 3, 0][:expected]


def test_return_documents_false_leaves_the_documents_out() -> None:
    out = _answer([0.1, 0.9, 0.5, 0.2], return_documents=False)
    assert out["results"][0] == {"index": 1, "relevance_score": 0.9}


def test_cosines_pair_one_with_many_or_row_by_row_and_stay_in_range() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 8)), rng.normal(size=(3, 8))
    expected = [x @ y / (np.linalg.norm(x) * np.linalg.norm(y)) for x, y in zip(a, b, strict=True)]
    assert cosines(a, b) == pytest.approx(expected)
    one = [a[0] @ y / (np.linalg.norm(a[0]) * np.linalg.norm(y)) for y in b]
    assert cosines(a[:1], b) == pytest.approx(one)
    same = np.ones((1, 576), dtype=np.float32)  # its dot product with itself rounds past 1
    assert cosines(same, same)[0] <= 1.0
    assert cosines(same, -same)[0] >= -1.0


def test_score_response_is_one_score_per_pair_in_order() -> None:
    body = score_response("score-1", "m", np.array([0.5, -0.25]), 7)
    out = msgspec.to_builtins(body)
    msgspec.convert(out, ScoreResponse)
    assert out["data"] == [
        {"index": 0, "score": 0.5, "object": "score"},
        {"index": 1, "score": -0.25, "object": "score"},
    ]
    assert out["object"] == "list" and out["usage"]["completion_tokens"] == 0


def _cut(inputs: list[list[int]], num_firsts: int = 1, **kw: Any) -> list[list[int]]:
    return cut_inputs(inputs, num_firsts, 3, _req(**kw))


def test_cuts_are_vllms_first_n_per_query_or_document_then_the_last_or_first_n() -> None:
    inputs = [[1, 2, 3, 4, 5], [6, 7, 8, 9], [10]]
    assert _cut(inputs) == inputs
    assert _cut(inputs, max_tokens_per_doc=2) == [[1, 2, 3, 4, 5], [6, 7], [10]]
    assert _cut(inputs, max_tokens_per_query=2) == [[1, 2], [6, 7, 8, 9], [10]]
    assert _cut(inputs, 2, max_tokens_per_query=2) == [[1, 2], [6, 7], [10]]  # N:N score
    assert _cut(inputs, truncate_prompt_tokens=2) == [[4, 5], [8, 9], [10]]
    right = _cut(inputs, truncate_prompt_tokens=2, truncation_side="right")
    assert right == [[1, 2], [6, 7], [10]]
    assert _cut(inputs, truncate_prompt_tokens=-1) == [[3, 4, 5], [7, 8, 9], [10]]  # context
    both = _cut(inputs, max_tokens_per_doc=3, truncate_prompt_tokens=1)
    assert both == [[5], [8], [10]]  # first N, then last N


@pytest.mark.parametrize(("params", "field"), [
    (["query", "documents[0]", "documents[1]"], "documents"),
    (["text_1", "text_2[0]", "text_2[1]"], "text_2"),
    (["queries[0]", "queries[1]", "items[0]", "items[1]"], "items"),
])  # fmt: skip
def test_too_many_tokens_in_all_name_the_field_the_texts_came_in(
    params: list[str], field: str
) -> None:
    card = ModelCard(name="m", context_length=MAX_TOTAL_TOKENS, block_size=16, num_total_blocks=1)
    model: Any = SimpleNamespace(name="m", tokenizer=None)
    share = MAX_TOTAL_TOKENS // (len(params) - 1)
    inputs = [[1] * share for _ in params]  # one share too many
    with pytest.raises(InvalidRequest) as info:
        Embedder.check(model, card, inputs, params, total_param=_total_param(params))
    assert info.value.param == field and str(MAX_TOTAL_TOKENS) in str(info.value)
    Embedder.check(model, card, inputs[1:], params[1:], total_param=field)  # at the limit
