"""The request plane's PreprocessedRequest wire form (version 2): the prompt as one LE u32
buffer, the router's block hashes beside it, and version-1 payloads still read."""

from __future__ import annotations

import msgspec
import pytest

from tandem.protocols.engine import (
    PreprocessedRequest,
    StopConditions,
    decode_request,
    encode,
    encode_request,
    prompt_array,
    token_u32,
)

pytestmark = pytest.mark.timeout(10)
PROMPT = [0, 1, 255, 256, 65_535, 65_536, 49_151, 2**32 - 1] * 100


def _request(token_ids: list[int], **fields: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r", model="m", token_ids=token_ids, stop=StopConditions(max_tokens=3),
        **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def _raw(payload: bytes) -> dict[str, object]:
    return msgspec.msgpack.decode(payload)  # type: ignore[no-any-return]


def test_prompt_travels_as_one_u32_buffer_and_comes_back_equal() -> None:
    payload = encode_request(_request(PROMPT))
    raw = _raw(payload)
    assert raw["token_ids"] == []  # never a msgpack array of ints
    assert raw["token_bytes"] == token_u32(PROMPT) and len(raw["token_bytes"]) == 4 * len(PROMPT)  # type: ignore[arg-type]
    back = decode_request(payload)
    assert back.token_ids == PROMPT and back.num_prompt_tokens == len(PROMPT)
    assert decode_request(encode(_request(PROMPT))) == decode_request(payload)


def test_unmaterialized_decode_keeps_the_buffer_and_counts_from_it() -> None:
    request = decode_request(encode_request(_request(PROMPT)), materialize=False)
    assert request.token_ids == []
    assert request.num_prompt_tokens == len(PROMPT)
    assert prompt_array(request).tolist() == PROMPT


def test_version_1_list_payload_still_reads() -> None:
    v1 = msgspec.msgpack.encode(_request(PROMPT, version=1))  # a list of ints, no token_bytes
    assert "token_bytes" not in _raw(v1)
    for materialize in (True, False):
        request = decode_request(v1, materialize=materialize)
        assert request.token_ids == PROMPT and request.num_prompt_tokens == len(PROMPT)
        assert prompt_array(request).tolist() == PROMPT


def test_ids_beyond_u32_travel_as_a_list() -> None:
    ids = [1, 2**32, 3]
    raw = _raw(encode_request(_request(ids)))
    assert raw["token_ids"] == ids and "token_bytes" not in raw
    assert decode_request(encode_request(_request(ids))).token_ids == ids


def test_a_stale_cached_buffer_is_not_sent() -> None:
    request = _request(PROMPT, token_bytes=token_u32(PROMPT))
    longer = msgspec.structs.replace(request, token_ids=[*PROMPT, 7, 8])  # cache now stale
    assert decode_request(encode_request(longer)).token_ids == [*PROMPT, 7, 8]
    cut = msgspec.structs.replace(request, token_ids=PROMPT[:5])
    assert decode_request(encode_request(cut)).token_ids == PROMPT[:5]
    assert prompt_array(cut).tolist() == PROMPT[:5]


def test_a_list_sent_beside_a_buffer_wins() -> None:
    both = msgspec.msgpack.encode(_request([1, 2], token_bytes=token_u32([3, 4])))
    for materialize in (True, False):
        request = decode_request(both, materialize=materialize)
        assert request.token_bytes is None and prompt_array(request).tolist() == [1, 2]


def test_token_bytes_not_a_multiple_of_four_is_refused() -> None:
    bad = msgspec.msgpack.encode(_request([], token_bytes=b"\x01\x00\x00"))
    with pytest.raises(msgspec.ValidationError, match="token_bytes has 3 bytes"):
        decode_request(bad)


def test_block_hashes_ride_along() -> None:
    hashes = [2**64 - 1, 5, 2**63]
    payload = encode_request(_request(PROMPT), block_hashes=hashes, hash_block_size=16)
    back = decode_request(payload, materialize=False)
    assert (back.block_hashes, back.hash_block_size) == (hashes, 16)
    assert "block_hashes" not in _raw(encode_request(_request(PROMPT)))
