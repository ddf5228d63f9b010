"""The rerank and score requests: what they accept, and the 400 that names the field for what
they do not."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tandem.errors import InvalidRequest
from tandem.protocols.openai_embedding import MAX_INPUTS
from tandem.protocols.rerank import (
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    validate_rerank,
    validate_score,
)


def _rerank(**kw: Any) -> RerankRequest:
    body = {"model": "m", "query": "q", "documents": ["a", {"text": "b"}], **kw}
    return msgspec.convert(body, RerankRequest)


def _score(**kw: Any) -> ScoreRequest:
    return msgspec.convert({"model": "m", **kw}, ScoreRequest)


def _param(call: Any) -> str:
    with pytest.raises(InvalidRequest) as info:
        call()
    assert info.value.param is not None
    return info.value.param


def test_rerank_texts_are_the_query_then_each_document_string_or_object() -> None:
    texts, params = validate_rerank(_rerank())
    assert texts == ["q", "a", "b"]
    assert params == ["query", "documents[0]", "documents[1]"]
    req = _rerank()
    assert req.top_n is None and req.return_documents is True  # Jina's defaults


@pytest.mark.parametrize(("change", "param"), [
    ({"model": ""}, "model"),
    ({"query": ""}, "query"),
    ({"documents": []}, "documents"),
    ({"documents": ["a", ""]}, "documents[1]"),
    ({"documents": ["a", {"text": ""}]}, "documents[1]"),
    ({"documents": [{"image": "x"}]}, "documents[0]"),
    ({"documents": [3]}, "documents[0]"),
    ({"documents": ["d"] * MAX_INPUTS}, "documents"),  # the query takes one slot of the call
    ({"top_n": -1}, "top_n"),
    ({"max_tokens_per_doc": -1}, "max_tokens_per_doc"),
    ({"max_tokens_per_query": -1}, "max_tokens_per_query"),
    ({"truncation_side": "middle"}, "truncation_side"),
    ({"request_id": "has space"}, "request_id"),
    ({"request_id": "x" * 129}, "request_id"),
    ({"instruction": "Judge relevance"}, "instruction"),
    ({"chat_template_kwargs": {"instruction": "x"}}, "chat_template_kwargs"),
    ({"padding": "max_length"}, "padding"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"rank_fields": ["title"]}, "rank_fields"),
    ({"max_chunks_per_doc": 1}, "max_chunks_per_doc"),
    ({"relevant_spans": {"mode": "enabled"}}, "relevant_spans"),
    ({"priority": 1}, "priority"),
    ({"use_activation": True}, "use_activation"),
    ({"softmax": True}, "softmax"),
    ({"activation": True}, "activation"),
    ({"mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
])  # fmt: skip
def test_rerank_refusals_name_the_field(change: dict[str, Any], param: str) -> None:
    assert _param(lambda: validate_rerank(_rerank(**change))) == param


def test_rerank_accepts_the_values_that_ask_for_nothing_missing() -> None:
    ok = {"priority": 0, "use_activation": False, "mm_processor_kwargs": {}, "top_n": 0}
    ok |= {"padding": "do_not_pad", "chat_template_kwargs": {}, "max_tokens_per_doc": 0}
    ok |= {"user": "u", "cache_salt": "s", "request_id": "r-1", "truncation_side": "right"}
    validate_rerank(_rerank(**ok, truncate_prompt_tokens=-1, max_tokens_per_query=1))
    assert validate_rerank(_rerank(documents="one"))[0] == ["q", "one"]  # vLLM takes a string
    validate_rerank(_rerank(documents=["d"] * (MAX_INPUTS - 1)))


def test_unsupported_values_say_why_and_what_is_accepted() -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_rerank(_rerank(use_activation=True))
    assert "cosine similarity" in str(info.value) and "accepted: unset or false" in str(info.value)


def test_score_pairs_one_to_one_one_to_many_and_many_to_many() -> None:
    one = validate_score(_score(text_1="a", text_2="b"))
    assert (one.firsts, one.seconds, one.num_pairs) == (["a"], ["b"], 1)
    assert one.params() == ["text_1", "text_2"]
    many = validate_score(_score(text_1="a", text_2=["b", "c"]))
    assert many.num_pairs == 2 and many.params() == ["text_1", "text_2[0]", "text_2[1]"]
    pairs = validate_score(_score(text_1=["a", "b"], text_2=["c", "d"]))
    assert pairs.params() == ["text_1[0]", "text_1[1]", "text_2[0]", "text_2[1]"]


@pytest.mark.parametrize(("first", "second"), [
    ("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"),
])  # fmt: skip
def test_score_takes_each_of_vllms_names_for_the_two_sides(first: str, second: str) -> None:
    pairs = validate_score(_score(**{first: "a", second: ["b"]}))
    assert pairs.names == (first, second) and pairs.firsts == ["a"] and pairs.seconds == ["b"]


@pytest.mark.parametrize(("body", "param"), [
    ({}, "text_1"),
    ({"text_1": "a"}, "text_2"),
    ({"queries": "a"}, "documents"),
    ({"text_1": "a", "data_2": "b"}, "data_2"),
    ({"text_1": "a", "text_2": "b", "items": ["c"]}, "items"),
    ({"text_1": "a", "text_2": []}, "text_2"),
    ({"text_1": "", "text_2": "b"}, "text_1"),
    ({"text_1": ["a", 1], "text_2": "b"}, "text_1[1]"),
    ({"text_1": ["a", "b"], "text_2": "c"}, "text_2"),  # N:1 is not a pairing
    ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ({"text_1": ["a"] * 1025, "text_2": ["b"] * 1025}, "text_2"),  # over MAX_INPUTS texts
    ({"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"text_1": "a", "text_2": "b", "softmax": True}, "softmax"),
    ({"text_1": "a", "text_2": "b", "priority": -1}, "priority"),
    ({"text_1": "a", "text_2": "b", "max_tokens_per_doc": -1}, "max_tokens_per_doc"),
    ({"text_1": "a", "text_2": "b", "instruction": "x"}, "instruction"),
])  # fmt: skip
def test_score_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    assert _param(lambda: validate_score(_score(**body))) == param


def test_a_rerank_result_without_its_document_leaves_the_field_out() -> None:
    body = RerankResponse(
        id="rerank-1",
        model="m",
        usage=RerankUsage(prompt_tokens=3, total_tokens=3),
        results=[RerankResult(index=0, relevance_score=0.5)],
    )
    assert msgspec.json.decode(msgspec.json.encode(body))["results"] == [
        {"index": 0, "relevance_score": 0.5}
    ]
