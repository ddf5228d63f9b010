"""Compile one of the native engine's C files into a shared library in the cache dir
(`$TANDEM_CACHE_DIR/kernels`, keyed by source, the headers beside it, compiler and flags;
idempotent)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path


class CBuildError(RuntimeError):
    """No compiler, or the compile failed; the message has the command and its output."""


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def library_path(source: Path, prefix: str, cc: str, flags: tuple[str, ...]) -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR", str(Path.home() / ".cache" / "tandem"))
    # the headers beside the source are part of it (kernels/vmath.h)
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join((cc, *flags)).encode())
    return Path(root) / "kernels" / f"{prefix}-{key.hexdigest()[:16]}.so"


def compile_c(source: Path, prefix: str, flags: tuple[str, ...]) -> Path:
    cc = compiler()
    if cc is None:
        raise CBuildError("no C compiler found (gcc/cc)")
    path = library_path(source, prefix, cc, flags)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    cmd = [cc, *flags, "-o", str(tmp), str(source), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CBuildError(f"{' '.join(cmd)} could not run: {exc}") from exc
    if done.returncode != 0:
        raise CBuildError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, path)
    return path
