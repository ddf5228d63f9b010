"""The frontend's admission (`pipeline.generate.Admission`): a request's fan-out is capped
per request (400 naming the field) and slots are held for a block, 503 past the bound, given
back however the block ends."""

from __future__ import annotations

import pytest

from tandem.errors import InvalidRequest, Overloaded
from tandem.frontend.observability.metrics import close_tally, count_as, open_tally
from tandem.frontend.pipeline.generate import Admission
from tandem.protocols.openai import ChatCompletionRequest, CompletionRequest


def _chat(n: int = 1) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=n)


def test_fan_out_is_prompts_times_n_up_to_the_cap() -> None:
    admission = Admission(max_inflight=8, max_fanout=4, retry_after_s=1.0)
    assert admission.fan_out(_chat(n=3)) == 3
    assert admission.fan_out(CompletionRequest(model="m", prompt=["a", "b"], n=2)) == 4
    with pytest.raises(InvalidRequest) as exc:
        admission.fan_out(_chat(n=5))
    assert exc.value.param == "n" and "at most 4 per request" in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        admission.fan_out(CompletionRequest(model="m", prompt=["a", "b", "c"], n=2))
    assert exc.value.param == "prompt" and "3 prompts" in exc.value.message


def test_slots_are_held_for_the_block_and_refused_past_the_bound() -> None:
    admission = Admission(max_inflight=4, max_fanout=4, retry_after_s=2.5)
    with admission.slots(3):
        assert admission.num_inflight == 3
        with pytest.raises(Overloaded) as exc, admission.slots(2):
            pass
        assert exc.value.retry_after_s == 2.5
        assert admission.num_inflight == 3  # a refusal takes nothing
        with admission.slots(1):
            assert admission.num_inflight == 4
    assert admission.num_inflight == 0
    with pytest.raises(RuntimeError), admission.slots(2):
        raise RuntimeError("the request failed")
    assert admission.num_inflight == 0  # given back however the block ends


def test_count_as_labels_the_open_tally_only() -> None:
    count_as("m", stream=True)  # no tally open: nothing to label, no error
    tally, token = open_tally()
    try:
        count_as("m", stream=True)
        assert (tally.model, tally.request_type, tally.status) == ("m", "stream", "success")
        count_as("m", stream=True, failed=True)
        assert tally.status == "error"
    finally:
        close_tally(token)
