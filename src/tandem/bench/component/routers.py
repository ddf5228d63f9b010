"""`tandem bench routers`: the same workload replayed against tandem's routers and the routers a
user would pick instead, over identical mocker backends, in one run.

Systems (`--systems`, in order):
- `kv`, `round_robin`, ... (or `tandem:kv`): `tandem serve --engine mocker --workers N
  --router MODE`; `kv+fetch`: the same with `--kv-fetch` (the workers export and pull cached
  prefixes, and the KV router hints peer fetches where a fetch beats recomputing);
- `dynamo:kv`: Dynamo 1.6.1's frontend and KV router over N of its own mockers (anchors/dynamo;
  same block size, pool and batch limits as tandem's mocker);
- `smg:cache_aware`, `vllm-router:cache_aware` (any policy after the colon): SMG 1.13.0 / vLLM
  router 0.1.17 over N one-worker `tandem serve --engine mocker` stacks (anchors/smg,
  anchors/vllm-router).
A peer whose venv is not set up is a row "not set up (run ...)"; one that fails is a row with its
error; neither is dropped. Every system gets each prompt variant (`--prompts`): `tokens` (token-id
prompts) and `text` (one-token words, `router_workloads.TextPrompts`: the same engine work), and
each worker count of `--workers` (e.g. `4,8`).

Per row: TTFT p50/p90/p99, the cached share of prompt tokens (usage's cached tokens / prompt
tokens), that share over the infinite-cache oracle computed from the prompts the row sent
(`router_workloads.oracle_cached_fraction`; `--duration-s` may stop a row before the workload
ends), and CPU ms per answered request of the process
that routes (tandem's and Dynamo's frontend, the SMG / vLLM router process) and of every process
that routes, tokenizes or streams (for SMG and the vLLM router: the router plus the backends'
frontends), from /proc over the load. A tandem row also gives the peer KV fetches its router
hinted and their blocks (the `kv+fetch` row starts the workers with peer fetch); a fetched
block counts as cached, as the oracle counts every block computed before anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tandem.bench.args import add_workload_arguments, workload
from tandem.bench.cell import cell_metrics, format_number, run_cell
from tandem.bench.compare.dynamo_anchor import AnchorConfig, dynamo_mocker_stack
from tandem.bench.compare.http_routers import HTTP_ROUTERS, http_router_stack, missing_setup
from tandem.bench.component.router_workloads import (
    AgentSessionsConfig,
    TextPrompts,
    agent_sessions,
    oracle_cached_fraction,
)
from tandem.bench.loadgen import LoadConfig
from tandem.bench.report import write_json
from tandem.bench.shared_dir import MOONCAKE_TRACE
from tandem.bench.tandem_stack import LAYOUTS, tandem_mocker_stack
from tandem.bench.workload import RequestSpec
from tandem.config_check import check_range
from tandem.engines.mocker.config import MockerConfig

logger = logging.getLogger(__name__)

DEFAULT_SYSTEMS = "round_robin,kv,kv+fetch,dynamo:kv,smg:cache_aware,vllm-router:cache_aware"
PROMPT_VARIANTS = ("tokens", "text")
WORKLOADS = ("mooncake", "agents", "flags")


@dataclass(frozen=True, slots=True)
class System:
    kind: str  # "tandem" | "dynamo" | "smg" | "vllm-router"
    policy: str
    fetch: bool = False  # tandem with --kv-fetch (peer KV fetch; the kv router only)

    @property
    def name(self) -> str:
        name = self.policy + ("+fetch" if self.fetch else "")
        return name if self.kind == "tandem" else f"{self.kind}:{name}"


def parse_systems(text: str) -> list[System]:
    """`kv,kv+fetch,round_robin,dynamo:kv,smg:cache_aware,...` → systems; a clear error on
    unknown kinds, and on `+fetch` anywhere but tandem's kv router (the only one that hints)."""
    systems = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        kind, _, policy = item.rpartition(":")
        kind = kind or "tandem"
        if kind not in ("tandem", "dynamo", *HTTP_ROUTERS):
            raise ValueError(
                f"unknown system {item!r}; expected MODE, tandem:MODE, dynamo:MODE, "
                "smg:POLICY or vllm-router:POLICY"
            )
        policy, plus, extra = policy.partition("+")
        if not policy:
            raise ValueError(f"system {item!r} names no policy")
        if plus and (extra != "fetch" or kind != "tandem" or policy != "kv"):
            raise ValueError(f"system {item!r}: only tandem's kv router takes '+fetch' (kv+fetch)")
        systems.append(System(kind, policy, fetch=bool(plus)))
    if not systems:
        raise ValueError("--systems names no system")
    return systems


