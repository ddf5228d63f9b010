"""Constrained decoding in the native engine: a random-weight llama over SmolLM2's vocabulary
(it never writes JSON by itself) must produce output that parses and validates, greedy and
sampled, batched with unconstrained rows, across a continuation (disaggregated decode,
migration) and with n > 1."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import torch
from native_tiny import TINY
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.loader import random_weights
from tandem.engines.native.model import LlamaModel
from tandem.engines.native.structured import GrammarMasks
from tandem.errors import InvalidRequest
from tandem.protocols.engine import (
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
    StructuredOutput,
)
from tandem.tokens.grammar import closed_objects
from tandem.tokens.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(60)

# native_tiny's shape, smaller, over SmolLM2's real vocabulary (the grammar needs its tokens)
VOCAB = dataclasses.replace(
    TINY, name="tiny-smollm2-vocab", num_layers=1, hidden_size=32, intermediate_size=64,
    num_heads=2, num_kv_heads=1, vocab_size=49152,
)  # fmt: skip
WEIGHTS = random_weights(VOCAB, seed=0)
SPEC = f"gguf:{smollm2_gguf()}"

SCHEMA = {
    "type": "object",
    "properties": {
        "role": {"enum": ["admin", "user", "guest"]},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
        "where": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "required": ["zip"],
        },
    },
    "required": ["role", "age", "ok", "tags", "where"],
}


def core() -> EngineCore:
    config = NativeConfig(num_blocks=128, block_size=4, max_num_batched_tokens=256)
    c = EngineCore(config, LlamaModel(VOCAB, WEIGHTS))
    c.grammars.tokenizer_spec = SPEC
    return c


def request(
    rid: str, structured: StructuredOutput | None, *, temperature: float = 0.0, seed: int = 0
) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="tiny",
        token_ids=[1, 510, 2200, 30],
        sampling=SamplingParams(temperature=temperature, seed=seed, structured=structured),
        stop=StopConditions(max_tokens=120),
    )


def run(c: EngineCore) -> dict[str, tuple[list[int], str]]:
    out: dict[str, tuple[list[int], str]] = {}
    while c.has_work():
        for rid, o in c.step():
            tokens, _ = out.get(rid, ([], ""))
            out[rid] = (tokens + o.token_ids, o.finish_reason or "")
    return out


def text(tokens: list[int]) -> str:
    return load_tokenizer(SPEC).decode(tokens)


def schema_output() -> StructuredOutput:
    return StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schema_output_validates_greedy_and_sampled(temperature: float) -> None:
    c = core()
    for i in range(3):
        c.add(request(f"r{i}", schema_output(), temperature=temperature, seed=i))
    c.add(request("free", None, temperature=temperature))  # batched with an unconstrained row
    out = run(c)
    for i in range(3):
        tokens, reason = out[f"r{i}"]
        assert reason == "stop", text(tokens)
        doc = json.loads(text(tokens))
        jsonschema.validate(doc, closed_objects(SCHEMA))
    with pytest.raises(ValueError):
        json.loads(text(out["free"][0]))  # the random model alone writes no JSON


def test_json_object_and_regex_and_grammar() -> None:
    c = core()
    c.add(request("re", StructuredOutput(kind="regex", spec=r"(yes|no)-[0-9]{2}")))
    c.add(request("lark", StructuredOutput(kind="grammar", spec='start: "on" | "off"')))
    c.add(request("obj", StructuredOutput(kind="json"), temperature=0.7, seed=3))
    out = run(c)
    assert out["re"][1] == "stop"
    assert text(out["re"][0])[:3] in ("yes", "no-")
    assert text(out["lark"][0]) in ("on", "off")
    tokens, reason = out["obj"]
    if reason == "stop":  # a random model may still be inside a string at max_tokens
        assert isinstance(json.loads(text(tokens)), dict)
    else:
        assert text(tokens).startswith("{")


def test_continuation_replays_generated_tokens() -> None:
    """A decode worker gets prompt + the prefill's first tokens: its matcher starts after
    them, and prompt + tokens of both legs validate (as one uninterrupted request would)."""
    c = core()
    c.add(request("whole", schema_output()))
    whole = run(c)["whole"][0]
    first = whole[:3]
    leg = request("leg", schema_output())
    leg.token_ids = leg.token_ids + first
    leg.num_generated_tokens = len(first)
    c.add(leg)
    rest = run(c)["leg"][0]
    assert first + rest == whole
    # without the replay the matcher would start at the top of the schema again: rejected
    bad = request("bad", StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA)))
    bad.token_ids = bad.token_ids + whole[:3]
    bad.num_generated_tokens = 2  # claims the wrong tokens
    with pytest.raises(InvalidRequest, match="do not match"):
        c.add(bad)


def test_bad_specs_are_invalid_requests() -> None:
    c = core()
    for structured in (
        StructuredOutput(kind="json_schema", spec="{not json"),
        StructuredOutput(kind="json_schema", spec=json.dumps({"type": "objectx"})),
        StructuredOutput(kind="regex", spec="(unclosed"),
        StructuredOutput(kind="grammar", spec="start: undefined_rule"),
    ):
        with pytest.raises(InvalidRequest):
            c.add(request("x", structured))
    assert not c.has_work()


def test_mask_is_one_pass_and_unconstrained_rows_untouched() -> None:
    c = core()
    seq = c.add(request("m", StructuredOutput(kind="regex", spec="[0-9]")))
    masks = GrammarMasks(VOCAB.vocab_size)
    logits = torch.zeros(2, VOCAB.vocab_size)
    masks.apply(logits, [None, seq.grammar])
    assert torch.isfinite(logits[0]).all()
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert sorted(text([t]) for t in allowed) == [str(d) for d in range(10)]
    untouched = torch.ones(3, VOCAB.vocab_size)
    masks.apply(untouched, [None, None, None])
    assert untouched.eq(1).all()


async def test_native_engine_compiles_off_thread_and_streams_valid_json() -> None:
    c = core()
    engine = NativeEngine(c.config, core=c)
    await engine.start()
    try:
        tokens: list[int] = []
        async for out in engine.generate(request("a", schema_output(), temperature=1.0)):
            tokens += out.token_ids
        jsonschema.validate(json.loads(text(tokens)), SCHEMA)
        bad = request("b", StructuredOutput(kind="regex", spec="(("))
        with pytest.raises(InvalidRequest):
            async for _ in engine.generate(bad):
                pass
    finally:
        await engine.stop()


def test_every_continuation_path_carries_the_generated_count() -> None:
    """Disaggregated decode legs (both flows) and migration append tokens generated elsewhere
    to token_ids; each must tell the constraint how many, or the matcher starts over."""
    from tandem.disagg.orchestrator import _decode_leg
    from tandem.frontend.migration import _continuation

    req = request("c", schema_output())
    legs = [
        req.continued_after([7, 8]),
        _decode_leg(req, [7, 8], {"mode": "pull"}),
        _continuation(req, [7, 8], 1),
    ]
    for leg in legs:
        assert leg.sampling.structured is not None
        assert leg.num_generated_tokens == 2
        assert leg.token_ids[-2:] == [7, 8]
    again = _continuation(legs[2], [9], 2)
    assert again.sampling.structured is not None
    assert again.num_generated_tokens == 3
