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
