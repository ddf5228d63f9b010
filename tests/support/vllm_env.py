"""The vLLM virtualenv for e2e tests: `.venv-vllm` (built by `make venv-vllm`, which
`make test-vllm` runs first), the SmolLM2 HF folder `tandem convert` writes, and the engine flags
every vLLM process in the tests shares (small, fp32, eager: the engine starts fastest)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("TANDEM_VLLM_VENV", REPO / ".venv-vllm"))
PYTHON = VENV / "bin" / "python"
BLOCK_SIZE = 32
ENGINE_FLAGS = [
    "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024",
    "--max-num-seqs", "8", "--enforce-eager",
]  # fmt: skip
# each vLLM process: a 1 GiB KV space and no reserved core (2-core CI machines)
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "TANDEM_VLLM_VENV": str(VENV),
}


def require_vllm_venv() -> Path:
    """The venv's python; skips (naming the fix) when it was not built."""
    if not (VENV / ".installed").exists():
        pytest.skip(f"{VENV} not built; run `make test-vllm` (builds it)")
    return PYTHON


def convert_smollm2(out: Path) -> Path:
    subprocess.run(
        [str(PYTHON), "-m", "tandem.cli", "convert", "--out", str(out)],
        check=True,
        timeout=300,
        cwd=REPO,
        capture_output=True,
    )
    return out
