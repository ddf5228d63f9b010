"""A migrated request's continuation: the tokens generated so far join the prompt, and the
engine is told they are output (penalties keep counting them)."""

from __future__ import annotations

from tandem.frontend.migration import _continuation
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions


def test_a_continuation_carries_the_generated_tokens_as_output() -> None:
    request = PreprocessedRequest(
        request_id="r",
        model="m",
        token_ids=[1, 2, 3],
        sampling=SamplingParams(frequency_penalty=1.0, logit_bias={5: -100.0}),
        stop=StopConditions(max_tokens=10, min_tokens=4),
    )
    first = _continuation(request, [7, 7], 1)
    assert first.token_ids == [1, 2, 3, 7, 7] and first.num_generated_tokens == 2
    assert (first.stop.max_tokens, first.stop.min_tokens) == (8, 2)
    assert first.sampling == request.sampling  # penalties and bias travel unchanged
    second = _continuation(request, [7, 7, 8], 2)  # `generated` accumulates across attempts
    assert second.token_ids == [1, 2, 3, 7, 7, 8] and second.num_generated_tokens == 3


def test_a_continuation_keeps_whose_request_it_is() -> None:
    """The adapter, the cache salt, the class, the tenant and the session travel with a migrated
    request: its new worker must apply the same adapter (issue 32) and share KV only with the
    same salt, and the router queue and schedulers order it as before (issue 33)."""
    request = PreprocessedRequest(
        request_id="r",
        model="m",
        token_ids=[1, 2, 3],
        stop=StopConditions(max_tokens=10),
        lora_name="a1",
        cache_salt="alice",
        priority=-1,
        tenant="t",
        tenant_weight=2.0,
        session_id="s",
    )
    moved = _continuation(request, [7], 1)
    kept = ("lora_name", "cache_salt", "priority", "tenant", "tenant_weight", "session_id")
    assert [getattr(moved, f) for f in kept] == [getattr(request, f) for f in kept]
