"""Every engine declares its `EngineCapabilities`, and what it declares is what it implements:
an engine that says it embeds has its own `embed`, one that takes images its own
`attach_embedding_provider`; one that takes a direct sink hands it outputs, one that reads the
prompt's bytes runs a request whose token_ids never became a list."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tandem.disagg.config import DisaggWorkerConfig
from tandem.disagg.worker_engine import DisaggEngine
from tandem.engines.base import Engine, EngineCapabilities, EngineDefaults, ImageInput
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.engines.vllm.config import VllmWorkerConfig
from tandem.engines.vllm.engine import VllmEngine
from tandem.errors import InvalidRequest
from tandem.multimodal.encode_engine import EncoderEngine, EncodeWorkerConfig
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
    decode_request,
    encode,
)


def _engines() -> dict[str, Engine]:
    mocker = MockerEngine(MockerConfig(tokenizer=None, speedup_ratio=0))
    return {
        "mocker": mocker,
        "native": NativeEngine(NativeConfig()),
        "native-no-encoder": NativeEngine(NativeConfig(mm_encoder=None)),
        "vllm": VllmEngine(VllmWorkerConfig()),
        "encoder": EncoderEngine(EncodeWorkerConfig()),
        "disagg-mocker": DisaggEngine(mocker, DisaggWorkerConfig(mode="decode")),
        "fetch-mocker": DisaggEngine(mocker, DisaggWorkerConfig(kv_fetch=True)),
    }


def _overrides(engine: Engine, name: str) -> bool:
    return getattr(type(engine), name) is not getattr(EngineDefaults, name)


@pytest.mark.parametrize("name", sorted(_engines()))
def test_declared_capabilities_are_implemented(name: str) -> None:
    engine = _engines()[name]
    caps = engine.capabilities
    assert isinstance(caps, EngineCapabilities)
    assert caps.embeds == _overrides(engine, "embed")
    assert (caps.images is not None) == _overrides(engine, "attach_embedding_provider")


def test_each_engine_declares_what_it_does() -> None:
    caps = {name: engine.capabilities for name, engine in _engines().items()}
    assert caps["mocker"] == EngineCapabilities(
        reads_token_bytes=True,
        accepts_direct_sink=True,
        embeds=True,
        images=ImageInput(embeddings_as_arrays=True),
        lora=True,
    )
    assert caps["native"] == EngineCapabilities(
        embeds=True, images=ImageInput(local_encoder="bridge"), lora=True
    )
    assert caps["native-no-encoder"].images == ImageInput()
    assert caps["vllm"] == caps["encoder"] == EngineCapabilities()
    # the disaggregated sides read token_ids and consume every output themselves
    assert caps["disagg-mocker"] == EngineCapabilities(
        embeds=True, images=ImageInput(embeddings_as_arrays=True), lora=True
    )
    # peer fetch alone: the engine's direct sink, on the paths whose outputs it leaves alone
    assert caps["fetch-mocker"] == dataclasses.replace(
        caps["disagg-mocker"], accepts_direct_sink=True
    )


async def test_an_engine_without_the_optional_parts_answers_none() -> None:
    engine = EncoderEngine(EncodeWorkerConfig())
    assert engine.take_step_samples() == [] and engine.metric_families() == []
    with pytest.raises(InvalidRequest, match="does not compute embeddings"):
        await engine.embed([[1, 2]])
    with pytest.raises(ValueError, match="takes no images"):
        engine.attach_embedding_provider(object())  # type: ignore[arg-type]


def _request(request_id: str) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=request_id,
        model="mocker",
        token_ids=list(range(1, 40)),
        stop=StopConditions(max_tokens=6, ignore_eos=True),
    )


async def test_the_mocker_hands_a_direct_sink_its_outputs() -> None:
    engine = MockerEngine(MockerConfig(tokenizer=None, speedup_ratio=0))
    assert engine.capabilities.accepts_direct_sink
    await engine.start()
    taken: list[EngineOutput] = []

    def sink(out: EngineOutput) -> bool:
        if out.finish_reason is not None:
            return False
        taken.append(out)
        return True

    try:
        yielded = [out async for out in engine.generate(_request("d"), direct=sink)]
        await asyncio.sleep(0)
    finally:
        await engine.stop()
    assert taken, "a direct-sink engine offered the sink nothing"
    assert sum(len(o.token_ids) for o in [*taken, *yielded]) == 6
    assert yielded[-1].finish_reason == "length"


async def test_the_mocker_reads_a_prompt_left_as_bytes() -> None:
    engine = MockerEngine(MockerConfig(tokenizer=None, speedup_ratio=0))
    assert engine.capabilities.reads_token_bytes
    request = decode_request(encode(_request("b")), materialize=False)
    assert not request.token_ids  # still the wire's buffer
    await engine.start()
    try:
        outs = [out async for out in engine.generate(request)]
    finally:
        await engine.stop()
    assert outs[-1].finish_reason == "length"
