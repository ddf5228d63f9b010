"""`tandem serve`: the all-in-one stack on one host.

The frontend runs in this process; each worker is a `tandem worker` child process (so a model's
compute never stalls the frontend's event loop, and a worker can die alone). They meet through
embedded planes only: file discovery in a private run directory and the ZMQ event bus, so
nothing has to be installed or started by hand. Flags this command does not know are passed
to every worker (engine flags such as `--speedup-ratio`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import sys
from typing import TYPE_CHECKING

from tandem.cli.supervisor import WorkerGroup, WorkerSpec, make_run_dir, remove_stale_run_dirs
from tandem.errors import StartupError
from tandem.runtime.flag_parser import parse_known_args
from tandem.runtime.process_setup import (
    add_log_format_arg,
    add_tracing_args,
    configure_logging,
    configure_tracing,
    run_async,
)

if TYPE_CHECKING:
    from tandem.frontend.config import FrontendConfig

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    from tandem.frontend.args import add_frontend_args

    parser = argparse.ArgumentParser(
        prog="tandem serve",
        description=__doc__,
        epilog="Unknown flags go to every worker, e.g. --speedup-ratio 0 for the mocker, or "
        "--tool-call-parser NAME / --reasoning-parser NAME (see `tandem worker --help`). "
        "--cluster-secret S or --cluster-secret-file P (or TANDEM_CLUSTER_SECRET(_FILE)) is "
        "the whole stack's cluster secret; without one serve generates one per stack.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = parser.add_argument_group("serve")
    g.add_argument(
        "--engine",
        default="native",
        help="engine of every worker: native (SmolLM2 on torch), mocker, or vllm (runs in "
        "the .venv-vllm virtualenv, `make venv-vllm`)",
    )
    g.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="number of aggregated worker processes",
    )
    g.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        metavar="P",
        help="disaggregated: P prefill worker processes (component 'prefill'); with "
        "--decode-workers this enables --disagg on the frontend",
    )
    g.add_argument(
        "--decode-workers",
        type=int,
        default=0,
        metavar="D",
        help="disaggregated: D decode worker processes (component 'backend'), replacing --workers",
    )
    g.add_argument(
        "--encode-workers",
        type=int,
        default=0,
        metavar="E",
        help="multimodal: E encode worker processes (`tandem worker --engine encoder`, component "
        "'encoder'); the other workers then get image embeddings from them (E/PD, E/P/D). "
        "0: each worker encodes its own images (EPD)",
    )
    g.add_argument(
        "--encoder-args",
        default="",
        help="flags for the encode workers only, one string (empty with --engine mocker: "
        "'--mm-encoder sim'); unknown serve flags do not go to them",
    )
    g.add_argument(
        "--frontend-processes",
        default="auto",
        metavar="N|auto",
        help="HTTP frontend processes sharing --port (SO_REUSEPORT; their routers share "
        "active requests by replica sync and each follows the workers' KV events); auto: one "
        "per 4 cores, at most 8 (docs/perf-frontend.md)",
    )
    g.add_argument("--frontend-replica", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--namespace", default="tandem", help="namespace of every endpoint path")
    g.add_argument(
        "--run-dir",
        help="where discovery records live (default: a fresh temporary directory)",
    )
    g.add_argument(
        "--worker-ready-timeout-s",
        type=float,
        default=600.0,
        help="give up if the workers are not registered by then",
    )
    g.add_argument("--log-level", default="INFO", help="logging level")
    add_log_format_arg(g)
    add_tracing_args(g, "tandem-frontend")  # the workers' spans are service tandem-worker
    g.add_argument(
        "--planner",
        action="store_true",
        help="workers are started and drained by an embedded planner (local connector) "
        "between the pools' min and max, instead of a fixed --workers count",
    )
    add_frontend_args(parser, with_runtime=False)
    from tandem.planner.args import add_planner_args

    add_planner_args(parser, with_connector=False)
    return parser


def _validate(args: argparse.Namespace) -> None:
    from tandem.engines.base import engine_names

    if args.engine not in engine_names():
        raise SystemExit(
            f"tandem serve: unknown engine '{args.engine}'; expected one of: "
            f"{', '.join(engine_names())}"
        )
    if args.workers < 1:
        raise SystemExit(f"tandem serve: --workers={args.workers}; expected >= 1")
    if args.prefill_workers < 0 or args.decode_workers < 0:
        raise SystemExit("tandem serve: --prefill-workers and --decode-workers must be >= 0")
    if args.prefill_workers and not args.decode_workers:
        raise SystemExit(
            f"tandem serve: --prefill-workers={args.prefill_workers} needs --decode-workers >= 1"
        )
    if args.encode_workers < 0:
        raise SystemExit(f"tandem serve: --encode-workers={args.encode_workers}; expected >= 0")
    if args.decode_workers:
        args.disagg = True  # the frontend splits requests over the two pools
    args.frontend_processes = _frontend_processes(args.frontend_processes)
    if args.frontend_processes > 1 and args.planner:
        raise SystemExit(
            f"tandem serve: --frontend-processes={args.frontend_processes} is not supported with "
            "--planner; expected 1"
        )
    if args.frontend_processes > 1:  # every process binds the port; routers share active state
        args.http_reuse_port = args.router_replica_sync = True


def frontend_processes_for(num_cpus: int) -> int:
    """Frontend processes for a host with `num_cpus` cores: one per 4 cores, at least 1, at most
    8 (docs/perf-frontend.md): one process takes 2-3 CPU-ms per 6000-token chat request and
    ~0.5 at 64 tokens, so one core's worth of frontend per 4 leaves the rest to the workers,
    the clients' TCP on loopback and the kernel. A 2-core host gets 1."""
    return max(1, min(num_cpus // 4, 8))


def _frontend_processes(value: str) -> int:
    if value == "auto":
        return frontend_processes_for(os.cpu_count() or 1)
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise SystemExit(
            f"tandem serve: --frontend-processes={value}; expected an integer >= 1 or auto"
        )
    return count


def worker_specs(args: argparse.Namespace, passthrough: list[str]) -> list[WorkerSpec]:
    """One spec per worker process; the supervisor adds the shared runtime flags."""
    common = ["--engine", args.engine, *_observability_argv(args), *passthrough]
    if getattr(args, "kv_fetch", None) and args.router == "kv":
        common.append("--kv-fetch")  # the workers export and pull cached prefixes (peer fetch)
    encoders = _encoder_specs(args)
    if encoders:
        common.append("--mm-remote-encode")
    if not args.decode_workers:
        specs = [WorkerSpec(name=f"worker{i}", argv=list(common)) for i in range(args.workers)]
    else:
        prefill = args.disagg_prefill_component
        specs = [
            *(
                WorkerSpec(name=f"prefill{i}", argv=[*common, "--disagg-mode", "prefill"],
                           component=prefill)
                for i in range(args.prefill_workers)
            ),
            *(
                WorkerSpec(name=f"decode{i}", argv=[*common, "--disagg-mode", "decode"])
                for i in range(args.decode_workers)
            ),
        ]  # fmt: skip
    if args.engine == "vllm":
        _share_cpus(specs, passthrough)
    return [*encoders, *specs]


def _share_cpus(specs: list[WorkerSpec], passthrough: list[str]) -> None:
    """Several vLLM workers on this host: each its own cores (`--vllm-cpus`), unless the
    user chose (the flag, or VLLM_CPU_OMP_THREADS_BIND)."""
    from tandem.engines.vllm.config import cpu_shares

    chosen = any(a.split("=")[0] == "--vllm-cpus" for a in passthrough)
    user_env = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or os.environ.get("TANDEM_VLLM_CPUS")
    if len(specs) < 2 or chosen or user_env:
        return
    for spec, cpus in zip(specs, cpu_shares(len(specs)), strict=True):
        spec.argv.extend(["--vllm-cpus", cpus])


def _encoder_specs(args: argparse.Namespace) -> list[WorkerSpec]:
    import shlex

    extra = shlex.split(args.encoder_args)
    if args.engine == "mocker" and "--mm-encoder" not in extra:
        extra = ["--mm-encoder", "sim", *extra]
    config = getattr(args, "encoder_config_flags", [])  # shadows an inherited TANDEM_CONFIG
    argv = ["--engine", "encoder", *_observability_argv(args), *config, *extra]
    return [
        WorkerSpec(name=f"encoder{i}", argv=list(argv), component="encoder", endpoint="encode")
        for i in range(args.encode_workers)
    ]


def _observability_argv(args: argparse.Namespace) -> list[str]:
    """The workers log and trace as this process does."""
    argv = ["--log-level", args.log_level, "--log-format", args.log_format]
    return argv + (["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else [])


async def serve(args: argparse.Namespace, passthrough: list[str]) -> int:
    from tandem.frontend.args import frontend_config_from_args
    from tandem.frontend.serve import serve_frontend
    from tandem.runtime.config import RuntimeConfig
    from tandem.runtime.lifecycle import install_signal_handlers
    from tandem.runtime.runtime import open_runtime

    if not args.run_dir:
        remove_stale_run_dirs()  # left by a stack that was killed before it could clean up
    run_dir = args.run_dir or make_run_dir()
    logger.info("run directory %s", run_dir)
    runtime_config = RuntimeConfig(
        namespace=args.namespace,
        discovery="file",
        discovery_dir=os.path.join(run_dir, "discovery"),
        events="zmq",
        cluster_secret=_cluster_secret(run_dir, args.secret_flags),
    )
    try:
        frontend_config = frontend_config_from_args(args)
    except ValueError as exc:
        raise StartupError(f"bad configuration: {exc}") from exc
    passthrough = [*_worker_config_flags(args, run_dir), *passthrough]
    stop = asyncio.Event()
    install_signal_handlers(stop)
    if args.frontend_replica:
        async with open_runtime(runtime_config) as runtime:
            await serve_frontend(frontend_config, runtime, stop=stop)
        return 0
    if args.planner:
        return await serve_with_planner(
            args, passthrough, runtime_config, frontend_config, stop, run_dir
        )
    group = WorkerGroup(
        runtime_config,
        worker_specs(args, passthrough),
        run_dir=None if args.run_dir else run_dir,
    )
    replicas: WorkerGroup | None = None
    try:
        async with open_runtime(runtime_config) as runtime:
            listening, bound = asyncio.Event(), []  # type: ignore[var-annotated]
            frontend = asyncio.create_task(
                serve_frontend(frontend_config, runtime, stop=stop, ready=listening, bound=bound),
                name="frontend",
            )
            try:
                # the HTTP port first: a busy port stops the stack before any worker starts (a
                # port shared by several frontends is bound once a model is ready: workers first)
                if not frontend_config.http.reuse_port:
                    await _wait_listening(listening, frontend, args.worker_ready_timeout_s)
                await group.start()
                failure = await group.wait_ready(runtime, args.worker_ready_timeout_s, stop)
                if failure is not None:
                    raise StartupError(failure)
                if stop.is_set():
                    return 0
                if args.frontend_processes > 1:
                    await _wait_listening(listening, frontend, args.worker_ready_timeout_s)
                    replicas = WorkerGroup(
                        runtime_config, replica_specs(args, run_dir, bound[0][1]),
                        run_dir=None if args.run_dir else run_dir,
                    )  # fmt: skip
                    await replicas.start()
                await _wait_listening(listening, frontend, args.worker_ready_timeout_s)
                await _wait_healthy(bound[0], frontend, args.worker_ready_timeout_s, stop)
                if stop.is_set():
                    return 0
                logger.info(
                    "tandem serve ready: %d %s worker(s) on http://%s:%d",
                    len(group.specs),
                    args.engine,
                    args.host,
                    args.port,
                )
                await group.watch(stop)
            finally:
                stop.set()
                await frontend
    finally:
        if replicas is not None:
            await replicas.stop()
        await group.stop()
        if not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def replica_specs(args: argparse.Namespace, run_dir: str, port: int) -> list[WorkerSpec]:
    """Frontend processes 2..N: `tandem serve` in replica mode with the same flags, the stack's
    run directory (discovery, events, secret) and the port the first frontend bound."""
    argv = ["serve", *args.argv, "--run-dir", run_dir, "--port", str(port), "--frontend-replica",
            "--http-reuse-port", "--router-replica-sync"]  # fmt: skip
    return [
        WorkerSpec(name=f"frontend{i}", argv=list(argv), command="serve")
        for i in range(1, args.frontend_processes)
    ]


async def _wait_listening(
    listening: asyncio.Event, frontend: asyncio.Task[None], timeout_s: float
) -> None:
    """Until the first frontend listens; raises what it raised if it ended first."""
    waiter = asyncio.ensure_future(listening.wait())
    done, _ = await asyncio.wait(
        {waiter, frontend}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
    )
    waiter.cancel()
    if frontend in done:
        frontend.result()  # its StartupError (port in use)
        raise StartupError("frontend stopped before listening")
    if not done:
        raise StartupError(f"frontend not listening within {timeout_s:.0f} s")


async def _wait_healthy(
    address: tuple[str, int], frontend: asyncio.Task[None], timeout_s: float, stop: asyncio.Event
) -> None:
    """Until the frontend's own /health says every model can serve (its tokenizer loaded, its
    topology complete: the workers being registered is not enough), so "ready" is true."""
    host, port = address
    host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    body = b""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not stop.is_set() and not frontend.done():
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            async with asyncio.timeout(5.0):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: serve\r\nConnection: close\r\n\r\n")
                reply = await reader.read()
                writer.close()
                head, _, body = reply.partition(b"\r\n\r\n")
                if head.startswith(b"HTTP/1.1 200"):
                    return
        if loop.time() > deadline:
            raise StartupError(
                f"workers registered but the frontend is not ready within {timeout_s:.0f} s: "
                f"/health says {body[:300].decode(errors='replace')}"
            )
        await asyncio.sleep(0.05)
    if frontend.done():
        frontend.result()
        raise StartupError("frontend stopped before it was ready")


def _worker_config_flags(args: argparse.Namespace, run_dir: str) -> list[str]:
    """`--config FILE` for the workers when serve reads a config file: its `worker:` section
    alone (its top-level keys are serve's flags, unknown to a worker; the flag also shadows an
    inherited TANDEM_CONFIG). Encode workers get an empty one (`args.encoder_config_flags`)."""
    import yaml

    from tandem.runtime.flag_parser import CONFIG_ENV, config_section

    args.encoder_config_flags = []
    path = args.config or os.environ.get(CONFIG_ENV)
    if not path:
        return []
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    worker_path = os.path.join(run_dir, "worker-config.yaml")
    encoder_path = os.path.join(run_dir, "encoder-config.yaml")
    with open(worker_path, "w", encoding="utf-8") as f:
        yaml.safe_dump({"worker": config_section(path, "worker")}, f)
    with open(encoder_path, "w", encoding="utf-8") as f:
        yaml.safe_dump({}, f)
    args.encoder_config_flags = ["--config", encoder_path]
    return ["--config", worker_path]


SECRET_FLAGS = ("--cluster-secret", "--cluster-secret-file")


def take_secret_flags(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """`argv` without `--cluster-secret[=]S` and `--cluster-secret-file[=]P`, and their values
    by flag: serve resolves the secret once for the whole stack rather than pass the flags
    on to workers (which would also inherit serve's secret file, two sources at once)."""
    rest: list[str] = []
    found: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in SECRET_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"tandem serve: {name} expects a value")
                value, i = argv[i + 1], i + 1
            if name in found:
                raise SystemExit(f"tandem serve: {name} is given twice")
            found[name] = value
        else:
            rest.append(arg)
        i += 1
    return rest, found


def _cluster_secret(run_dir: str, flags: dict[str, str] | None = None) -> str:
    """The stack's cluster secret, for serve's frontend and every process it starts:
    `--cluster-secret` / `--cluster-secret-file`, else TANDEM_CLUSTER_SECRET(_FILE), else a
    fresh one. Unless it came from TANDEM_CLUSTER_SECRET(_FILE) (which the workers inherit),
    it is written to a 0600 file of the run dir that the workers are pointed at."""
    from tandem.runtime.args import resolve_cluster_secret
    from tandem.runtime.secret import check_secret, generate_secret, write_secret_file

    flags = flags or {}
    try:
        given = resolve_cluster_secret(
            flags.get("--cluster-secret"), flags.get("--cluster-secret-file"), os.environ
        )
        if given is not None:
            check_secret(given)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    if given is not None and not flags:
        return given
    secret, path = given or generate_secret(), os.path.join(run_dir, "cluster-secret")
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by an earlier stack in the same --run-dir
    write_secret_file(path, secret)
    os.environ.pop("TANDEM_CLUSTER_SECRET", None)  # one source for the workers: the file
    os.environ["TANDEM_CLUSTER_SECRET_FILE"] = path  # inherited by the worker processes
    return secret


async def serve_with_planner(
    args: argparse.Namespace,
    passthrough: list[str],
    runtime_config: object,
    frontend_config: FrontendConfig,
    stop: asyncio.Event,
    run_dir: str,
) -> int:
    """The frontend plus an embedded planner whose local connector owns every worker."""
    import shlex

    from tandem.frontend.serve import serve_frontend
    from tandem.planner.main import run_planner
    from tandem.runtime.runtime import open_runtime

    if not args.pools:
        from tandem.planner.config import PoolConfig

        args.pools = [PoolConfig(min_workers=args.workers, max_workers=max(args.workers, 8))]
    args.connector = "local"
    args.worker_args = shlex.join(["--engine", args.engine, *_observability_argv(args),
                                   *passthrough])  # fmt: skip
    # the workers' own --drain-grace-s variable (they inherit it); 60 s unless set
    args.worker_drain_grace_s = float(os.environ.get("TANDEM_DRAIN_GRACE_S") or 60)
    args.worker_log_dir = None
    args.worker_guard_run_dir = run_dir  # the workers die with serve, as without --planner
    try:
        async with open_runtime(runtime_config) as runtime:  # type: ignore[arg-type]
            listening = asyncio.Event()
            frontend = asyncio.create_task(
                serve_frontend(frontend_config, runtime, stop=stop, ready=listening),
                name="frontend",
            )
            # the HTTP port first: a busy port stops the stack before the planner starts workers
            await _wait_listening(listening, frontend, args.worker_ready_timeout_s)
            planner = asyncio.create_task(run_planner(args, runtime, stop), name="planner")
            try:
                await frontend
            finally:
                stop.set()
                await planner
    finally:
        if not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = original = list(sys.argv[1:] if argv is None else argv)
    argv, args_secret = take_secret_flags(argv)  # replicas get the secret as the workers do
    args, passthrough = parse_known_args(build_parser(), argv)
    args.argv = argv  # frontend replicas get the same command line
    args.secret_flags = args_secret
    _validate(args)
    if any(a == "--system-port" or a.startswith("--system-port=") for a in passthrough):
        # every worker would get the same port; serve's are scraped through the frontend
        raise SystemExit(
            "tandem serve: --system-port is a per-worker flag and serve's workers would all "
            "bind it; scrape them through the frontend at /metrics/workers instead"
        )
    if args.engine == "vllm":
        from tandem.engines.vllm.venv import reexec_in_vllm_venv

        reexec_in_vllm_venv(["serve", *original])
    configure_logging(args.log_level, args.log_format)
    configure_tracing(args)
    with contextlib.suppress(KeyboardInterrupt):
        return run_async(serve(args, passthrough))
    return 130
