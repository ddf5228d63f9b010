"""`tandem bench frontend`: tandem's frontend vs Dynamo's, same load, one run.

Both over near-instant mockers (tandem: `--speedup-ratio 0`; Dynamo 1.6.1: 10000, as 0 is not
infinite there). For each system × endpoint × ISL × concurrency × connection mode (fresh /
reused) it sends `--num-requests` streamed requests (bounded by `--duration-s` per cell) after a
warm-up, and records req/s, the frontend processes' CPU-ms per request (and, beside it, the
mocker workers' and this client's, which share the host's cores with it), TTFT and e2e p50/p99 and
the KV hit rate (cached prompt tokens / prompt tokens, from usage). Each cell sends prompts no
earlier cell sent (the same ones on both sides), so no cell measures a cache of prompts seen
before (Dynamo's frontend CPU per request falls ~6x on prompts it has seen; `--reuse-prompts`
replays one set per endpoint × ISL as before). Prompts longer than
SmolLM2's 8192-token context run both sides on a 131072-token context (same tokenizer). With
`--prefix-groups G` prompts share G long prefixes (7/8 of the ISL), so the hit rate shows the
KV routing quality (use `--router kv --workers 2` or more). Prints one side-by-side table with
tandem/Dynamo ratios and writes everything to `--json`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tandem.bench.cell import cell_metrics, format_number, measure_each, run_cell
from tandem.bench.compare.dynamo_anchor import (
    DEFAULT_ANCHOR_DIR,
    DEFAULT_INSTALL_DIR,
    AnchorConfig,
    dynamo_mocker_stack,
)
from tandem.bench.cpu import CpuMeter
from tandem.bench.loadgen import LoadConfig
from tandem.bench.report import write_json
from tandem.bench.tandem_stack import LAYOUTS, RunningStack, tandem_mocker_stack
from tandem.bench.workload import RequestSpec, SyntheticConfig, synthetic_requests

logger = logging.getLogger(__name__)

SYSTEMS = ("tandem", "dynamo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--systems", default="tandem,dynamo", help="comma list of: tandem,dynamo")
    parser.add_argument("--concurrency", default="1,8,64", help="comma list")
    parser.add_argument("--connections", default="fresh,reused", help="fresh,reused")
    parser.add_argument("--num-requests", type=int, default=1000, help="per cell")
    parser.add_argument("--duration-s", type=float, default=15.0, help="cap per cell")
    parser.add_argument("--warmup-requests", type=int, default=50)
    parser.add_argument("--endpoint", default="chat", help="comma list of: chat,completions")
    parser.add_argument("--isl", default="64", help="comma list of input lengths (tokens)")
    parser.add_argument("--workers", type=int, default=1, help="mocker workers on each side")
    parser.add_argument("--router", choices=("round_robin", "kv"), default="round_robin")
    parser.add_argument("--prefix-groups", type=int, default=0, help="shared-prefix groups")
    parser.add_argument("--osl", type=int, default=32)
    parser.add_argument(
        "--reuse-prompts",
        action="store_true",
        help="every cell of an endpoint × ISL replays the same prompts (default: fresh prompts "
        "per cell, so no cell measures a cache of prompts an earlier cell sent)",
    )
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


LONG_CONTEXT = 131072
SHORT_CONTEXT = 8192


@contextlib.contextmanager
def _stack(system: str, args: argparse.Namespace, work_dir: Path) -> Iterator[RunningStack]:
    is_long = max(int(i) for i in _csv(args.isl)) + args.osl + 64 > SHORT_CONTEXT
    if system == "tandem":
        with tandem_mocker_stack(
            work_dir / "tandem",
            layout=args.tandem_layout,
            extra_args=args.tandem_args,
            num_workers=args.workers,
            router=args.router,
            engine_args=f"--context-length {LONG_CONTEXT}" if is_long else "",
        ) as stack:
            yield stack
    else:
        config = AnchorConfig(
            anchor_dir=args.anchor_dir,
            install_dir=args.anchor_install_dir,
            speedup=args.dynamo_speedup,
            num_workers=args.workers,
            router_mode="kv" if args.router == "kv" else "round-robin",
            model_name="smol-long" if is_long else "SmolLM2-135M-Instruct",
        )
        with dynamo_mocker_stack(work_dir, config) as stack:
            yield stack


def _workload(args: argparse.Namespace, isl: int, count: int, seed: int) -> list[RequestSpec]:
    if not args.prefix_groups:
        return synthetic_requests(SyntheticConfig(isl=isl, osl=args.osl, seed=seed), count)
    prefix = isl * 7 // 8
    config = SyntheticConfig(
        seed=seed,
        isl=isl,
        osl=args.osl,
        num_groups=args.prefix_groups,
        prompts_per_group=max(count // args.prefix_groups, 1),
        prefix_len=prefix,
        suffix_len=isl - prefix,
    )
    return synthetic_requests(config, count)


def measure_system(system: str, args: argparse.Namespace, work_dir: Path) -> list[dict[str, Any]]:
    cells = []
    with _stack(system, args, work_dir) as stack:
        pids = (stack.frontend_pid, *stack.replica_pids)
        logger.info("%s up at %s (frontend pids=%s)", system, stack.url, pids)
        seeds = itertools.count(1)  # workloads in the same order on both sides: same prompts
        count = max(args.num_requests, 200)
        for endpoint in _csv(args.endpoint, ("chat", "completions")):
            for isl in (int(i) for i in _csv(args.isl)):
                shared = _workload(args, isl, count, next(seeds)) if args.reuse_prompts else []
                warmup = LoadConfig(
                    url=stack.url,
                    model=stack.model,
                    endpoint=endpoint,
                    concurrency=8,
                    num_requests=args.warmup_requests,
                    timeout_s=120.0,
                )
                num_warmup = max(args.warmup_requests, 1)
                run_cell(warmup, shared or _workload(args, isl, num_warmup, next(seeds)))
                for concurrency in (int(c) for c in _csv(args.concurrency)):
                    for connections in _csv(args.connections, ("fresh", "reused")):
                        # fresh prompts: no cell measures a cache of what an earlier one sent
                        workload = shared or _workload(args, isl, count, next(seeds))
                        config = LoadConfig(
                            url=stack.url,
                            model=stack.model,
                            endpoint=endpoint,
                            concurrency=concurrency,
                            num_requests=args.num_requests,
                            duration_s=args.duration_s,
                            fresh_connections=connections == "fresh",
                            timeout_s=120.0,
                            server_pids=pids,
                        )
                        engines = CpuMeter(stack.engine_pids)
                        engines.start()
                        summary = run_cell(config, workload)
                        engine_s = sum(engines.stop().values())
                        num_ok = summary["num_ok"]
                        cell = {
                            "system": system,
                            "endpoint": endpoint,
                            "isl": isl,
                            "concurrency": concurrency,
                            "connections": connections,
                            "cpu_scope": stack.cpu_scope,
                            "frontend_processes": len(pids),
                            "load_avg_1m": os.getloadavg()[0],
                            **cell_metrics(summary, stack.frontend_pid),
                            "cpu_ms_per_req": summary.get("server_cpu_ms_per_request_total"),
                            # the mocker workers' and the bench client's CPU: all three
                            # share the host's cores, so together they bound req/s
                            "engine_cpu_ms_per_req": (
                                engine_s * 1000.0 / num_ok if stack.engine_pids and num_ok else None
                            ),
                            "client_cpu_ms_per_req": summary.get("client_cpu_ms_per_request"),
                        }
                        logger.info("%s", cell)
                        cells.append(cell)
    return cells


def format_table(cells: list[dict[str, Any]]) -> str:
    def key(c: dict[str, Any]) -> tuple[str, int, int, str]:
        return (c.get("endpoint", "chat"), c.get("isl", 0), c["concurrency"], c["connections"])

    by_key = {(c["system"], *key(c)): c for c in cells}
    cols = (
        "req_per_s",
        "cpu_ms_per_req",
        "engine_cpu_ms_per_req",
        "client_cpu_ms_per_req",
        "ttft_p50_ms",
        "cached_fraction",
        "e2e_p50_ms",
    )
    head = f"{'endpoint':<11} {'isl':>6} {'conc':>4} {'conn':<6}"
    lines = [head + "".join(f" {c:>27}" for c in cols)]
    lines.append(f"{'':30}" + f" {'tandem / dynamo (ratio)':>27}" * len(cols))
    for k in sorted({key(c) for c in cells}):
        t = by_key.get(("tandem", *k), {})
        d = by_key.get(("dynamo", *k), {})
        row = f"{k[0]:<11} {k[1]:>6} {k[2]:>4} {k[3]:<6}"
        for col in cols:
            tv, dv = t.get(col), d.get(col)
            ratio = f"{tv / dv:.2f}x" if tv is not None and dv else "-"
            row += f" {format_number(tv):>9} / {format_number(dv):>9} ({ratio:>5})"
        loads = [c["load_avg_1m"] for c in (t, d) if "load_avg_1m" in c]
        lines.append(row + (f"  load {'/'.join(f'{x:.1f}' for x in loads)}" if loads else ""))
    scopes = {c["system"]: (c["cpu_scope"], c.get("frontend_processes", 1)) for c in cells}
    lines.append(f"CPU measured on (scope, frontend processes): {scopes}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench frontend", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    systems = _csv(args.systems, SYSTEMS)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="tandem-bench-frontend-"))
    per_system, failures = measure_each(
        systems, lambda system: measure_system(system, args, work_dir)
    )
    cells = [cell for system_cells in per_system for cell in system_cells]
    print(format_table(cells))
    write_json(args.json, {"args": vars(args), "cells": cells, "failures": failures})
    print(f"wrote {args.json}; logs under {work_dir}")
    return 1 if failures or not cells else 0
