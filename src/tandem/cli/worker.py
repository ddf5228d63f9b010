"""`tandem worker --engine mocker [engine flags] [runtime flags]`: one worker process.

`--engine` is read first (flag, then TANDEM_ENGINE, then the config file, default mocker) so
that engine's own flags can be declared. Runs until SIGTERM/SIGINT, then unregisters and
drains (DESIGN.md §1).
If the engine dies, the worker leaves discovery and the process exits with status 1
(`EXIT_ENGINE_FAILED`) so that its supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
from typing import Any

from tandem.disagg.args import add_disagg_worker_args, disagg_worker_config_from_args
from tandem.engines.base import (
    Engine,
    add_engine_args,
    engine_config_from_args,
    engine_names,
    make_engine,
)
from tandem.engines.worker import Worker, WorkerConfig
from tandem.errors import ConfigError, StartupError
from tandem.multimodal.provider_args import add_embedding_provider_args, attach_embedding_provider
from tandem.multimodal.remote_provider import CachingEmbeddingProvider
from tandem.protocols.discovery import REASONING_PARSERS, TOOL_CALL_PARSERS
from tandem.runtime.address import is_local_address, resolve_addresses
from tandem.runtime.args import add_runtime_args, runtime_config_from_args
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.flag_parser import early_value, parse_args
from tandem.runtime.lifecycle import install_signal_handlers
from tandem.runtime.process_setup import (
    add_log_format_arg,
    add_tracing_args,
    configure_logging,
    configure_tracing,
    run_async,
)
from tandem.runtime.runtime import Runtime, open_runtime
from tandem.runtime.system_server import SystemServer
from tandem.runtime.tls import TlsFiles

logger = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 1


def _engine_from_argv(argv: list[str], command: str = "worker") -> str:
    try:
        return early_value(argv, "--engine", command, "mocker", os.environ)
    except ConfigError as exc:
        raise SystemExit(f"tandem {command}: error: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> None:
    """Worker, engine (the one `--engine` in `argv` names) and runtime flags."""
    engine = _engine_from_argv(sys.argv[1:] if argv is None else argv)
    if engine not in engine_names():
        parser.error(f"unknown engine '{engine}'; expected one of: {', '.join(engine_names())}")
    group = parser.add_argument_group("worker")
    group.add_argument("--engine", default=engine, help=f"one of: {', '.join(engine_names())}")
    group.add_argument(
        "--component",
        default="",
        help="component name in namespace.component.endpoint (empty: 'prefill' with "
        "--disagg-mode prefill, else 'backend')",
    )
    group.add_argument(
        "--endpoint",
        default="",
        help="endpoint served (empty: 'encode' for --engine encoder, else 'generate')",
    )
    group.add_argument(
        "--instance-id",
        default="",
        help="instance id to register under (empty: a fresh random id; a planner's "
        "connector names its workers up front)",
    )
    group.add_argument(
        "--drain-grace-s",
        type=float,
        default=10.0,
        help="seconds in-flight requests may finish after SIGTERM",
    )
    group.add_argument(
        "--embedding-only",
        action="store_true",
        help="serve only /v1/embeddings, /v1/rerank and /v1/score (the `embed` endpoint; "
        "generation requests go to other workers, or get a 400 naming the model); native and "
        "mocker engines",
    )
    group.add_argument(
        "--system-port",
        type=int,
        default=0,
        help="serve /metrics, /health and /live over HTTP on this port (0: off; the frontend "
        "still reaches the metrics over the request plane at /metrics/workers)",
    )
    group.add_argument(
        "--system-host",
        default=None,
        help="bind address of --system-port (default: the request plane's bind address, so "
        "a worker on another host than etcd/NATS serves it on its routable address)",
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="how the frontend reads this model's tool calls (hermes <tool_call>, llama3_json, "
        "mistral [TOOL_CALLS], pythonic [f(x=1)], qwen3_coder <function=...>); default: from "
        "the chat template where its markup is unambiguous, else hermes",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="move the model's <think>...</think> into reasoning_content: deepseek_r1 (output "
        "starts inside reasoning) or qwen3 (where <think> opens it, in the output or at the "
        "prompt's end); default: qwen3 if the chat template writes <think>, else none",
    )
    group.add_argument("--log-level", default="INFO", help="logging level")
    add_log_format_arg(group)
    add_tracing_args(group, "tandem-worker")
    group.add_argument(
        "--transfer-host",
        default=None,
        help="address the KV / image-embedding transfer agent of a prefill, decode or encode "
        "worker listens on and peers dial (default: --host, the request-plane address; "
        "set both to the pod/host IP for workers on different hosts)",
    )
    group.add_argument(
        "--transfer-port",
        type=int,
        default=0,
        help="port of that transfer agent (0: any free port; pin it to open it in a firewall)",
    )
    add_engine_args(engine, parser)
    add_disagg_worker_args(parser)
    if engine != "encoder":
        add_embedding_provider_args(parser)
    add_runtime_args(parser)


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    if args.engine == "encoder":
        component, endpoint = args.component or "encoder", args.endpoint or "encode"
    else:
        component = args.component or ("prefill" if args.disagg_mode == "prefill" else "backend")
        endpoint = args.endpoint or "generate"
    ids = {"instance_id": args.instance_id} if args.instance_id else {}
    return WorkerConfig(
        component=component,
        endpoint=endpoint,
        drain_grace_s=args.drain_grace_s,
        embedding_only=args.embedding_only,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        **ids,
    )


def build_engine(
    args: argparse.Namespace,
    cluster_secret: str | None = None,
    tls: TlsFiles | None = None,
    *,
    transfer_host: str | None = None,
) -> Engine:
    """The engine `--engine` names, wrapped for its `--disagg-mode` role if any (its transfer
    agent authenticates peers with `cluster_secret`, over TLS with `tls`, and listens on
    `--transfer-host`, else `transfer_host`: the runtime's advertised address)."""
    args.transfer_host = (
        args.transfer_host or transfer_host or getattr(args, "runtime_host", None) or "127.0.0.1"
    )
    disagg = disagg_worker_config_from_args(args)
    if disagg.kv_fetch and args.engine not in ("mocker", "native", "vllm"):
        raise ValueError(f"--kv-fetch needs --engine mocker, native or vllm, not '{args.engine}'")
    engine = make_engine(args.engine, engine_config_from_args(args.engine, args))
    if args.engine == "encoder":  # its embedding transfer agent authenticates its peers
        from tandem.multimodal.encode_engine import EncoderEngine

        assert isinstance(engine, EncoderEngine)
        engine.cluster_secret, engine.tls = cluster_secret, tls
    # vLLM hands KV over (disaggregation, peer fetch) with its own NixlConnector
    if not disagg.enabled or args.engine == "vllm":
        return engine
    from tandem.disagg.worker_engine import DisaggEngine

    return DisaggEngine(engine, disagg, cluster_secret=cluster_secret, tls=tls)


async def _attach_images(
    engine: Engine, runtime: Runtime, args: argparse.Namespace
) -> CachingEmbeddingProvider | None:
    """Give the engine its image embedding path (None: it takes no images)."""
    if args.engine == "encoder":
        return None
    return await attach_embedding_provider(engine, runtime, args)


def _transfer_host(config: RuntimeConfig) -> str:
    """The transfer agent listens on the advertised address (it advertises where it listens),
    or on the bound one where the advertised address is not of this machine (NAT)."""
    if is_local_address(config.advertise_host):
        return config.advertise_host
    return config.host


async def serve(args: argparse.Namespace, stop: asyncio.Event | None = None) -> int:
    """Run one worker until `stop` is set (default: SIGTERM/SIGINT), then drain; returns
    the exit status: 0, or EXIT_ENGINE_FAILED when the engine died first."""
    try:
        # bind and advertised addresses decided here, so the transfer agent listens where
        # peers dial (a loopback address while etcd/NATS are on another host is refused)
        runtime_config = resolve_addresses(runtime_config_from_args(args))
        worker_config = worker_config_from_args(args)
        args.system_host = args.system_host or runtime_config.host
        engine = build_engine(
            args,
            runtime_config.cluster_secret,
            runtime_config.tls,
            transfer_host=_transfer_host(runtime_config),
        )
    except (ValueError, OSError) as exc:
        raise StartupError(f"bad configuration: {exc}") from exc
    if stop is None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
    async with contextlib.AsyncExitStack() as resources:
        try:
            runtime = await resources.enter_async_context(open_runtime(runtime_config))
        except (OSError, ValueError) as exc:  # a bind address not of this host, etcd down...
            raise StartupError(f"cannot open the runtime: {exc}") from exc
        worker: Worker | None = None
        system: SystemServer | None = None
        try:
            provider = await _attach_images(engine, runtime, args)
            # a worker that can only encode remotely needs encode workers (E/PD), which the
            # frontend's /health then checks
            remote_only = provider is not None and provider.local is None
            metadata: dict[str, Any] = {"needs_encoder": True} if remote_only else {}
            worker = Worker(engine, runtime, dataclasses.replace(worker_config, metadata=metadata))
            if provider is not None:
                worker.metrics.add_source(provider.families)  # the embedding cache's
            system = await _start_system_server(worker, args)
            instance = await worker.start()
        except Exception as exc:  # the start boundary: whatever stops it is the one line
            logger.debug("worker start failed", exc_info=True)
            if worker is not None:
                with contextlib.suppress(Exception):
                    await worker.stop(0)
            await runtime.shutdown(grace_s=0)
            if system is not None:
                await system.close()
            if isinstance(exc, StartupError):
                raise
            reason = str(exc) or type(exc).__name__
            raise StartupError(f"{args.engine} worker could not start: {reason}") from exc
        logger.info(
            "worker ready: instance_id=%s address=%s endpoint=%s engine=%s model=%s",
            instance.instance_id,
            instance.address,
            instance.path,
            args.engine,
            instance.model.name if instance.model else None,
        )
        stopped = asyncio.ensure_future(stop.wait())
        failed = asyncio.ensure_future(worker.failed.wait())
        await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
        for waiter in (stopped, failed):
            waiter.cancel()
        await worker.stop(worker_config.drain_grace_s)
        await runtime.shutdown(grace_s=0)
        if system is not None:
            await system.close()
    if worker.failure is not None:
        logger.error("worker exits with status %d: %s", EXIT_ENGINE_FAILED, worker.failure)
        return EXIT_ENGINE_FAILED
    return 0


async def _start_system_server(worker: Worker, args: argparse.Namespace) -> SystemServer | None:
    """With --system-port: /metrics, /health, /live on it, up before the engine loads (so
    /live answers and /health says "starting" meanwhile); the port goes in the worker's
    discovery record."""
    if not args.system_port:
        return None
    if not 0 < args.system_port < 65536:
        raise StartupError(f"--system-port={args.system_port}; expected 1..65535 or 0 (off)")
    server = SystemServer(metrics=worker.metrics.render, health=worker.health)
    try:
        _, worker.system_port = await server.start(args.system_host, args.system_port)
    except OSError as exc:
        where = f"http://{args.system_host}:{args.system_port}"
        raise StartupError(
            f"cannot listen on --system-port {where}: {exc.strerror or exc}"
        ) from exc
    return server


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    configure_tracing(args)
    return int(run_async(serve(args)))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _engine_from_argv(argv) == "vllm":
        from tandem.engines.vllm.venv import reexec_in_vllm_venv

        reexec_in_vllm_venv(["worker", *argv])  # vLLM lives in its own venv
    parser = argparse.ArgumentParser(
        prog="tandem worker", description="a worker hosting one engine"
    )
    add_arguments(parser, argv)
    return run(parse_args(parser, argv))