def parse_workers(text: str) -> list[int]:
    counts = [int(w) for w in text.split(",") if w.strip()]
    if not counts:
        raise ValueError("--workers names no worker count")
    for count in counts:
        check_range("workers", count, low=1)
    return counts


def parse_ratios(text: str) -> list[float]:
    ratios = [float(r) for r in text.split(",") if r.strip()]
    if not ratios:
        raise ValueError("--speedup-ratios names no ratio")
    for ratio in ratios:
        check_range("speedup_ratios", ratio, low=0.0, low_open=True)
    return ratios


def parse_prompts(text: str) -> list[str]:
    variants = [v.strip() for v in text.split(",") if v.strip()]
    for variant in variants:
        if variant not in PROMPT_VARIANTS:
            raise ValueError(f"unknown prompt variant {variant!r}; expected tokens or text")
    if not variants:
        raise ValueError("--prompts names no variant")
    return variants


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    g = parser.add_argument_group("routers")
    g.add_argument("--systems", "--modes", dest="systems", default=DEFAULT_SYSTEMS,
                   help="comma list: MODE (tandem), dynamo:MODE, smg:POLICY, vllm-router:POLICY; "
                   "the first is the baseline")  # fmt: skip
    g.add_argument("--workload", choices=WORKLOADS, default="mooncake",
                   help="mooncake: the public trace (--trace overrides the file); agents: "
                   "multi-turn sessions over shared system prompts; flags: the workload "
                   "flags")  # fmt: skip
    g.add_argument("--prompts", default="tokens,text", help="prompt variants: tokens,text")
    g.add_argument("--workers", default="4", help="worker counts, e.g. 4,8")
    g.add_argument("--speedup-ratio", type=float, default=1.0, help="mocker speed")
    g.add_argument("--speedup-ratios", default=None,
                   help="heterogeneous workers: one mocker speed per worker, e.g. "
                   "1,1,0.5,0.25 (sets the worker count; tandem runs split, a process per "
                   "worker)")  # fmt: skip
    g.add_argument("--context-length", type=int, default=131072,
                   help="mocker context; trace prompts are clipped to fit")  # fmt: skip
    g.add_argument("--concurrency", type=int, default=None, help="cap in flight")
    g.add_argument("--num-requests", type=int, default=None)
    g.add_argument("--duration-s", type=float, default=300.0, help="send cap per row")
    g.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tandem-layout", choices=LAYOUTS, default="serve")
    g.add_argument("--tandem-args", default="", help="extra flags for tandem serve")
    g.add_argument("--agent-sessions", type=int, default=160)
    g.add_argument("--agent-turns", type=int, default=4)
    g.add_argument("--agent-system-prompts", type=int, default=8)
    g.add_argument("--agent-system-len", type=int, default=4096)
    g.add_argument("--agent-session-rate", type=float, default=2.0, help="sessions per s")
    g.add_argument("--work-dir", default=None)
    g.add_argument("--json", default="bench_routers.json")


def build_workload(args: argparse.Namespace) -> list[RequestSpec]:
    if args.workload == "agents":
        return agent_sessions(
            AgentSessionsConfig(
                num_sessions=args.agent_sessions,
                turns=args.agent_turns,
                num_system_prompts=args.agent_system_prompts,
                system_len=args.agent_system_len,
                session_rate_per_s=args.agent_session_rate,
                vocab_size=args.vocab_size,
                seed=args.seed,
            )
        )
    if args.workload == "mooncake" and not args.trace:
        args.trace = MOONCAKE_TRACE
    if args.trace and args.max_input_length is None:  # room for the answer in the context
        args.max_input_length = args.context_length - 4096
    specs = workload(args)
    if args.num_requests is not None:
        specs = specs[: args.num_requests]
    return specs


def mocker_engine_args(args: argparse.Namespace) -> str:
    return f"--context-length {args.context_length}"


def dynamo_mocker_args() -> str:
    """Dynamo's mocker shaped like tandem's (block size, pool, batch limits)."""
    m = MockerConfig()
    return (
        f"--block-size {m.block_size} --num-gpu-blocks-override {m.num_blocks} "
        f"--max-num-seqs {m.max_num_seqs} --max-num-batched-tokens {m.max_num_batched_tokens}"
    )


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    model: str | None
    router_pid: int
    front_pids: tuple[int, ...]  # the router's and every frontend's that tokenizes or streams


