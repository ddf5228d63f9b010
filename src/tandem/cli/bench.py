"""`tandem bench`: the load generator, or a named benchmark.

    tandem bench [load options]               load generator against any OpenAI endpoint
    tandem bench frontend|vllm [options]      against other systems (tandem.bench.compare)
    tandem bench indexer|engine|transfer|disagg|kvbm|multimodal|tracing|structured|
                 frontend-stages|mocker-path [options]
                                              component benchmarks (tandem.bench.component)
    tandem bench routers [options]            tandem's routers and the peers', same trace
    tandem bench planner [options]            planner vs static fleets on a time-varying load
    tandem bench soak [options]               RSS slope of every process under mixed load
    tandem bench tenants [options]            tenants, classes, batch, sessions vs FIFO (issue 33)
    tandem bench events [options]             CPU per message of the ZMQ event bus's receive path
    tandem bench churn [options]              KV router memory under ever-new prefixes
    tandem bench lora-placement [options]     LoRA adapter placement vs random, least-loaded
    tandem bench lora [options]               native decode step with 1/4/8 LoRA adapters vs base

A named benchmark is the module `tandem.bench.<SUBCOMMANDS[name]>` exposing
`main(argv) -> int`, imported only when asked for.
"""

from __future__ import annotations

import argparse
import importlib
import logging

SUBCOMMANDS = {
    "frontend": "compare.frontend",
    "frontend-stages": "component.frontend_stages",
    "mocker-path": "component.mocker_path",
    "events": "component.events",
    "routers": "component.routers",
    "indexer": "component.indexer",
    "churn": "component.churn",
    "lora-placement": "component.lora_placement",
    "lora": "component.lora",
    "engine": "component.engine",
    "transfer": "component.transfer",
    "disagg": "component.disagg",
    "kvbm": "component.kvbm",
    "multimodal": "component.multimodal",
    "planner": "component.planner",
    "soak": "component.soak",
    "vllm": "compare.vllm",
    "tracing": "component.tracing",
    "structured": "component.structured",
    "tenants": "component.tenants",
}


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(f"tandem.bench.{SUBCOMMANDS[argv[0]]}")
        return int(module.main(argv[1:]) or 0)
    if argv and not argv[0].startswith("-"):
        raise SystemExit(
            f"unknown benchmark '{argv[0]}'; expected one of: {', '.join(sorted(SUBCOMMANDS))}"
        )
    return run_load_command(argv)


def build_load_parser() -> argparse.ArgumentParser:
    from tandem.bench.args import add_load_arguments

    parser = argparse.ArgumentParser(
        prog="tandem bench",
        description="load generator for OpenAI endpoints; benchmarks: "
        + ", ".join(sorted(SUBCOMMANDS)),
    )
    add_load_arguments(parser)
    return parser


def run_load_command(argv: list[str]) -> int:
    from tandem.bench.args import load_config, workload
    from tandem.bench.loadgen import run_load_blocking
    from tandem.bench.report import format_summary, result_record, summarize, write_json
    from tandem.runtime.flag_parser import parse_args

    args = parse_args(build_load_parser(), argv)
    config = load_config(args)
    specs = workload(args)
    run = run_load_blocking(config, specs)
    summary = summarize(run)
    print(format_summary(summary))
    if args.json:
        write_json(
            args.json,
            {
                "config": {k: getattr(config, k) for k in config.__slots__},
                "summary": summary,
                "requests": [result_record(r) for r in run.results],
            },
        )
    return 0 if summary["num_ok"] else 1
