"""`tandem bench routers`: the same trace replayed against one stack per router mode.

For each mode it starts `tandem serve --engine mocker --workers N --router MODE`, replays the
same requests at the same times, and stops the stack; then prints TTFT p50/p99, e2e p50/p99,
throughput, KV hit rate (cached prompt tokens / prompt tokens, as the engines report in usage)
and each mode's TTFT p50 improvement over the first (baseline) mode: baseline p50 / mode p50.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from typing import Any

from tandem.bench.args import add_workload_arguments, workload
from tandem.bench.cell import cell_metrics, format_number, measure_each, run_cell
from tandem.bench.loadgen import LoadConfig
from tandem.bench.report import write_json
from tandem.bench.tandem_stack import LAYOUTS, tandem_mocker_stack
from tandem.bench.workload import RequestSpec

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--modes", default="round_robin,kv", help="first one is the baseline")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--speedup-ratio", type=float, default=1.0, help="mocker speed")
    parser.add_argument(
        "--context-length", type=int, default=262144, help="mocker context (trace prompts are long)"
    )
    parser.add_argument("--concurrency", type=int, default=None, help="cap in flight")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--duration-s", type=float, default=300.0, help="send cap per mode")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tandem-layout", choices=LAYOUTS, default="serve")
    parser.add_argument("--tandem-args", default="", help="extra flags for tandem serve")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--json", default="bench_routers.json")


def measure_mode(
    mode: str, args: argparse.Namespace, specs: list[RequestSpec], work_dir: Path
) -> dict[str, Any]:
    with tandem_mocker_stack(
        work_dir / mode,
        layout=args.tandem_layout,
        num_workers=args.workers,
        router=mode,
        speedup_ratio=args.speedup_ratio,
        extra_args=args.tandem_args,
        engine_args=f"--context-length {args.context_length}",
    ) as stack:
        config = LoadConfig(
            url=stack.url,
            model=stack.model,
            endpoint="completions",
            concurrency=args.concurrency,
            request_rate=None,
            num_requests=args.num_requests,
            duration_s=args.duration_s,
            timeout_s=args.timeout_s,
            seed=args.seed,
        )
        summary = run_cell(config, specs)
    return {"mode": mode, **cell_metrics(summary)}


def format_table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["ttft_p50_ms"] if rows else None
    head = (
        f"{'mode':<14}{'ok':>7}{'err':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'e2e p50':>10}"
        f"{'e2e p99':>10}{'req/s':>8}{'out tok/s':>11}{'KV hit':>8}{'TTFT p50 gain':>15}"
    )
    lines = [head]
    for r in rows:
        gain = f"{base / r['ttft_p50_ms']:.2f}x" if base and r["ttft_p50_ms"] else "-"
        hit = r["cached_fraction"]
        lines.append(
            f"{r['mode']:<14}{r['num_ok']:>7}{r['num_errors']:>5}"
            + "".join(
                f"{format_number(r[k], '.1f'):>10}"
                for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")
            )
            + f"{format_number(r['req_per_s'], '.1f'):>8}"
            + f"{format_number(r['output_tok_per_s'], '.1f'):>11}"
            + f"{'-' if hit is None else f'{hit * 100:.1f}%':>8}{gain:>15}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench routers", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    specs = workload(args)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="tandem-bench-routers-"))
    rows, failures = measure_each(modes, lambda mode: measure_mode(mode, args, specs, work_dir))
    print(format_table(rows))
    write_json(args.json, {"args": vars(args), "modes": rows, "failures": failures})
    print(f"wrote {args.json}; logs under {work_dir}")
    return 1 if failures or not rows else 0
