"""A model whose tokenizer failed to load is loaded again when another worker registers it
(issue 30: a frontend that first saw a worker whose card named a file this host lacks stayed
503 for that model even after a worker with the files joined)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from tests.support.smollm2 import smollm2_gguf

from tandem.errors import ModelUnavailable
from tandem.frontend.models import ServedModel
from tandem.protocols.discovery import Instance, ModelCard
from tandem.router.config import RouterConfig
from tandem.router.registry import make_router
from tandem.router.source import StaticInstanceSet


def _instance(instance_id: str, card: ModelCard) -> Instance:
    return Instance(
        instance_id=instance_id,
        namespace="t",
        component="backend",
        endpoint="generate",
        address="127.0.0.1:1",
        model=card,
    )


async def test_a_failed_model_loads_again_when_a_worker_registers(tmp_path: Path) -> None:
    missing = ModelCard(
        name="m",
        context_length=64,
        block_size=16,
        num_total_blocks=8,
        tokenizer=f"gguf:{tmp_path / 'gone.gguf'}",
    )
    view = StaticInstanceSet()
    model = ServedModel(missing, make_router("round_robin", RouterConfig(), instances=view), view)
    model.start(None)
    view.add(_instance("w1", missing))
    with pytest.raises(ModelUnavailable, match="model 'm' failed to load"):
        await model.ready()
    view.add(_instance("w2", missing))  # still no file: fails again, says so again
    with pytest.raises(ModelUnavailable, match="failed to load"):
        await model.ready()
    view.add(_instance("w3", msgspec.structs.replace(missing, tokenizer=f"gguf:{smollm2_gguf()}")))
    await model.ready()
    assert model.is_loaded and model.tokenizer is not None and model.chat_template is not None
    view.add(_instance("w4", missing))  # a loaded model is not loaded again
    assert model.is_loaded
    await model.close()
