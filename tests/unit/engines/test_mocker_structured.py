"""The mocker cannot enforce a structured output: it refuses it (a 400 at the frontend) rather
than answering with pseudo-tokens that ignore the schema."""

from __future__ import annotations

import pytest

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.errors import InvalidRequest
from tandem.protocols.engine import (
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
    StructuredOutput,
)

pytestmark = pytest.mark.timeout(10)


async def test_structured_request_is_refused_and_plain_one_served() -> None:
    engine = MockerEngine(
        MockerConfig(speedup_ratio=0.0, num_blocks=64, block_size=4, tokenizer=None)
    )
    await engine.start()
    try:
        plain = PreprocessedRequest(
            request_id="p", model="m", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=3)
        )
        assert [o async for o in engine.generate(plain)][-1].finish_reason == "length"
        constrained = PreprocessedRequest(
            request_id="s",
            model="m",
            token_ids=[1, 2, 3],
            sampling=SamplingParams(structured=StructuredOutput(kind="json")),
            stop=StopConditions(max_tokens=3),
        )
        with pytest.raises(InvalidRequest, match="cannot enforce"):
            async for _ in engine.generate(constrained):
                pass
    finally:
        await engine.stop()
