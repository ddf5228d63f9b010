"""Shared pieces of the comparisons: run one measured cell, pick its headline numbers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tandem.bench.loadgen import LoadConfig, run_load
from tandem.bench.report import format_summary, summarize, write_json
from tandem.bench.workload import RequestSpec


def run_cell(config: LoadConfig, specs: list[RequestSpec]) -> dict[str, Any]:
    """One load run on a fresh event loop (uvloop when present); returns its summary."""
    try:
        import uvloop

        run = uvloop.run(run_load(config, specs))
    except ImportError:
        run = asyncio.run(run_load(config, specs))
    summary = summarize(run)
    print(format_summary(summary), flush=True)
    return summary


def cell_metrics(summary: dict[str, Any], cpu_pid: int | None = None) -> dict[str, Any]:
    """The headline numbers of a summary, flat, for tables and JSON."""
    cpu = (summary.get("server_cpu_ms_per_request") or {}).get(str(cpu_pid))
    return {
        "num_ok": summary["num_ok"],
        "num_errors": summary["num_errors"],
        "errors_by_status": summary["errors_by_status"],
        "req_per_s": summary["req_per_s"],
        "output_tok_per_s": summary["output_tok_per_s"],
        "cpu_ms_per_req": cpu,
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "e2e_p50_ms": summary["e2e_ms"]["p50"],
        "e2e_p99_ms": summary["e2e_ms"]["p99"],
        "itl_p50_ms": summary["itl_ms"]["p50"],
        "cached_fraction": summary["cached_fraction"],
    }


def write_report(path: str | Path, payload: dict[str, Any]) -> None:
    write_json(path, payload)