@contextlib.contextmanager
def start_system(
    system: System, workers: int, args: argparse.Namespace, work_dir: Path
) -> Iterator[Target]:
    ratios = args.speedup_ratios
    if system.kind == "tandem":
        with tandem_mocker_stack(
            work_dir,
            layout="split" if ratios else args.tandem_layout,
            num_workers=workers,
            router=system.policy,
            speedup_ratio=args.speedup_ratio,
            speedup_ratios=ratios,
            extra_args=args.tandem_args,
            engine_args=mocker_engine_args(args) + (" --kv-fetch" if system.fetch else ""),
        ) as stack:
            pids = (stack.frontend_pid, *stack.replica_pids)
            yield Target(stack.url, stack.model, stack.frontend_pid, pids)
    elif system.kind == "dynamo":
        if ratios:
            raise ValueError("the Dynamo anchor runs every mocker at one SPEEDUP")
        config = AnchorConfig(
            num_workers=workers,
            speedup=args.speedup_ratio,
            router_mode=system.policy,
            model_name="smol-long" if args.context_length > 8192 else "SmolLM2-135M-Instruct",
            mocker_args=dynamo_mocker_args(),
        )
        with dynamo_mocker_stack(work_dir, config) as stack:
            yield Target(stack.url, stack.model, stack.frontend_pid, (stack.frontend_pid,))
    else:
        backend = f"--engine mocker --speedup-ratio {args.speedup_ratio:g} "
        with contextlib.ExitStack() as backends:
            own = [  # heterogeneous: one-worker stacks started here, one speed each
                backends.enter_context(
                    tandem_mocker_stack(work_dir / f"backend{i}", layout="serve", num_workers=1,
                                        speedup_ratio=r, engine_args=mocker_engine_args(args))
                )
                for i, r in enumerate(ratios or ())
            ]  # fmt: skip
            peer = backends.enter_context(
                http_router_stack(
                    HTTP_ROUTERS[system.kind],
                    work_dir,
                    policy=system.policy,
                    num_workers=workers,
                    backend_args=backend + mocker_engine_args(args),
                    worker_urls=[b.url for b in own],
                )
            )
            backend_pids = peer.backend_pids or tuple(b.frontend_pid for b in own)
            pids = (peer.router_pid, *backend_pids)
            yield Target(peer.url, None, peer.router_pid, pids)


def not_set_up(system: System) -> str | None:
    """The command that sets the peer up, when it is not."""
    if system.kind in HTTP_ROUTERS:
        return missing_setup(HTTP_ROUTERS[system.kind])
    if system.kind == "dynamo":
        config = AnchorConfig()
        install = Path(config.install_dir)
        if not ((install / "venv" / "bin" / "python").exists() and (install / "model").exists()):
            return f"bash {Path(config.anchor_dir) / 'setup.sh'}"
    return None


def measure_row(
    system: System,
    variant: str,
    workers: int,
    specs: list[RequestSpec],
    oracle_of: Oracle,
    args: argparse.Namespace,
    work_dir: Path,
) -> dict[str, Any]:
    row: dict[str, Any] = {"system": system.name, "prompts": variant, "workers": workers}
    row["oracle"] = None
    setup = not_set_up(system)
    if setup is not None:
        return {**row, "error": f"not set up (run {setup})"}
    cell_dir = work_dir / f"{system.name.replace(':', '-')}-{variant}-{workers}"
    try:
        with start_system(system, workers, args, cell_dir) as target:
            config = LoadConfig(
                url=target.url,
                model=target.model,
                endpoint="completions",
                concurrency=args.concurrency,
                num_requests=None,
                duration_s=args.duration_s,
                timeout_s=args.timeout_s,
                seed=args.seed,
                server_pids=target.front_pids,
            )
            summary = run_cell(config, specs)
            fetches = fetch_hints(target.url) if system.kind == "tandem" else None
    except Exception as exc:  # one system failing must not lose the others' rows
        logger.exception("%s (%s, %d workers) failed", system.name, variant, workers)
        return {**row, "error": str(exc).splitlines()[0] if str(exc) else repr(exc)}
    metrics = cell_metrics(summary, target.router_pid)
    per_pid = summary.get("server_cpu_ms_per_request") or {}
    front = [per_pid.get(str(pid)) for pid in target.front_pids]
    row.update(metrics)
    row["ttft_p90_ms"] = summary["ttft_ms"]["p90"]
    row["router_cpu_ms_per_req"] = metrics["cpu_ms_per_req"]
    row["front_cpu_ms_per_req"] = None if None in front else sum(f for f in front if f)
    oracle = oracle_of(metrics["num_ok"] + metrics["num_errors"])  # over the requests sent
    row["oracle"] = oracle
    share = metrics["cached_fraction"]
    row["share_of_oracle"] = share / oracle if share is not None and oracle else None
    row["kv_fetches"], row["kv_fetch_blocks"] = fetches or (None, None)
    return row


