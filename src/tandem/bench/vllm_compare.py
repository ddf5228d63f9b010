"""`tandem bench vllm`: the same load against vLLM's own OpenAI server and against tandem's
frontend + one vLLM worker (`tandem serve --engine vllm`), same model and engine flags, one run.

Both stacks run from the vLLM virtualenv (`make venv-vllm`), one after the other (memory). Per
concurrency: a warm-up, then `--num-requests` streamed completions of random `--isl`-token
prompts with `--osl` output tokens (ignore_eos). Prints a table with tandem/vLLM ratios for
output tokens/s and TTFT/ITL/e2e p50, and the two targets of issue 16: throughput overhead
<= 5 % and TTFT p50 overhead <= 5 ms; writes everything to `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any

from tandem.bench.compare import cell_metrics, run_cell, write_report
from tandem.bench.loadgen import LoadConfig
from tandem.bench.stack import ProcessStack, free_port, wait_ready
from tandem.bench.workload import SyntheticConfig, synthetic_requests

logger = logging.getLogger(__name__)

SYSTEMS = ("vllm", "tandem")
DEFAULT_ENGINE_ARGS = "--dtype float32 --block-size 32 --max-model-len 2048 --enforce-eager"
MODEL = "smollm2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2)")
    parser.add_argument("--engine-args", default=DEFAULT_ENGINE_ARGS, help="vLLM flags, both")
    parser.add_argument("--concurrency", default="1,8", help="comma list")
    parser.add_argument("--num-requests", type=int, default=48, help="per concurrency")
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=120.0, help="cap per cell")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    parser.add_argument("--work-dir", default=None, help="logs (default: a temporary dir)")
    parser.add_argument("--json", default="bench_vllm.json")


def _argv(system: str, python: str, model_dir: str, port: int, engine_args: str) -> list[str]:
    flags = shlex.split(engine_args)
    common = ["--port", str(port), "--model", model_dir, "--served-model-name", MODEL, *flags]
    if system == "vllm":
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", *common]
    return [python, "-m", "tandem.cli", "serve", "--engine", "vllm", "--workers", "1", *common]


def measure(
    system: str, python: str, model_dir: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    work = Path(args.work_dir) / system
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    specs = synthetic_requests(SyntheticConfig(isl=args.isl, osl=args.osl), 1000)
    cells = []
    with ProcessStack(work) as stack:
        argv = _argv(system, python, model_dir, port, args.engine_args)
        stack.spawn(system, argv, env=engine_env())
        asyncio.run(wait_ready(url, timeout_s=args.ready_timeout_s, stack=stack))
        run_cell(LoadConfig(url=url, model=MODEL, concurrency=4,
                            num_requests=args.warmup_requests), specs)  # fmt: skip
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            config = LoadConfig(
                url=url, model=MODEL, endpoint="completions", concurrency=concurrency,
                num_requests=args.num_requests, duration_s=args.duration_s, timeout_s=300.0,
            )  # fmt: skip
            cell = {"system": system, "concurrency": concurrency}
            cell |= cell_metrics(run_cell(config, specs))
            logger.info("%s", cell)
            cells.append(cell)
    return cells


def engine_env() -> dict[str, str]:
    """The same vLLM CPU settings for both systems (the worker's defaults, unless set)."""
    from tandem.engines.vllm.engine import CPU_ENV_DEFAULTS

    return {k: os.environ.get(k, v) for k, v in CPU_ENV_DEFAULTS.items()}


def format_table(cells: list[dict[str, Any]]) -> str:
    by = {(c["system"], c["concurrency"]): c for c in cells}
    cols = ("output_tok_per_s", "ttft_p50_ms", "itl_p50_ms", "e2e_p50_ms")
    lines = [f"{'conc':>4}" + "".join(f" {c + ' tandem/vllm':>34}" for c in cols) + "  verdict"]
    for conc in sorted({c["concurrency"] for c in cells}):
        t, v = by.get(("tandem", conc), {}), by.get(("vllm", conc), {})
        row = f"{conc:>4}"
        for col in cols:
            tv, vv = t.get(col), v.get(col)
            ratio = f"{tv / vv:.3f}" if tv is not None and vv else "-"
            row += f" {_num(tv):>10} / {_num(vv):>10} ({ratio:>6})"
        lines.append(row + "  " + _verdict(t, v))
    return "\n".join(lines)


def _verdict(t: dict[str, Any], v: dict[str, Any]) -> str:
    if not t.get("output_tok_per_s") or not v.get("output_tok_per_s"):
        return "-"
    loss = 1 - t["output_tok_per_s"] / v["output_tok_per_s"]
    ttft = (t.get("ttft_p50_ms") or 0) - (v.get("ttft_p50_ms") or 0)
    ok = loss <= 0.05 and ttft <= 5.0
    return f"throughput {-loss:+.1%}, TTFT p50 {ttft:+.1f} ms: {'OK' if ok else 'OVER TARGET'}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str]) -> int:
    from tandem.engines.vllm.model_dir import ensure_hf_dir
    from tandem.engines.vllm.venv import HINT, default_venv, vllm_python

    parser = argparse.ArgumentParser(prog="tandem bench vllm", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    python = vllm_python()
    if python is None:
        raise SystemExit(HINT.format(venv=default_venv()))
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="tandem-bench-vllm-")
    model_dir = ensure_hf_dir(args.model)
    cells: list[dict[str, Any]] = []
    for system in SYSTEMS:
        cells.extend(measure(system, python, model_dir, args))
    print(format_table(cells), flush=True)
    write_report(args.json, {"engine_args": args.engine_args, "isl": args.isl,
                             "osl": args.osl, "cells": cells})  # fmt: skip
    return 0 if all(c["num_ok"] for c in cells) else 1
