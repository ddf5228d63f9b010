"""Property: whatever integers and floats a client puts in the numeric fields of a completions
request, preprocessing either refuses it with InvalidRequest naming the field (and the message
quoting it), or builds engine requests that the request plane can encode and decode intact."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.errors import InvalidRequest
from tandem.frontend.models import ServedModel
from tandem.frontend.pipeline.preprocess import preprocess_completion
from tandem.protocols.discovery import ModelCard
from tandem.protocols.engine import decode_request, encode
from tandem.protocols.openai import CompletionRequest
from tandem.router.source import StaticInstanceSet

EDGES = [0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]
ints = st.one_of(st.integers(), st.sampled_from(EDGES), st.integers(-3, 300))
floats = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([1e-38, 5e-324, 2.0])
fields = st.fixed_dictionaries(
    {},
    optional={
        "seed": ints,
        "top_k": ints,
        "min_tokens": ints,
        "max_tokens": ints,
        "n": st.integers(-2, 140),
        "best_of": st.integers(-2, 10),
        "logprobs": ints,
        "stop_token_ids": st.lists(ints, max_size=4),
        "temperature": floats,
        "top_p": floats,
        "prompt": st.lists(st.lists(ints, min_size=1, max_size=3), min_size=1, max_size=3),
    },
)


@pytest.fixture(scope="module")
def model(smollm2) -> ServedModel:
    card = ModelCard(name="m", context_length=64, block_size=16, num_total_blocks=8)
    served = ServedModel(card, router=None, instances=StaticInstanceSet())  # type: ignore[arg-type]
    served.tokenizer = smollm2
    served.eos_token_ids = [2]
    return served


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=fields)
def test_numbers_are_refused_by_name_or_reach_the_wire_intact(model, values: dict[str, Any]):
    req = CompletionRequest(model="m", **{"prompt": [5, 6, 7], **values})
    try:
        prepared = asyncio.run(
            preprocess_completion(req, model, request_id="r", worker_id=None, deadline_s=None)
        )
    except InvalidRequest as exc:
        assert exc.param is not None, exc.message
        root = exc.param.split("[")[0].split(".")[0]
        assert root in values or root == "prompt", (exc.param, values)
        assert root in exc.message
        return
    for request in prepared.requests:
        assert decode_request(encode(request)) == request
        assert 0 <= request.stop.min_tokens <= request.stop.max_tokens
        assert all(0 <= t < model.tokenizer.vocab_size for t in request.stop.stop_token_ids)
