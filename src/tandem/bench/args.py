"""Flags of the load generator → `LoadConfig` + workload. Shared by `tandem bench` and the
comparisons (`tandem bench frontend|routers`), which add their own flags on top."""

from __future__ import annotations

import argparse

from tandem.bench.loadgen import ENDPOINTS, LoadConfig
from tandem.bench.trace import TraceConfig, trace_requests
from tandem.bench.workload import DEFAULT_VOCAB_SIZE, RequestSpec, SyntheticConfig
from tandem.bench.workload import synthetic_requests as make_synthetic


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("target and pacing")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="OpenAI server base URL")
    g.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    g.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                   help="OpenAI route to load")  # fmt: skip
    g.add_argument("--concurrency", type=int, default=None, help="requests in flight (cap)")
    g.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per s")
    g.add_argument("--num-requests", type=int, default=None, help="stop after this many")
    g.add_argument("--duration-s", type=float, default=None, help="stop sending after this")
    g.add_argument("--fresh-connections", action="store_true", help="new TCP conn per request")
    g.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--isl", type=int, default=128, help="input tokens per request")
    g.add_argument("--osl", type=int, default=32, help="output tokens per request")
    g.add_argument("--shared-prefix-groups", type=int, default=0,
                   help="groups of prompts sharing a prefix (0: no shared prefixes)")  # fmt: skip
    g.add_argument("--prompts-per-group", type=int, default=1, help="prompts in each group")
    g.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens per group")
    g.add_argument("--suffix-len", type=int, default=0, help="unique tokens after the prefix")
    g.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help="token ids are drawn below this")  # fmt: skip
    g.add_argument("--trace", default=None, help="Mooncake trace (JSONL) to replay")
    g.add_argument("--trace-block-size", type=int, default=512,
                   help="tokens per hash id in the trace")  # fmt: skip
    g.add_argument("--speedup", type=float, default=1.0, help="trace time compression")
    g.add_argument("--max-requests", type=int, default=None, help="first N trace records")
    g.add_argument("--max-input-length", type=int, default=None, help="clip trace prompts")


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    add_workload_arguments(parser)
    g = parser.add_argument_group("measurement")
    g.add_argument("--server-pid", type=int, action="append", default=[],
                   help="measure this server process's CPU and RSS (repeatable)")  # fmt: skip
    g.add_argument("--server-children", action="store_true", help="count children's CPU too")
    g.add_argument("--json", default=None, help="write summary + per-request results here")


def load_config(args: argparse.Namespace, **overrides: object) -> LoadConfig:
    values: dict[str, object] = {
        "url": args.url,
        "model": args.model,
        "endpoint": args.endpoint,
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "num_requests": args.num_requests,
        "duration_s": args.duration_s,
        "fresh_connections": args.fresh_connections,
        "timeout_s": args.timeout_s,
        "seed": args.seed,
        "server_pids": tuple(getattr(args, "server_pid", ()) or ()),
        "server_children": getattr(args, "server_children", False),
    }
    values.update(overrides)
    return LoadConfig(**values)  # type: ignore[arg-type]


def workload(args: argparse.Namespace) -> list[RequestSpec]:
    """The requests the flags describe: a trace replay, shared-prefix groups, or random ISL."""
    if args.trace:
        return trace_requests(
            args.trace,
            TraceConfig(
                block_size=args.trace_block_size,
                vocab_size=args.vocab_size,
                speedup=args.speedup,
                max_requests=args.max_requests,
                max_input_length=args.max_input_length,
                seed=args.seed,
            ),
        )
    config = SyntheticConfig(
        isl=args.isl,
        osl=args.osl,
        num_groups=args.shared_prefix_groups,
        prompts_per_group=args.prompts_per_group,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )
    count = args.num_requests or 1000
    if config.num_groups:  # one full pass over every group's prompts at least
        count = args.num_requests or config.num_groups * config.prompts_per_group
    return make_synthetic(config, count)
