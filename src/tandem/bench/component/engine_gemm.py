"""`tandem bench engine --gemm-only`: each projection of the model alone, as the engine runs
it, in GMAC/s: fp32 (`linear.Linear`: MKL's mat-vec for one row, oneDNN's packed GEMM for
more) and each quantized format (`quant.matmul`, the C kernels of this machine's build), at
each of --gemm-rows rows, on random weights of the model's shapes. Beside them the
instruction-issue ceilings of one core (`quant.issue_gmacs`: fp32 FMA and the integer steps
the AVX2 build has), so a GEMM's rate reads against what bounds it. Each figure twice, best
of --repeats after a warm-up call, on --num-threads threads: by wall time, and per core by
process CPU time (on a shared machine the second is the kernel's own speed: the first drops
whenever a neighbour takes the core)."""

from __future__ import annotations

import time
from typing import Any

import torch

from tandem.engines.native import quant
from tandem.engines.native.linear import Linear, can_pack
from tandem.engines.native.model_config import ModelConfig


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection's (N outputs, K inputs): qkv, o, gate_up, down and the head."""
    hidden, d = config.hidden_size, config.head_dim
    return {
        "qkv": ((config.num_heads + 2 * config.num_kv_heads) * d, hidden),
        "o": (hidden, config.num_heads * d),
        "gate_up": (2 * config.intermediate_size, hidden),
        "down": (hidden, config.intermediate_size),
        "head": (config.vocab_size, hidden),
    }


def _best_s(fn: Any, repeats: int) -> tuple[float, float]:
    """(best wall seconds, best process CPU seconds) of a call."""
    fn()  # warm-up: packing caches, the thread team
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        cpu = min(cpu, time.process_time() - start_cpu)
        wall = min(wall, time.perf_counter() - start)
    return wall, cpu


def gemm_figures(
    shapes: dict[str, tuple[int, int]],
    formats: list[str],
    rows: list[int],
    threads: int,
    repeats: int,
) -> dict[str, Any]:
    """{"gemm_gmacs": {format: {projection: {rows: GMAC/s}}}, "gemm_core_gmacs": the same per
    core by CPU time, "gemm_shapes", "issue_gmacs": {instruction pair: GMAC/s}}."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, dict[str, float]]] = {fmt: {} for fmt in formats}
    core: dict[str, dict[str, dict[str, float]]] = {fmt: {} for fmt in formats}
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, generator=gen) * k**-0.5
        runs: dict[str, Any] = {}
        for fmt in formats:
            if fmt == "fp32":
                runs[fmt] = Linear(weight, pack=can_pack(torch.float32))
            else:
                packed = quant.pack(quant.convert(weight, fmt))
                runs[fmt] = lambda x, w=packed: quant.matmul(w, x)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            for fmt, run in runs.items():
                wall, cpu = _best_s(lambda run=run, x=x: run(x), repeats)
                out[fmt].setdefault(name, {})[str(m)] = m * n * k / wall * 1e-9
                core[fmt].setdefault(name, {})[str(m)] = m * n * k / max(cpu, 1e-9) * 1e-9
    return {
        "gemm_gmacs": out,
        "gemm_core_gmacs": core,
        "gemm_shapes": shapes,
        "issue_gmacs": quant.issue_gmacs(),
    }


def format_gemm(r: dict[str, Any]) -> list[str]:
    if "gemm_gmacs" not in r:
        return []
    rows = list(next(iter(next(iter(r["gemm_gmacs"].values())).values())))
    lines = [
        f"GEMM alone on {r['threads']} thread(s), GMAC/s by wall time | per core by CPU time, "
        "rows " + " / ".join(rows) + ":",
    ]
    for fmt, per in r["gemm_gmacs"].items():
        for name, by_rows in per.items():
            n, k = r["gemm_shapes"][name]
            per_core = r["gemm_core_gmacs"][fmt][name]
            lines.append(
                f"  {fmt:5} {name:8} {n:>6}x{k:<5}"
                + "".join(f"{by_rows[m]:>8.1f}" for m in rows)
                + "  |"
                + "".join(f"{per_core[m]:>8.1f}" for m in rows)
            )
    if r.get("issue_gmacs"):
        lines.append(
            "one core's issue ceiling, GMAC/s: "
            + "  ".join(f"{name} {rate:.1f}" for name, rate in r["issue_gmacs"].items())
        )
    return lines
