"""A remote router gets a request's images as mm_hashes and rows only, never their bytes."""

from __future__ import annotations

from tandem.protocols.engine import MmItem, PreprocessedRequest, StopConditions
from tandem.router.remote import _hashes_only


def test_image_bytes_stay_out_of_the_route_call() -> None:
    item = MmItem(mm_hash=5, offset=1, num_tokens=3, image_bytes=b"\x89PNG...")
    request = PreprocessedRequest(
        request_id="r", model="m", token_ids=[1, 16, 16, 16, 2], stop=StopConditions(max_tokens=1),
        mm_items=[item],
    )  # fmt: skip
    sent = _hashes_only(request)
    assert [(i.mm_hash, i.offset, i.num_tokens, i.image_bytes) for i in sent.mm_items] == [
        (5, 1, 3, None)
    ]
    assert request.mm_items[0].image_bytes == b"\x89PNG..."  # the caller's request is untouched
    text_only = PreprocessedRequest(
        request_id="t", model="m", token_ids=[1], stop=StopConditions(max_tokens=1)
    )
    assert _hashes_only(text_only) is text_only


def test_a_prompt_parsed_to_u32s_reaches_the_router_service_as_its_ids():
    """`--router remote` with a completions prompt the frontend parsed straight into u32s
    (frontend/prompt_ids.U32TokenIds): the route request carries the same ids."""
    from array import array

    from tandem.frontend.pipeline.prompt_ids import U32TokenIds
    from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions
    from tandem.router.messages import RouteRequest, encode, route_request_decoder

    ids = U32TokenIds(array("I", [5, 70000, 4294967295, 0]), 4294967295)
    request = PreprocessedRequest(
        request_id="r",
        model="m",
        token_ids=ids,  # type: ignore[arg-type]
        sampling=SamplingParams(),
        stop=StopConditions(max_tokens=4),
    )
    decoded = route_request_decoder.decode(encode(RouteRequest(request=request)))
    assert decoded.request.token_ids == [5, 70000, 4294967295, 0]
