"""The long-prompt hot path of the frontend: a completions prompt of token ids is checked while
parsed (CompletionIdsRequest) with the same answers as the general decode, its u32 bytes made
once, and the KV router's block hashes travel to the worker with the request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tests.support.instances import backend_instance

from tandem.errors import InvalidRequest
from tandem.frontend.decode import decode_completion
from tandem.frontend.migration import EngineStreamer
from tandem.frontend.models import ServedModel
from tandem.frontend.preprocess import preprocess_completion
from tandem.protocols.discovery import ModelCard
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
    decode_request,
    encode,
    token_u32,
)
from tandem.protocols.openai import CompletionIdsRequest, CompletionRequest
from tandem.router.config import RouterConfig
from tandem.router.kv_router import KvRouter
from tandem.router.registry import make_router
from tandem.router.source import StaticInstanceSet
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(20)


@pytest.fixture(scope="module")
def model(smollm2) -> ServedModel:
    card = ModelCard(name="m", context_length=4096, block_size=16, num_total_blocks=64)
    served = ServedModel(card, router=None, instances=StaticInstanceSet())  # type: ignore[arg-type]
    served.tokenizer = smollm2
    served.eos_token_ids = [2]
    return served


def _body(prompt: Any, **fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4, **fields}).encode()


def _outcome(decode: Any, body: bytes, model: ServedModel) -> tuple[str, Any]:
    try:
        req = decode(body)
        prepared = asyncio.run(
            preprocess_completion(req, model, request_id="r", worker_id=None, deadline_s=None)
        )
    except InvalidRequest as exc:
        return "error", (exc.status_code, exc.param, exc.message)
    return "ok", [(r.token_ids, r.token_bytes, r.stop) for r in prepared.requests]


def _general(body: bytes) -> CompletionRequest:
    from tandem.frontend import decode

    return decode.decode_body(decode.completion_decoder, body)


BODIES = [
    _body(list(range(100, 400))),
    _body([5]),
    _body([]),
    _body([1, -2, 3]),
    _body([1, 2**32, 3]),
    _body([1, 2**64, 3]),
    _body([1, 49_152, 3]),  # the vocabulary's size: one past its last id
    _body([1, 49_151]),
    _body([1, 2.0, 3]),
    _body([1, True]),
    _body([1, None]),
    _body("text prompt"),
    _body(["a", "b"]),
    _body([[1, 2], [3]]),
    _body([[1, 2], "x"]),
    _body([1, 2], echo=True),
    _body([1, 2], n=2),
    b'{"model": "m", "prompt": [1, 2,]}',
    b'{"model": "m", "prompt": [1, 02]}',
    b'{"model": "m", "prompt": [1, 2]',
]


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_ids_fast_path_answers_as_the_general_decode(body: bytes, model: ServedModel) -> None:
    assert _outcome(decode_completion, body, model) == _outcome(_general, body, model)


def test_a_list_of_ids_takes_the_fast_path_and_carries_its_bytes(model: ServedModel) -> None:
    ids = list(range(100, 400))
    req = decode_completion(_body(ids))
    assert isinstance(req, CompletionIdsRequest)
    assert not isinstance(decode_completion(_body("hi")), CompletionIdsRequest)
    prepared = asyncio.run(
        preprocess_completion(req, model, request_id="r", worker_id=None, deadline_s=None)
    )
    (request,) = prepared.requests
    assert request.token_bytes == token_u32(ids)
    assert decode_request(encode(request)) == request


def test_vocab_range_error_names_the_first_offender(model: ServedModel) -> None:
    kind, (status, param, message) = _outcome(decode_completion, _body([1, 60_000, 50_000]), model)
    assert (kind, status, param) == ("error", 400, "prompt")
    assert "prompt token id 60000 out of range; expected [0, 49152)" in message


class Capture:
    """A request plane that records each payload and answers one finished token."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def stream(self, address: str, path: str, payload: bytes, **_: object) -> AsyncIterator[bytes]:
        self.payloads.append(payload)
        return self._answer()

    async def _answer(self) -> AsyncIterator[bytes]:
        yield encode(EngineOutput(token_ids=[1], finish_reason="length"))

    async def close(self) -> None:
        pass


async def _send(router: Any, prompt: list[int]) -> PreprocessedRequest:
    plane = Capture()
    streamer = EngineStreamer(plane, "tandem.backend.generate")  # type: ignore[arg-type]
    request = PreprocessedRequest(
        request_id="r", model="m", token_ids=prompt, stop=StopConditions(max_tokens=1)
    )
    async for _ in streamer.stream(request, router):
        pass
    (payload,) = plane.payloads
    return decode_request(payload, materialize=False)


async def test_the_kv_routers_hashes_travel_with_the_request() -> None:
    card = ModelCard(name="m", context_length=4096, block_size=4, num_total_blocks=100)
    instances = StaticInstanceSet([backend_instance(i, card) for i in range(2)])
    router = make_router("kv", RouterConfig(seed=0), instances=instances)
    assert isinstance(router, KvRouter)
    prompt = list(range(1000, 1042))
    got = await _send(router, prompt)
    assert got.token_ids == [] and got.num_prompt_tokens == 42
    assert (got.block_hashes, got.hash_block_size) == (sequence_hashes(prompt, 4), 4)


async def test_a_policy_that_hashes_nothing_ships_no_hashes() -> None:
    instances = StaticInstanceSet([backend_instance(0)])
    router = make_router("round_robin", RouterConfig(seed=0), instances=instances)
    got = await _send(router, list(range(50)))
    assert (got.block_hashes, got.hash_block_size) == (None, 0)
    assert got.num_prompt_tokens == 50
