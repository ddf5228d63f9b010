"""A bounded seeded fuzz of `/v1/embeddings` and `/v1/responses` against a real frontend and a
mocker worker: hostile values in every field never get a 5xx or hang, every 400 names its
field (or says the body is bad), and nothing stays in flight on the worker."""

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
EMBED, RESPONSES = "/v1/embeddings", "/v1/responses"
SEED = int(os.environ.get("TANDEM_FUZZ_SEED", "20261124"))
NUM_BODIES = int(os.environ.get("TANDEM_FUZZ_BODIES", "200"))
HOSTILE: list[Any] = [
    None, True, 0, -1, 2**31, 2**64, -(2**63) - 1, 1e308, -0.0, 3.5, "", "x" * 5000, "\x00",
    [], [[]], [None], [1, "a"], [[1], "a"], [-5], [[2**40]], {}, {"type": "text"},
    [{"role": "user"}], [{"type": "input_text", "text": "a"}], [{"role": "user", "content": 5}],
]  # fmt: skip
EMBED_FIELDS = ["model", "input", "encoding_format", "dimensions", "user"]
RESPONSES_FIELDS = [
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "store",
    "stream", "previous_response_id", "metadata", "tools", "tool_choice", "text", "reasoning",
    "include", "truncation", "background", "top_logprobs", "parallel_tool_calls", "user",
]  # fmt: skip


def _body(rng: random.Random, path: str) -> bytes:
    if path == EMBED:
        body: dict[str, Any] = {"model": MODEL, "input": rng.choice(["a b", ["a", "b"], [5, 6]])}
        fields = EMBED_FIELDS
    else:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
        fields = RESPONSES_FIELDS
    for _ in range(rng.randint(1, 3)):
        if body and rng.random() < 0.15:
            body.pop(rng.choice(list(body)), None)
        else:
            body[rng.choice(fields)] = rng.choice(HOSTILE)
    if path == RESPONSES and "max_output_tokens" not in body:
        body["max_output_tokens"] = 2  # bounds what a fuzzed body generates
    data = json.dumps(body).encode()
    if rng.random() < 0.1:
        data = data[: rng.randrange(len(data))]
    return data


async def test_random_bodies_never_get_a_5xx_or_hang() -> None:
    rng = random.Random(SEED)
    bodies = [(path, _body(rng, path)) for _ in range(NUM_BODIES) for path in (EMBED, RESPONSES)]
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        worker = await s.add_worker(MockerEngine(MockerConfig(speedup_ratio=0, context_length=256)))
        await s.start_frontend({"model": MODEL, "input": "x"}, ready_path=EMBED)

        def check(path: str, data: bytes, status: int, reply: Any) -> None:
            assert status < 500, (path, data[:300], reply)
            if status in (400, 404):
                error = reply["error"]
                assert error["message"], reply
                if status == 404:
                    assert error["param"] in ("model", "previous_response_id"), reply
                elif error["param"] is None:
                    assert "body" in error["message"], reply
            else:
                assert status == 200, (path, data[:300], status, reply)

        statuses = await s.post_all(bodies, check)
        assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses
        await eventually(lambda: worker.num_inflight == 0, timeout_s=5)
