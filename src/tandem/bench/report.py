"""Summaries of a load run: percentiles, rates, cached-token fraction, server CPU per request.

`summarize` is pure (results in, numbers out); `format_summary` renders it for a terminal;
`write_json` stores the summary and, optionally, every request's measurements.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec

from tandem.bench.client import RequestResult
from tandem.bench.loadgen import LoadRun

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} must be in [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in PERCENTILES:
        value = percentile(values_s, q)
        out[f"p{q}"] = None if value is None else value * 1000.0
    out["mean"] = sum(values_s) / len(values_s) * 1000.0 if values_s else None
    return out


def summarize(run: LoadRun) -> dict[str, Any]:
    """Aggregate numbers of a run; latency distributions come from successful requests only."""
    ok = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    wall_s = run.wall_s or float("nan")
    summary: dict[str, Any] = {
        "model": run.model,
        "num_requests": len(run.results),
        "num_ok": len(ok),
        "num_errors": len(failed),
        "errors_by_status": {str(k): v for k, v in Counter(r.status for r in failed).items()},
        "error_samples": sorted({r.error or "" for r in failed})[:5],
        "wall_s": run.wall_s,
        "req_per_s": len(ok) / wall_s,
        "output_tok_per_s": output_tokens / wall_s,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": cached_tokens,
        "cached_fraction": cached_tokens / prompt_tokens if prompt_tokens else None,
    }
    summary["client_cpu_ms_per_request"] = (
        run.client_cpu_s * 1000.0 / len(run.results) if run.results else None
    )
    if run.server_cpu_s:
        per_request = {
            str(pid): (cpu_s * 1000.0 / len(ok) if ok else None)
            for pid, cpu_s in run.server_cpu_s.items()
        }
        summary["server_cpu_s"] = {str(pid): s for pid, s in run.server_cpu_s.items()}
        summary["server_cpu_ms_per_request"] = per_request
        total = sum(run.server_cpu_s.values())
        summary["server_cpu_ms_per_request_total"] = total * 1000.0 / len(ok) if ok else None
    return summary


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"model {summary['model']}: {summary['num_ok']}/{summary['num_requests']} ok in "
        f"{summary['wall_s']:.2f} s — {summary['req_per_s']:.1f} req/s, "
        f"{summary['output_tok_per_s']:.1f} output tok/s",
        f"{'metric':<8}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}  (ms)",
    ]
    for name in ("ttft", "itl", "e2e"):
        dist = summary[f"{name}_ms"]
        lines.append(
            f"{name:<8}" + "".join(f"{_fmt(dist[k]):>10}" for k in ("p50", "p90", "p99", "mean"))
        )
    fraction = summary["cached_fraction"]
    lines.append(
        f"cached tokens {summary['cached_tokens']}/{summary['prompt_tokens']} "
        f"({_fmt(None if fraction is None else fraction * 100, 1)} %)"
    )
    if summary["num_errors"]:
        lines.append(f"errors by status: {summary['errors_by_status']}")
        lines.extend(f"  e.g. {sample}" for sample in summary["error_samples"])
    client_ms = summary.get("client_cpu_ms_per_request")
    lines.append(f"client (this process): {_fmt(client_ms, 3)} CPU-ms per request")
    for pid, ms in (summary.get("server_cpu_ms_per_request") or {}).items():
        lines.append(f"server pid {pid}: {_fmt(ms, 3)} CPU-ms per request")
    return "\n".join(lines)


def result_record(result: RequestResult) -> dict[str, Any]:
    return asdict(result)


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(payload), indent=2))
