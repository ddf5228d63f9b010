"""A bounded seeded fuzz of `/v1/messages` and `/v1/messages/count_tokens` against a real
frontend and a mocker worker: hostile values in every field and content block never get a 5xx
or hang, every refusal is Anthropic's error shape with a message, and nothing stays in flight
on the worker."""

from __future__ import annotations

import json
import os
import random
from contextlib import AsyncExitStack
from typing import Any

import pytest
from tests.support.eventually import eventually
from tests.support.frontend_stack import FrontendStack

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine

pytestmark = pytest.mark.timeout(90)
MODEL = "smollm2"
MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
SEED = int(os.environ.get("TANDEM_FUZZ_SEED", "20261128"))
NUM_BODIES = int(os.environ.get("TANDEM_FUZZ_BODIES", "150"))
HOSTILE: list[Any] = [
    None, True, 0, -1, 2**31, 2**64, 1e308, 3.5, "", "x" * 5000, "\x00", [], [[]], [None], {},
    {"type": "text"}, {"type": "enabled"}, {"type": "tool", "name": 5}, {"type": "any"},
    [{"name": "f"}], [{"name": "f", "input_schema": {"type": "object"}}],
    [{"type": "web_search_20250305", "name": "w"}], {"user_id": ["a"]}, ["a", ""],
]  # fmt: skip
BLOCKS: list[Any] = [
    {"type": "text"}, {"type": "text", "text": 5}, {"type": "image"},
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!"}},
    {"type": "image", "source": {"type": "url", "url": "http://10.0.0.1/a.png"}},
    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image"}]},
    {"type": "tool_result"}, {"type": "tool_use", "id": "t", "name": "f", "input": 5},
    {"type": "thinking", "thinking": "x"}, {"type": "document"}, "text", 5, None,
]  # fmt: skip
FIELDS = [
    "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "thinking", "metadata", "service_tier",
    "cache_control", "output_config", "speed", "container", "inference_geo", "unknown_field",
]  # fmt: skip


def _body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    }
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.1:
            body.pop(rng.choice(list(body)), None)
        elif roll < 0.45:
            role = rng.choice(["user", "assistant", "system", "tool", 5])
            content = [rng.choice(BLOCKS) for _ in range(rng.randint(1, 2))]
            first = body.get("messages")
            first = first[:1] if isinstance(first, list) else []
            body["messages"] = [*first, {"role": role, "content": content}]
        else:
            body[rng.choice(FIELDS)] = rng.choice(HOSTILE)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 2  # bounds what a fuzzed body generates
    return body


async def test_random_bodies_never_get_a_5xx_or_hang() -> None:
    rng = random.Random(SEED)
    bodies = []
    for _ in range(NUM_BODIES):
        body = _body(rng)
        path = COUNT if rng.random() < 0.25 else MESSAGES
        if path == COUNT:
            body = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
        data = json.dumps(body).encode()
        bodies.append((path, data[: rng.randrange(len(data))] if rng.random() < 0.05 else data))
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        mocker = MockerConfig(speedup_ratio=0, context_length=256)
        worker = await s.add_worker(MockerEngine(mocker))
        ready = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        await s.start_frontend(ready, ready_path=MESSAGES)

        def check(path: str, data: bytes, status: int, reply: Any) -> None:
            assert status < 500, (path, data[:300], reply)
            if status != 200:
                assert status in (400, 404), (path, data[:300], status, reply)
                assert reply["type"] == "error" and reply["error"]["message"], reply
                kind = "not_found_error" if status == 404 else "invalid_request_error"
                assert reply["error"]["type"] == kind, reply

        statuses = await s.post_all(bodies, check)
        assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses
        await eventually(lambda: worker.num_inflight == 0, timeout_s=5)
