"""`PreprocessedRequest.continued_after`: the one way a request carries on after tokens it
generated elsewhere (migration, a disaggregated decode leg, the decode worker resuming after
the prefill's first token)."""

from __future__ import annotations

import msgspec

from tandem.protocols.engine import (
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
    StructuredOutput,
    decode_request,
    encode,
    token_u32,
)


def _request(**stop: int) -> PreprocessedRequest:
    ids = list(range(100, 110))
    return PreprocessedRequest(
        request_id="r",
        model="m",
        token_ids=ids,
        token_bytes=token_u32(ids),
        sampling=SamplingParams(structured=StructuredOutput(kind="json")),
        stop=StopConditions(**{"max_tokens": 8, **stop}),
        block_hashes=[1, 2],
        hash_block_size=4,
        disagg_params={"mode": "pull"},
    )


def test_prompt_grows_by_the_tokens_counted_as_generated() -> None:
    request = _request(min_tokens=3)
    once = request.continued_after([7, 8])
    assert once.token_ids == [*range(100, 110), 7, 8]
    assert once.num_generated_tokens == 2
    assert (once.stop.max_tokens, once.stop.min_tokens) == (6, 1)
    assert once.token_bytes is None  # the shorter prompt's bytes are not this prompt's
    twice = once.continued_after([9])
    assert twice.num_generated_tokens == 3 and twice.token_ids[-3:] == [7, 8, 9]
    assert (twice.stop.max_tokens, twice.stop.min_tokens) == (5, 0)
    assert request.token_ids == list(range(100, 110))  # the original is untouched
    assert request.token_bytes is not None


def test_the_budget_never_drops_below_one_token() -> None:
    request = _request(max_tokens=2)
    assert request.continued_after([1, 2, 3]).stop.max_tokens == 1


def test_what_the_caller_owns_is_kept() -> None:
    request = _request()
    cont = request.continued_after([7])
    assert cont.request_id == "r" and cont.disagg_params == {"mode": "pull"}
    assert cont.sampling == request.sampling  # a structured constraint: nothing to count
    assert cont.block_hashes == [1, 2]  # a prefix of them stays valid as the prompt grows
    assert decode_request(encode(cont)).token_ids == [*range(100, 110), 7]


def test_a_structured_output_of_wire_version_2_still_decodes() -> None:
    """Senders before the one counter carried StructuredOutput.num_output_tokens (always the
    request's num_generated_tokens): it decodes, ignored."""
    old = msgspec.msgpack.encode({"kind": "json", "num_output_tokens": 2})
    assert msgspec.msgpack.decode(old, type=StructuredOutput) == StructuredOutput(kind="json")