def fetch_hints(url: str) -> tuple[int, int] | None:
    """The peer KV fetches tandem's router hinted over the run, and their blocks (its
    ``tandem_router_kv_fetch*`` counters); None when /metrics does not answer. A fetched
    block counts as cached in the row's share: the worker reports the fetched tokens as
    cached ones (`PeerFetch`), as the oracle counts any block computed before anywhere."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    totals = {"tandem_router_kv_fetches_total": 0.0, "tandem_router_kv_fetch_blocks_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return int(totals["tandem_router_kv_fetches_total"]), int(
        totals["tandem_router_kv_fetch_blocks_total"]
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'router':<26}{'prompts':<8}{'wk':>3}{'ok':>6}{'err':>5}{'TTFT p50':>10}{'p90':>9}"
        f"{'p99':>9}{'cached':>8}{'oracle':>8}{'/oracle':>8}{'router CPU':>11}{'front CPU':>10}"
    )
    lines = [head, f"{'':<43}(ms){'':<26}(share of prompt tokens){'':<3}(ms/req)"]
    for r in rows:
        lead = f"{r['system']:<26}{r['prompts']:<8}{r['workers']:>3}"
        if "error" in r:
            lines.append(f"{lead}  {r['error']}")
            continue
        if not r["num_ok"]:  # e.g. SMG refuses token-id prompts
            lines.append(f"{lead}  every request failed, by HTTP status: {r['errors_by_status']}")
            continue
        lines.append(
            lead
            + f"{r['num_ok']:>6}{r['num_errors']:>5}"
            + f"{format_number(r['ttft_p50_ms'], '.0f'):>10}"
            + f"{format_number(r['ttft_p90_ms'], '.0f'):>9}"
            + f"{format_number(r['ttft_p99_ms'], '.0f'):>9}"
            + f"{_pct(r['cached_fraction']):>8}{_pct(r['oracle']):>8}"
            + f"{_pct(r['share_of_oracle']):>8}"
            + f"{format_number(r['router_cpu_ms_per_req'], '.2f'):>11}"
            + f"{format_number(r['front_cpu_ms_per_req'], '.2f'):>10}"
        )
    return "\n".join(lines)


def variant_specs(
    specs: list[RequestSpec], variants: list[str], block_size: int
) -> dict[str, tuple[list[RequestSpec], Oracle]]:
    """Each prompt variant's requests and its oracle over the first N sent (on the token
    structure it sends)."""
    out: dict[str, tuple[list[RequestSpec], Oracle]] = {}
    text = TextPrompts.for_mocker() if "text" in variants else None
    for variant in variants:
        if variant == "text":
            assert text is not None
            sent = [text.spec(s) for s in specs]
            out[variant] = (sent, _oracle(specs, block_size, text.word_ids))
        else:
            out[variant] = (specs, _oracle(specs, block_size, None))
    return out


Oracle = Callable[[int], "float | None"]


def _oracle(
    specs: list[RequestSpec], block_size: int, words: Callable[[list[int]], list[int]] | None
) -> Oracle:
    """The infinite-cache oracle of the first ``n`` requests: a row capped by --duration-s
    sends a prefix of the workload, and the requests it never sent would only raise the
    oracle (the trace's later requests reuse more), so it is taken over those sent."""
    cache: dict[int, float | None] = {}

    def oracle(n: int) -> float | None:
        if n not in cache:
            prompts = (s.prompt_token_ids() for s in specs[:n])
            cache[n] = oracle_cached_fraction(
                prompts if words is None else (words(p) for p in prompts), block_size
            )
        return cache[n]

    return oracle


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench routers", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        systems = parse_systems(args.systems)
        worker_counts = parse_workers(args.workers)
        if args.speedup_ratios:
            args.speedup_ratios = parse_ratios(args.speedup_ratios)
            worker_counts = [len(args.speedup_ratios)]
        variants = parse_prompts(args.prompts)
        check_range("context_length", args.context_length, low=8192)
    except ValueError as exc:
        parser.error(str(exc))
    specs = build_workload(args)
    block_size = MockerConfig().block_size
    prepared = variant_specs(specs, variants, block_size)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="tandem-bench-routers-"))
    rows = []
    for workers in worker_counts:
        for variant in variants:
            sent, oracle = prepared[variant]
            for system in systems:
                rows.append(measure_row(system, variant, workers, sent, oracle, args, work_dir))
                print(format_table(rows[-1:]), flush=True)
    print(format_table(rows))
    for r in rows:
        if r.get("kv_fetches") is not None:
            print(f"{r['system']} ({r['prompts']}, {r['workers']} workers): "
                  f"{r['kv_fetches']} peer KV fetches hinted, {r['kv_fetch_blocks']} blocks "
                  "(counted as cached when they succeed)")  # fmt: skip
    write_json(args.json, {"args": vars(args), "rows": rows})
    print(f"wrote {args.json}; logs under {work_dir}")
    return 1 if any("error" in r for r in rows) else 0
