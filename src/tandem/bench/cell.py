"""One measured cell of a benchmark table: a load run on a fresh event loop, its headline
numbers, and the loop that measures every system (or mode) of a table even when one fails."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from tandem.bench.loadgen import LoadConfig, run_load_blocking
from tandem.bench.report import format_summary, summarize
from tandem.bench.workload import RequestSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")


def run_cell(config: LoadConfig, specs: list[RequestSpec]) -> dict[str, Any]:
    """One load run on a fresh event loop (uvloop when present); prints and returns its
    summary."""
    summary = summarize(run_load_blocking(config, specs))
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


def measure_each(names: list[str], measure: Callable[[str], T]) -> tuple[list[T], dict[str, str]]:
    """`measure(name)` for each name in order; one that raises is logged and named in the
    failures (name -> message) so the others' numbers are kept."""
    results: list[T] = []
    failures: dict[str, str] = {}
    for name in names:
        try:
            results.append(measure(name))
        except Exception as exc:  # one system failing must not lose the other's numbers
            logger.exception("%s failed: %s", name, exc)
            failures[name] = str(exc)
    return results, failures


def format_number(value: float | None, spec: str = ".2f") -> str:
    """`value` in a table cell: formatted by `spec`, or "-" when there is none."""
    return "-" if value is None else format(value, spec)
