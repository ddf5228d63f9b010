"""Hostile request bodies against a real frontend and a mocker worker in one process (memory
discovery/events, TCP request plane): each known bad input is a 400 naming the field, the
value and the allowed range, none leaves a request counted in flight on a worker, fan-out
(prompts × n) is capped per request and charged to admission, and a bounded seeded fuzz of
both OpenAI endpoints never gets a 5xx or hangs."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import pytest
from tests.support.eventually import eventually
from tests.support.frontend_stack import CHAT, COMPLETIONS, FrontendStack, Handler
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.protocols.discovery import ModelCard
from tandem.protocols.engine import EngineOutput, decode_request, encode

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"
CARD = ModelCard(
    name=MODEL,
    context_length=256,
    block_size=16,
    num_total_blocks=1024,
    tokenizer=f"gguf:{smollm2_gguf()}",
)


async def _stack(
    exit_stack: AsyncExitStack, handler: Handler | None = None, **config: Any
) -> FrontendStack:
    """A frontend with one mocker worker (or `handler` on the request plane)."""
    s = FrontendStack(exit_stack)
    if handler is None:
        mocker = MockerConfig(
            model_name=MODEL,
            context_length=256,  # bounds what a fuzzed body without max_tokens generates
            num_blocks=4096,
            block_size=16,
            speedup_ratio=0,
            tokenizer=CARD.tokenizer,
        )
        await s.add_worker(MockerEngine(mocker))
    else:
        await s.add_handler(handler, CARD)
    await s.start_frontend(_chat(), **config)
    return s


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def _completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def _assert_names_the_field(status: int, body: Any, param: str | None = None) -> None:
    """A 400 with an OpenAI error body whose param (when it has one) is in the message."""
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if error["param"] is None:
        assert "body" in error["message"], error  # a body-level error says so
    else:
        root = re.split(r"[.\[]", error["param"])[0]
        assert root in error["message"], error


BIG = 2**70
# (endpoint, body, param the 400 must name, text the message must contain)
BAD_INPUTS: list[tuple[str, Any, str | None, str]] = [
    (CHAT, _chat(seed=BIG), "seed", f"seed={BIG}"),
    (COMPLETIONS, _completion(seed=2**64), "seed", "[-2**63, 2**64 - 1]"),
    (COMPLETIONS, _completion(top_k=BIG), "top_k", "[1, 2147483647]"),
    (CHAT, _chat(min_tokens=BIG), "min_tokens", "[0, 2147483647]"),
    (COMPLETIONS, _completion(min_tokens=3), "min_tokens", "exceeds max_tokens=2"),
    (COMPLETIONS, _completion(stop_token_ids=[BIG]), "stop_token_ids[0]", f"={BIG} is not"),
    (COMPLETIONS, _completion(stop_token_ids=[BIG, 3, 49152]), "stop_token_ids[0]", "[0, 49152)"),
    (CHAT, _chat(stop_token_ids=[7, -1]), "stop_token_ids[1]", "[1]=-1 is not a token id"),
    (COMPLETIONS, _completion(stop_token_ids=[49152]), "stop_token_ids[0]", "[0, 49152)"),
    (COMPLETIONS, _completion(max_tokens=BIG), "max_tokens", "[1, 2147483647]"),
    (CHAT, _chat(max_completion_tokens=BIG), "max_completion_tokens", "[1, 2147483647]"),
    (COMPLETIONS, _completion(n=3, best_of=2), "best_of", "[n=3, 128]"),
    (COMPLETIONS, _completion(logit_bias={"²": 1}), "logit_bias", "token ids as keys"),
    (CHAT, _chat(logit_bias={"49152": 1}), "logit_bias", "[0, 49152)"),
    (CHAT, _chat(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (CHAT, _chat(audio={"voice": "alloy"}), "audio", "not supported"),
    (
        CHAT,
        _chat(stream=True, stream_options={"include_obfuscation": True}),
        "stream_options.include_obfuscation",
        "not supported",
    ),
    (
        COMPLETIONS,
        _completion(stream_options={"include_usage": True}),
        "stream_options",
        "unless stream is true",
    ),
    (COMPLETIONS, _completion(prompt=""), "prompt", "no tokens"),
    (CHAT, _chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs.messages", ""),
    (CHAT, _chat(chat_template_kwargs={"add_generation_prompt": 0}), None, "reserved"),
    (CHAT, _chat(chat_template_kwargs={"bos_token": "x"}), None, "reserved"),
    (CHAT, _chat(chat_template_kwargs={"raise_exception": "x"}), None, "reserved"),
    (COMPLETIONS, b'{"model": "smollm2", "prompt": "caf\xe9"}', None, "not valid UTF-8 at byte"),
    (CHAT, b'{"model": "smollm2", "user": "\xc3\x28", "messages": []}', None, "UTF-8"),
    (COMPLETIONS, b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", None, "too deeply"),
    (
        CHAT,
        b'{"model": "smollm2", "tools": [{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}]}",
        None,
        "deep",
    ),
]


async def test_bad_inputs_are_400s_naming_the_field_and_leave_nothing_in_flight() -> None:
    async with AsyncExitStack() as exit_stack:
        s = await _stack(exit_stack)
        for path, body, param, text in BAD_INPUTS:
            status, reply, _ = await s.post(path, body)
            _assert_names_the_field(status, reply, param)
            assert text in reply["error"]["message"], reply
        # seed 2**64 - 1 is valid: choice i gets seed + i, wrapped to 64 bits
        status, reply, _ = await s.post(COMPLETIONS, _completion(seed=2**64 - 1, n=3))
        assert status == 200 and len(reply["choices"]) == 3
        assert await s.inflight_on_workers() == [0.0]  # no phantom request on the worker


def _gated(gate: asyncio.Event, started: list[str]) -> Handler:
    async def handler(payload: bytes, ctx: Any) -> AsyncIterator[bytes]:
        req = decode_request(payload)
        started.append(req.request_id)
        await gate.wait()
        yield encode(EngineOutput(token_ids=[100], finish_reason="length"))

    return handler


async def test_fan_out_is_capped_per_request_and_charged_to_admission() -> None:
    async with AsyncExitStack() as exit_stack:
        gate, started = asyncio.Event(), []
        gate.set()
        config = {"max_inflight_requests": 8, "max_fanout": 6, "retry_after_s": 2.0}
        s = await _stack(exit_stack, _gated(gate, started), **config)
        gate.clear()
        started.clear()
        begun = time.monotonic()
        status, reply, _ = await s.post(COMPLETIONS, _completion(prompt=["a"] * 5000, n=128))
        _assert_names_the_field(status, reply, "prompt")
        assert (
            "fans out to 640000 engine requests (5000 prompts × n=128)" in reply["error"]["message"]
            and "at most 6 per request" in reply["error"]["message"]
        )
        assert time.monotonic() - begun < 2.0 and not started  # refused before any work
        status, reply, _ = await s.post(CHAT, _chat(n=7))
        _assert_names_the_field(status, reply, "n")

        held = asyncio.create_task(s.post(COMPLETIONS, _completion(prompt=["a", "b"], n=3)))
        await eventually(lambda: len(started) == 6)
        status, reply, headers = await s.post(COMPLETIONS, _completion(prompt=["a", "b", "c"]))
        assert status == 503 and headers["Retry-After"] == "2", reply
        assert (
            "6 engine requests in flight + 3 asked exceeds the limit 8"
            in (reply["error"]["message"])
        )
        two = asyncio.create_task(s.post(CHAT, _chat(n=2)))  # 6 + 2 fits
        await eventually(lambda: len(started) == 8)
        gate.set()
        assert (await held)[0] == 200 and (await two)[0] == 200
        status, reply, _ = await s.post(COMPLETIONS, _completion(prompt=["a", "b", "c"]))
        assert status == 200 and len(reply["choices"]) == 3  # the slots came back


# ---------------------------------------------------------------------------- fuzzing
INT_FIELDS = [
    "max_tokens", "max_completion_tokens", "n", "seed", "top_k", "min_tokens", "logprobs",
    "top_logprobs", "best_of",
]  # fmt: skip
FLOAT_FIELDS = [
    "temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
]  # fmt: skip
OTHER_FIELDS = [
    "stop", "stop_token_ids", "stream", "stream_options", "ignore_eos", "echo", "user",
    "skip_special_tokens", "include_stop_str_in_output", "add_generation_prompt",
    "chat_template_kwargs", "tools", "model", "messages", "prompt", "logit_bias", "suffix",
    "audio", "store", "metadata", "service_tier", "modalities", "prediction", "reasoning_effort",
    "safety_identifier", "prompt_cache_key",
]  # fmt: skip
HOSTILE_INTS = [
    0, 1, 2, 3, -1, -2, 7, 128, 129, 255, 256, 49151, 49152, 2**31 - 1, 2**31, 2**32,
    2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 2**70, -(2**100), 10**400,
]  # fmt: skip
HOSTILE_FLOATS = [0.0, -0.0, 1e-38, 5e-324, 1e-5, 0.5, 1.0, 2.0, 2.0001, -1.0, 1e308, 1.5]


def _text(rng: random.Random) -> str:
    alphabet = 'ab \n\t"\\<|im_end|>{}[]%日本✓\u0000\u202e\U0001f600'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))


def _nested(rng: random.Random, depth: int) -> Any:
    value: Any = rng.choice([1, "x", None, {}])
    for _ in range(depth):
        value = [value] if rng.random() < 0.5 else {"k": value}
    return value


def _any_value(rng: random.Random) -> Any:
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice(HOSTILE_INTS)
    if kind == 1:
        return rng.choice(HOSTILE_FLOATS)
    if kind == 2:
        return _text(rng)
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return [rng.choice(HOSTILE_INTS) for _ in range(rng.randint(0, 4))]
    if kind == 5:
        return [_text(rng) for _ in range(rng.randint(0, 20))]
    if kind == 6:
        return _nested(rng, rng.choice([1, 3, 50, 400]))
    if kind == 7:
        return {_text(rng): _any_value(rng) for _ in range(rng.randint(0, 3))}
    if kind == 8:
        contents = [_text(rng), [{"type": "text", "text": _text(rng)}], 3, None]
        roles = ["user", "system", "assistant", "", 5]
        return [{"role": rng.choice(roles), "content": c} for c in contents][: rng.randint(0, 4)]
    return rng.randint(-3, 40)


def _mutate_field(rng: random.Random, body: dict[str, Any]) -> None:
    kind = rng.randrange(6)
    if kind == 0:
        body[rng.choice(INT_FIELDS)] = rng.choice(HOSTILE_INTS)
    elif kind == 1:
        body[rng.choice(FLOAT_FIELDS)] = rng.choice(HOSTILE_FLOATS)
    elif kind == 2:
        body[rng.choice(INT_FIELDS + FLOAT_FIELDS + OTHER_FIELDS)] = _any_value(rng)
    elif kind == 3:
        body.pop(rng.choice(list(body)), None)
    elif kind == 4:
        keys = ["messages", "bos_token", "tools", "x", "add_generation_prompt", _text(rng)]
        body["chat_template_kwargs"] = {rng.choice(keys): _any_value(rng)}
    else:
        body[_text(rng) or "extra"] = _any_value(rng)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    kind = rng.randrange(5)
    if kind == 0 and data:
        return data[: rng.randrange(len(data))]  # truncated
    if kind == 1:
        i = rng.randrange(len(data) + 1)
        return data[:i] + bytes([rng.choice([0xFF, 0xC3, 0xED, 0x80, 0x00])]) + data[i:]
    if kind == 2:
        return data.replace(b'"hi"', b'"h\\ud800i"', 1)  # lone surrogate escape
    if kind == 3:
        depth = rng.choice([100, 1000, 100000])
        return data[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
    return rng.choice([b"", b"null", b"[]", b"1e999", b'"x"', b"{", b"{}"])


def _random_body(rng: random.Random, chat: bool) -> bytes:
    body = _chat() if chat else _completion()
    if not chat and rng.random() < 0.3:
        body["prompt"] = rng.choice([[5, 6, 7], ["a", "b"], [[5, 6], [7]], ["a"] * 300])
    for _ in range(rng.randint(1, 3)):
        _mutate_field(rng, body)
    data = json.dumps(body).encode()
    return _mutate_bytes(rng, data) if rng.random() < 0.25 else data


FUZZ_SEED = int(os.environ.get("TANDEM_FUZZ_SEED", "20261123"))  # another seed explores more
FUZZ_BODIES_PER_ENDPOINT = int(os.environ.get("TANDEM_FUZZ_BODIES", "300"))
FUZZ_BUDGET_S = 30.0


async def test_random_bodies_to_both_endpoints_never_get_a_5xx_or_hang() -> None:
    rng = random.Random(FUZZ_SEED)
    bodies = [
        (path, _random_body(rng, path == CHAT))
        for _ in range(FUZZ_BODIES_PER_ENDPOINT)
        for path in (CHAT, COMPLETIONS)
    ]
    bodies += [(path, body if isinstance(body, bytes) else json.dumps(body).encode())
               for path, body, _, _ in BAD_INPUTS]  # fmt: skip
    async with AsyncExitStack() as exit_stack:
        s = await _stack(exit_stack)
        statuses: dict[int, int] = {}
        sem = asyncio.Semaphore(4)

        async def send(path: str, data: bytes) -> None:
            async with sem, asyncio.timeout(15):  # a hang fails here
                status, reply, _ = await s.post(path, data)
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500, (path, data[:300], reply)
            if status == 400:
                _assert_names_the_field(status, reply)
            elif status == 404:
                assert reply["error"]["param"] == "model", reply
            else:
                assert status == 200, (path, data[:300], status, reply)

        async with asyncio.timeout(FUZZ_BUDGET_S):
            await asyncio.gather(*(send(path, data) for path, data in bodies))
        assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 100, statuses
        assert await s.inflight_on_workers() == [0.0]
        status, reply, _ = await s.post(CHAT, _chat())
        assert status == 200 and reply["choices"][0]["finish_reason"] == "length"


def test_max_fanout_is_a_flag_with_a_bounded_default() -> None:
    import argparse

    from tandem.frontend.args import add_frontend_args, frontend_config_from_args
    from tandem.frontend.config import FrontendConfig

    assert FrontendConfig().max_fanout == 128
    with pytest.raises(ValueError, match="max_fanout=0"):
        FrontendConfig(max_fanout=0)
    parser = argparse.ArgumentParser()
    add_frontend_args(parser)
    assert frontend_config_from_args(parser.parse_args(["--max-fanout", "9"])).max_fanout == 9


def _half_closed(host: str, port: int, sent: bytes) -> bytes:
    """Send `sent`, shut down the write side (as `nc -N` and some health checkers do) and
    read until the server closes (5 s at most)."""
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(sent)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def test_every_route_kind_answers_a_half_closed_client_and_http_0_9_is_400() -> None:
    async with AsyncExitStack() as exit_stack:
        s = await _stack(exit_stack)
        host, port = s.base.removeprefix("http://").rsplit(":", 1)

        async def exchange(sent: bytes) -> bytes:
            return await asyncio.to_thread(_half_closed, host, int(port), sent)

        for path in ("/live", "/health", "/v1/models"):
            data = await exchange(b"GET %s HTTP/1.1\r\nHost: h\r\n\r\n" % path.encode())
            assert data.startswith(b"HTTP/1.1 200 OK\r\n"), (path, data[:200])
        body = json.dumps(_chat()).encode()
        post = b"POST %s HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n%s" % (
            CHAT.encode(),
            len(body),
            body,
        )
        data = await exchange(post)
        assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b'"finish_reason"' in data, data
        data = await exchange(
            b"GET /live HTTP/1.1\r\n\r\n" + post + b"GET /v1/models HTTP/1.1\r\n\r\n"
        )
        finals = re.findall(rb"HTTP/1\.1 (\d\d\d) ", data)
        assert [s for s in finals if not s.startswith(b"1")] == [b"200"] * 3, data
        assert (
            data.index(b'"status":"live"')
            < data.index(b'"finish_reason"')
            < data.rindex(b'"object":"list"')
        )
        data = await exchange(b"GET /live\r\n\r\n")  # no HTTP version: HTTP/0.9
        assert data.startswith(b"HTTP/1.1 400 ") and b"needs HTTP/1.1 or HTTP/1.0" in data
