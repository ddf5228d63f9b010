"""`tandem bench frontend`: tandem's frontend vs Dynamo's, same load, one run.

Both over near-instant mockers (tandem: `--speedup-ratio 0`; Dynamo 1.6.1: 10000, as 0 is not
infinite there). For each system × concurrency × connection mode (fresh / reused) it sends
`--num-requests` streamed requests (bounded by `--duration-s` per cell) after a warm-up, and
records req/s, the frontend process's CPU-ms per request, TTFT and e2e p50/p99. Prints one
side-by-side table with tandem/Dynamo ratios and writes everything to `--json`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tandem.bench.anchor import DEFAULT_ANCHOR_DIR, DEFAULT_INSTALL_DIR, AnchorConfig
from tandem.bench.compare import cell_metrics, run_cell, write_report
from tandem.bench.loadgen import LoadConfig
from tandem.bench.stacks import LAYOUTS, RunningStack, dynamo_mocker_stack, tandem_mocker_stack
from tandem.bench.workload import SyntheticConfig, synthetic_requests

logger = logging.getLogger(__name__)

SYSTEMS = ("tandem", "dynamo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--systems", default="tandem,dynamo", help="comma list of: tandem,dynamo")
    parser.add_argument("--concurrency", default="1,8,64", help="comma list")
    parser.add_argument("--connections", default="fresh,reused", help="fresh,reused")
    parser.add_argument("--num-requests", type=int, default=1000, help="per cell")
    parser.add_argument("--duration-s", type=float, default=15.0, help="cap per cell")
    parser.add_argument("--warmup-requests", type=int, default=50)
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--isl", type=int, default=64)
    parser.add_argument("--osl", type=int, default=32)
    parser.add_argument("--tandem-layout", choices=LAYOUTS, default="auto")
    parser.add_argument("--tandem-args", default="", help="extra flags for the tandem frontend")
    parser.add_argument("--dynamo-speedup", type=float, default=10000.0)
    parser.add_argument("--anchor-dir", default=DEFAULT_ANCHOR_DIR)
    parser.add_argument("--anchor-install-dir", default=DEFAULT_INSTALL_DIR)
    parser.add_argument("--work-dir", default=None, help="logs and discovery (default: tmp)")
    parser.add_argument("--json", default="bench_frontend.json")


def _csv(text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    for item in items:
        if allowed is not None and item not in allowed:
            raise SystemExit(f"unknown value '{item}'; expected one of: {', '.join(allowed)}")
    return items


@contextlib.contextmanager
def _stack(system: str, args: argparse.Namespace, work_dir: Path) -> Iterator[RunningStack]:
    if system == "tandem":
        with tandem_mocker_stack(
            work_dir / "tandem", layout=args.tandem_layout, extra_args=args.tandem_args
        ) as stack:
            yield stack
    else:
        config = AnchorConfig(
            anchor_dir=args.anchor_dir,
            install_dir=args.anchor_install_dir,
            speedup=args.dynamo_speedup,
        )
        with dynamo_mocker_stack(work_dir, config) as stack:
            yield stack


def measure_system(system: str, args: argparse.Namespace, work_dir: Path) -> list[dict[str, Any]]:
    cells = []
    workload = synthetic_requests(SyntheticConfig(isl=args.isl, osl=args.osl), 1000)
    with _stack(system, args, work_dir) as stack:
        logger.info("%s up at %s (frontend pid=%s)", system, stack.url, stack.frontend_pid)
        warmup = LoadConfig(
            url=stack.url,
            model=stack.model,
            endpoint=args.endpoint,
            concurrency=8,
            num_requests=args.warmup_requests,
        )
        run_cell(warmup, workload)
        for concurrency in (int(c) for c in _csv(args.concurrency)):
            for connections in _csv(args.connections, ("fresh", "reused")):
                config = LoadConfig(
                    url=stack.url,
                    model=stack.model,
                    endpoint=args.endpoint,
                    concurrency=concurrency,
                    num_requests=args.num_requests,
                    duration_s=args.duration_s,
                    fresh_connections=connections == "fresh",
                    timeout_s=60.0,
                    server_pids=(stack.frontend_pid,),
                )
                summary = run_cell(config, workload)
                cell = {
                    "system": system,
                    "concurrency": concurrency,
                    "connections": connections,
                    "cpu_scope": stack.cpu_scope,
                    **cell_metrics(summary, stack.frontend_pid),
                }
                logger.info("%s", cell)
                cells.append(cell)
    return cells


def format_table(cells: list[dict[str, Any]]) -> str:
    by_key = {(c["system"], c["concurrency"], c["connections"]): c for c in cells}
    keys = sorted({(c["concurrency"], c["connections"]) for c in cells})
    cols = ("req_per_s", "cpu_ms_per_req", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")
    head = f"{'conc':>4} {'conn':<6}" + "".join(f" {c:>27}" for c in cols)
    lines = [head, f"{'':11}" + f" {'tandem / dynamo (ratio)':>27}" * len(cols)]
    for conc, conn in keys:
        t = by_key.get(("tandem", conc, conn), {})
        d = by_key.get(("dynamo", conc, conn), {})
        row = f"{conc:>4} {conn:<6}"
        for col in cols:
            tv, dv = t.get(col), d.get(col)
            ratio = f"{tv / dv:.2f}x" if tv is not None and dv else "-"
            row += f" {_num(tv):>9} / {_num(dv):>9} ({ratio:>5})"
        lines.append(row)
    scopes = {c["system"]: c["cpu_scope"] for c in cells}
    lines.append(f"CPU measured on: {scopes}")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench frontend", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    systems = _csv(args.systems, SYSTEMS)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="tandem-bench-frontend-"))
    cells: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for system in systems:
        try:
            cells.extend(measure_system(system, args, work_dir))
        except Exception as exc:  # one system failing must not lose the other's numbers
            logger.exception("%s failed: %s", system, exc)
            failures[system] = str(exc)
    print(format_table(cells))
    write_report(args.json, {"args": vars(args), "cells": cells, "failures": failures})
    print(f"wrote {args.json}; logs under {work_dir}")
    return 1 if failures or not cells else 0
