"""Compile one C file into a shared library in the cache dir (`$TANDEM_CACHE_DIR/kernels`,
keyed by source, the headers beside it, compiler and flags; idempotent): the native engine's
kernels, the mocker's block pool, the tokens' hashing and ASCII split, the frontend's prompt
scan (their C sources stay beside them). And choose the instruction-set build of the native
kernels (`select_isa`): the widest of AVX-512 VNNI, AVX-512, AVX2 + FMA and scalar that the
CPU executes, or the one TANDEM_NATIVE_ISA forces."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

logger = logging.getLogger(__name__)


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


# ------------------------------------------------------------------ instruction-set builds
ISA_ENV = "TANDEM_NATIVE_ISA"
# every build the native kernels have, widest first: its compiler flags and the CPU flags
# (/proc/cpuinfo names) it executes on. The flags name the instructions, never -march=native,
# so a library's cache key says what it runs on (a cache dir shared between machines is safe)
ISAS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512vnni": (
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mavx512vnni"),
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                   "avx512_vnni"}),
    ),
    "avx512": (
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    ),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})),
    "scalar": ((), frozenset()),
}  # fmt: skip
_logged: set[tuple[str, str]] = set()
_log_lock = threading.Lock()


class IsaError(ValueError):
    """TANDEM_NATIVE_ISA (or a build asked for) names a build this CPU cannot execute, or
    no build at all; the message says what this CPU runs."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (those the kernel lets programs use:
    AVX-512 is absent where the OS does not save its registers); empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def runnable_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The builds this CPU executes, widest first (scalar always)."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa, (_, needs) in ISAS.items() if needs <= flags]


def check_isa(isa: str, flags: frozenset[str] | None = None) -> None:
    """Raises IsaError unless `isa` is a build this CPU executes (loading one it cannot
    would die of SIGILL at the first kernel call)."""
    if isa not in ISAS:
        raise IsaError(f"native kernel build '{isa}'; expected one of: {', '.join(ISAS)}")
    flags = cpu_flags() if flags is None else flags
    missing = sorted(ISAS[isa][1] - flags)
    if missing:
        raise IsaError(
            f"native kernel build '{isa}' needs CPU flags {', '.join(missing)}, which this CPU "
            f"lacks; it runs: {', '.join(runnable_isas(flags))}"
        )


def select_isa(flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(the build the native kernels use, why): TANDEM_NATIVE_ISA where set (one of ISAS,
    or 'auto'; a build this CPU cannot execute is an IsaError), else the widest build the
    CPU's flags allow. Logged at INFO the first time each choice is made."""
    flags = cpu_flags() if flags is None else flags
    forced = os.environ.get(ISA_ENV, "auto").strip() or "auto"
    if forced != "auto":
        if forced not in ISAS:
            raise IsaError(f"{ISA_ENV}='{forced}'; expected one of: auto, {', '.join(ISAS)}")
        check_isa(forced, flags)
        isa, why = forced, f"forced by {ISA_ENV}={forced}"
    else:
        isa = runnable_isas(flags)[0]
        seen = sorted(f for f in set().union(*(needs for _, needs in ISAS.values())) if f in flags)
        why = f"the widest this CPU runs (flags: {' '.join(seen) or 'none of ' + ', '.join(ISAS)})"
        if not flags:
            why = "CPU flags unknown (no /proc/cpuinfo): the scalar build is safe anywhere"
    with _log_lock:
        if (isa, why) not in _logged:
            _logged.add((isa, why))
            logger.info("native kernels: the %s build, %s", isa, why)
    return isa, why
