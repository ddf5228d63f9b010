"""The mocker hashes image rows like the router and the native engine (DESIGN.md §5), and its
greedy pseudo-answer depends on the images, not only on the placeholder tokens."""

from __future__ import annotations

import msgspec

from tandem.engines.mocker.admission import make_sequence
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.sequence import request_seed
from tandem.protocols.engine import MmItem, PreprocessedRequest, SamplingParams, StopConditions
from tandem.tokens.hashing import sequence_hashes

BS = 4
PROMPT = [5, 6, 7] + [16] * 9 + [8, 9, 10, 11]  # image rows 3..11


def _request(mm_hash: int) -> PreprocessedRequest:
    item = MmItem(mm_hash=mm_hash, offset=3, num_tokens=9)
    return PreprocessedRequest(
        request_id="r", model="m", token_ids=PROMPT, sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=4), mm_items=[item],
    )  # fmt: skip


def test_block_hashes_match_the_router_view_when_extended_in_steps() -> None:
    request = _request(0xABC)
    seq = make_sequence(MockerConfig(block_size=BS), request, {})
    assert seq.hashes_upto(1) == sequence_hashes(PROMPT[:4], BS, mm_items=request.mm_items)
    assert seq.hashes_upto(4) == sequence_hashes(PROMPT, BS, mm_items=request.mm_items)
    assert seq.hashes_upto(4) != sequence_hashes(PROMPT, BS)


def test_greedy_answer_depends_on_the_image() -> None:
    assert request_seed(_request(1)) != request_seed(_request(2))
    assert request_seed(_request(1)) == request_seed(_request(1))


def _greedy(tokens: list[int], mm_hashes: tuple[int, ...] = ()) -> PreprocessedRequest:
    items = [MmItem(mm_hash=h, offset=0, num_tokens=1) for h in mm_hashes]
    return PreprocessedRequest(
        request_id="x", model="m", token_ids=tokens, sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=4), mm_items=items,
    )  # fmt: skip


def test_greedy_seed_is_the_prompt_not_the_request() -> None:
    seed = request_seed(_greedy([1, 2, 3]))
    assert seed == request_seed(msgspec.structs.replace(_greedy([1, 2, 3]), request_id="y"))
    assert seed != request_seed(_greedy([1, 2, 4]))
    assert seed != request_seed(_greedy([1, 2, 3, 0]))
    # an image hash never reads as a prompt id, nor the other way round
    assert request_seed(_greedy([1, 2], (3,))) != request_seed(_greedy([1, 2, 3]))
    assert request_seed(_greedy([1, 2], ((1 << 63) + 3,))) != request_seed(_greedy([1, 2, 3]))
    assert request_seed(_greedy([1], (2, 3))) != request_seed(_greedy([1, 2], (3,)))
    # ids beyond int64 still seed (by their repr), deterministically
    big = [1 << 70, 5]
    assert request_seed(_greedy(big)) == request_seed(_greedy(list(big)))
    assert request_seed(_greedy(big)) != request_seed(_greedy([1 << 71, 5]))
