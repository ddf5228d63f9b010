from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.errors import EngineError
from tandem.frontend.pipeline.postprocess import ChoiceState, StopStringMatcher, best_candidates
from tandem.protocols.engine import EngineOutput


def _feed_all(matcher: StopStringMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush()


def test_stop_string_split_across_pieces_is_never_emitted() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == "abc"  # the last len("STOP") - 1 chars are held back
    assert m.feed("O") == " "
    assert m.feed("Pxyz") == ""
    assert m.matched == "STOP"
    assert m.feed("more") == "" and m.flush() == ""


def test_earliest_of_several_stops_wins_and_include_option() -> None:
    m = StopStringMatcher(["world", "lo w"], include_in_output=True)
    assert _feed_all(m, ["hel", "lo wor", "ld"]) == "hello w"
    assert m.matched == "lo w"


def test_partial_prefix_at_end_is_flushed_when_no_match() -> None:
    m = StopStringMatcher(["STOP"])
    assert _feed_all(m, ["abc", "ST"]) == "abcST"
    assert m.matched is None


@given(
    text=st.text(alphabet="abST OP", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_matches_one_shot_truncation_for_any_split(text: str, cuts: list[int]) -> None:
    stops = ["STOP", "bb"]
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    hits = [p for p in (text.find(s) for s in stops) if p != -1]
    expected = text[: min(hits)] if hits else text
    assert _feed_all(StopStringMatcher(stops), pieces) == expected


def test_choice_state_finishes_on_stop_string_and_counts_tokens(smollm2) -> None:
    ids = smollm2.encode("The answer is 42. STOP now")
    state = ChoiceState(0, smollm2, ["STOP"])
    text = ""
    for tid in ids:
        state.process(EngineOutput(token_ids=[tid]))
        text += state.delta_text
        if state.finish_reason:
            break
    assert text == "The answer is 42. "
    assert state.finish_reason == "stop"
    assert state.num_tokens < len(ids)


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_a_chunk_of_several_tokens_counts_only_those_up_to_the_stop(smollm2, chunk: int) -> None:
    """A verified draft or a coalesced batch brings several tokens at once: the tokens after
    the one that completes the stop string are not text, not usage and not logprobs, whatever
    the chunking (one token a chunk is the reference)."""
    ids = smollm2.encode("The answer is 42. STOP now and then some more")
    stop_at = next(n for n in range(1, len(ids) + 1) if "STOP" in smollm2.decode(ids[:n]))
    state = ChoiceState(0, smollm2, ["STOP"])
    text, entries = "", 0
    for i in range(0, len(ids), chunk):
        piece = ids[i : i + chunk]
        state.process(EngineOutput(token_ids=piece, logprobs=[-0.5] * len(piece)))
        text += state.delta_text
        entries += len(state.delta_logprobs or [])
        if state.finish_reason:
            break
    assert (text, state.finish_reason) == ("The answer is 42. ", "stop")
    assert state.num_tokens == entries == stop_at < len(ids)
    assert state.sum_logprob == -0.5 * stop_at


def test_choice_state_maps_finish_and_engine_error(smollm2) -> None:
    state = ChoiceState(0, smollm2, [])
    state.process(
        EngineOutput(token_ids=smollm2.encode("hi"), finish_reason="length", num_cached_tokens=3)
    )
    assert (state.delta_text, state.finish_reason, state.num_cached_tokens) == ("hi", "length", 3)
    with pytest.raises(EngineError, match="boom"):
        ChoiceState(0, smollm2, []).process(EngineOutput(finish_reason="error", error="boom"))


def _candidate(index: int, logprobs: list[float]) -> ChoiceState:
    state = ChoiceState(index, None, [])
    out = EngineOutput(token_ids=list(range(len(logprobs))), logprobs=logprobs)
    state.process(out, keep_text=True)
    return state


def test_best_of_keeps_the_highest_mean_logprob_per_prompt_renumbered() -> None:
    states = [
        _candidate(0, [-1.0, -1.0]),  # prompt 0: mean -1
        _candidate(1, [-0.1, -3.0, -0.1, -0.1]),  # mean -0.825: best, though its sum is lower
        _candidate(2, [-2.0]),
        _candidate(3, [-0.5]),  # prompt 1: best
        _candidate(4, [-0.7]),
        _candidate(5, [-0.6]),
    ]
    chosen = best_candidates(states, best_of=3, n=2, keep_logprobs=False)
    got = [(s.index, round(s.sum_logprob, 6)) for s in chosen]
    assert got == [(0, -3.3), (1, -2.0), (2, -0.5), (3, -0.6)]
    assert all(s.all_logprobs is None for s in chosen)  # the client did not ask for them
