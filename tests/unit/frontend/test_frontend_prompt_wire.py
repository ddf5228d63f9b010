"""The long-prompt hot path of the frontend: a completions prompt of token ids is checked while
parsed (CompletionIdsRequest) with the same answers as the general decode, its u32 bytes made
once, and the KV router's block hashes travel to the worker with the request."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tests.support.instances import backend_instance
from tests.support.payloads import AwaitedPayloads

from tandem.cbuild import compiler
from tandem.errors import InvalidRequest
from tandem.frontend.api.request_input import decode_completion
from tandem.frontend.migration import EngineStreamer, _continuation
from tandem.frontend.models import ServedModel
from tandem.frontend.pipeline import prompt_ids
from tandem.frontend.pipeline.preprocess import preprocess_completion
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
    from tandem.frontend.api import request_input

    return request_input.decode_body(request_input.completion_decoder, body)


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
    # the u32 parse's edges: each either parsed straight or left to the general decode
    b'{"model":"m","prompt":[0,49151,7],"max_tokens":4}',
    b'{ "model" : "m" ,\n "prompt" :\t[ 1 ,\r\n2 ] , "max_tokens": 4 }',
    b'{"model": "m", "prompt": [1, 4294967295]}',
    b'{"model": "m", "prompt": [1, 4294967296]}',
    b'{"model": "m", "prompt": [1, 99999999999999999999999]}',
    b'{"model": "m", "prompt": [1, -0]}',
    b'{"model": "m", "prompt": [1, 1e2]}',
    b'{"model": "m", "prompt": [1, 2 3]}',
    b'{"model": "m", "prompt": [1, ]}',
    b'{"model": "m", "prompt": [ ]}',
    b'{"model": "m", "prompt": [[1, 2]]}',
    b'{"model": "m", "prompt": [1, [2]]}',
    b'{"model": "m", "prompt": [1, 2], "prompt": [3]}',
    b'{"model": "m", "pr\\u006fmpt": [1, 2], "prompt": [3]}',
    b'{"model": "m", "prompt": [1, 2], "pr\\u006fmpt": [3]}',
    b'{"model": "m", "suffix": "\\"prompt\\": [9]", "prompt": [3]}',
    b'{"model": "m", "logit_bias": {"prompt": [9]}, "prompt": [3]}',
    b'{"model": "m", "prompt": [3], "max_tokens": "four"}',
    b'{"model": "m", "prompt": [3], "n": 0}',
    b'{"model": "m", "prompt": [3], "echo": true, "logprobs": 1}',
    b'{"model": "m", "prompt": [3], "unknown_field": [1]}',
    b'{"model": "m", "prompt": [3]} trailing',
    b'["model", "prompt", [3]]',
    b'{"model": "m", "prompt": [3, 60000, 2, 50000]}',
    # batches of id arrays
    b'{"model": "m", "prompt": [[1, 2], [3, 4, 5]], "n": 2}',
    b'{"model": "m", "prompt": [ [1] ,\n[2,3] ], "echo": true}',
    b'{"model": "m", "prompt": [[1, 2], [3, 60000, 50000]]}',
    b'{"model": "m", "prompt": [[1, 60000], [3]]}',
    b'{"model": "m", "prompt": [[1, 2], [-3]]}',
    b'{"model": "m", "prompt": [[1, 2], []]}',
    b'{"model": "m", "prompt": [[1, 2], [[3]]]}',
    b'{"model": "m", "prompt": [[1, 2], [3],]}',
    b'{"model": "m", "prompt": [[1, 2] [3]]}',
    b'{"model": "m", "prompt": [[1, 2], 3]}',
    b'{"model": "m", "prompt": [[1, 2.5], [3]]}',
    b'{"model": "m", "prompt": [[1, 2], [3]], "max_tokens": -1}',
    b'{"model": "m", "prompt": [[]]}',
    b'{"model": "m", "prompt": [[7]]}',
]


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_ids_fast_path_answers_as_the_general_decode(body: bytes, model: ServedModel) -> None:
    assert _outcome(decode_completion, body, model) == _outcome(_general, body, model)


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_without_the_c_parser_every_body_answers_the_same(
    body: bytes, model: ServedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prompt_ids, "_lib", None)
    monkeypatch.setattr(prompt_ids, "_tried", True)  # as when no compiler was found
    assert prompt_ids.split_prompt(_body([1, 2])) is None
    assert _outcome(decode_completion, body, model) == _outcome(_general, body, model)


needs_cc = pytest.mark.skipif(compiler() is None, reason="no C compiler: the general decode")


@needs_cc
def test_a_flat_id_array_is_parsed_straight_into_u32s(model: ServedModel) -> None:
    ids = [0, 7, 49_151, *range(1000, 1300)]
    req = decode_completion(_body(ids, n=2, echo=True))
    assert isinstance(req.prompt, prompt_ids.U32TokenIds) and req.prompt == ids
    assert (req.n, req.echo, req.max_tokens) == (2, True, 4)  # the rest decoded as usual
    prepared = asyncio.run(
        preprocess_completion(req, model, request_id="r", worker_id=None, deadline_s=None)
    )
    assert prepared.prompt_lens == [len(ids)]
    assert prepared.echo_texts == [model.tokenizer.decode(ids, skip_special_tokens=False)]
    for request in prepared.requests:
        assert request.token_bytes == token_u32(ids) and request.token_ids == ids
        assert decode_request(encode(request)) == request  # the worker sees the same prompt


@needs_cc
@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": [1, 2.0]}',
        b'{"model": "m", "prompt": [1, -2]}',
        b'{"model": "m", "prompt": [1, 02]}',
        b'{"model": "m", "prompt": [1, 4294967296]}',
        b'{"model": "m", "prompt": [1, true]}',
        b'{"model": "m", "prompt": [[[1]]]}',
        b'{"model": "m", "prompt": [[1], "x"]}',
        b'{"model": "m", "prompt": [[1], [2, -3]]}',
        b'{"model": "m", "prompt": [1], "prompt": [2]}',
    ],
)
def test_what_the_u32_parse_refuses_is_left_to_msgspec(body: bytes) -> None:
    assert prompt_ids.split_prompt(body) is None


@needs_cc
def test_a_batch_of_id_arrays_is_parsed_straight_into_u32s(model: ServedModel) -> None:
    batch = [list(range(100, 400)), [5], list(range(49_000, 49_152))]
    req = decode_completion(_body(batch, n=2))
    assert isinstance(req.prompt, list) and req.prompt == batch
    assert all(isinstance(p, prompt_ids.U32TokenIds) for p in req.prompt)
    prepared = asyncio.run(
        preprocess_completion(req, model, request_id="r", worker_id=None, deadline_s=None)
    )
    assert prepared.prompt_lens == [300, 1, 152] and len(prepared.requests) == 6
    for i, request in enumerate(prepared.requests):  # prompt p's choices: 2p, 2p + 1
        assert request.token_ids == batch[i // 2]
        assert request.token_bytes == token_u32(batch[i // 2])
        assert decode_request(encode(request)).token_ids == batch[i // 2]


def _u32(ids: list[int]) -> prompt_ids.U32TokenIds:
    split = prompt_ids.split_prompt(_body(ids))
    assert split is not None
    return split[1]


@needs_cc
def test_u32_token_ids_read_as_the_list_they_stand_for() -> None:
    ids = [5, 0, 4_294_967_295, 12]
    got = _u32(ids)
    assert (len(got), got[0], got[-1], got[1:3], list(got)) == (4, 5, 12, ids[1:3], ids)
    assert got == ids and ids == got and got != ids[:3] and got == _u32(ids)
    assert got + [7] == [*ids, 7] and [7] + got == [7, *ids]  # noqa: RUF005  # __add__, __radd__
    assert got.max_id == 4_294_967_295 and got.u32_le == token_u32(ids)
    assert bool(_u32([0]))


@needs_cc
def test_a_u32_prompt_migrates_and_hands_off_as_prompt_plus_generated() -> None:
    ids = list(range(300, 340))
    request = PreprocessedRequest(
        request_id="r",
        model="m",
        token_ids=_u32(ids),  # type: ignore[arg-type]
        token_bytes=token_u32(ids),
        stop=StopConditions(max_tokens=10),
    )
    assert decode_request(encode(request)).token_ids == ids
    moved = _continuation(request, [7, 8], 1)
    assert moved.token_ids == [*ids, 7, 8] and type(moved.token_ids) is list
    assert decode_request(encode(moved)).token_ids == [*ids, 7, 8]
    handed = request.continued_after([9])
    assert decode_request(encode(handed)).token_ids == [*ids, 9]


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

    def stream(self, address: str, path: str, payload: bytes, **_: object) -> AwaitedPayloads:
        self.payloads.append(payload)
        return AwaitedPayloads(self._answer())

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


def _strict_ids(array_text: str) -> list[int] | None:
    """What the u32 parse must give for a JSON array: its ids when every element is a plain
    integer in [0, 2^32) written as digits, else None (the general decode's business)."""
    try:
        value = json.loads(array_text)
    except ValueError:
        return None
    if not isinstance(value, list) or not value or "-" in array_text:  # -0 is an int in JSON
        return None
    if any(type(x) is not int or not 0 <= x < 2**32 for x in value):
        return None
    return value


@needs_cc
def test_the_u32_parse_agrees_with_a_json_reader_on_random_arrays() -> None:
    rng = random.Random(13)
    odd = ["-1", "-0", "1.5", "1e3", "true", "", "x", "12a", "9" * 11, "00", "01", "4294967296"]
    texts: list[str] = []
    for _ in range(3000):
        parts = []
        for _ in range(rng.randrange(1, 12)):
            r = rng.random()
            if r < 0.7:
                tok = str(rng.randrange(10 ** rng.randrange(1, 11)))
            elif r < 0.8:
                tok = str(rng.randrange(2**32 - 3, 2**32 + 3))
            else:
                tok = rng.choice(odd)
            pad = rng.choice(["", " ", "\n", " \t"]), rng.choice(["", " ", "\r\n"])
            parts.append(pad[0] + tok + pad[1])
        text = "[" + ",".join(parts) + "]"
        split = prompt_ids.split_prompt(b'{"model": "m", "prompt": ' + text.encode() + b"}")
        got = None if split is None else split[1]
        assert isinstance(got, prompt_ids.U32TokenIds | None)
        assert (None if got is None else got.tolist()) == _strict_ids(text), text
        assert got is None or got.max_id == max(got)
        texts.append(text)
    for _ in range(500):  # batches of those arrays, some with a bad one among them
        chosen = rng.sample(texts, rng.randrange(1, 5))
        text = "[" + rng.choice([",", " , ", ",\n"]).join(chosen) + "]"
        split = prompt_ids.split_prompt(b'{"prompt": ' + text.encode() + b"}")
        expected = [_strict_ids(t) for t in chosen]
        if split is None:
            assert None in expected, text
        else:
            assert isinstance(split[1], list) and None not in expected, text
            assert [p.tolist() for p in split[1]] == expected
