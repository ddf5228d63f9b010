"""Planner flags (`tandem planner`, `tandem serve --planner`); env and config-file values:
`tandem.runtime.flag_parser` (the old TANDEM_PLANNER_* names are deprecated aliases there)."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping

from tandem.config_check import check_range
from tandem.errors import ConfigError
from tandem.planner.config import MODES, PlannerConfig, PoolConfig
from tandem.planner.connector.base import connector_names
from tandem.planner.predictor import PREDICTORS


def parse_pool(text: str) -> PoolConfig:
    """`COMPONENT[:KIND[:MIN[:MAX]]]`, e.g. `backend:aggregated:1:8`, `prefill:prefill:1:4`."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 4 or not parts[0]:
        raise argparse.ArgumentTypeError(
            f"--pool {text!r}: expected COMPONENT[:KIND[:MIN[:MAX]]], e.g. backend:aggregated:1:8"
        )
    try:
        return PoolConfig(
            component=parts[0],
            kind=parts[1] if len(parts) > 1 else "aggregated",
            min_workers=int(parts[2]) if len(parts) > 2 else 1,
            max_workers=int(parts[3]) if len(parts) > 3 else 8,
        )
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--pool {text!r}: {exc}") from None


def add_planner_args(parser: argparse.ArgumentParser, *, with_connector: bool = True) -> None:
    g = parser.add_argument_group("planner")
    g.add_argument(
        "--mode",
        default="load",
        choices=MODES,
        help="load: step-time regression; throughput: forecast × engine profile",
    )
    g.add_argument(
        "--pool",
        action="append",
        type=parse_pool,
        dest="pools",
        metavar="SPEC",
        help="COMPONENT[:KIND[:MIN[:MAX]]] (repeatable; default backend:aggregated:1:8)",
    )
    g.add_argument("--ttft-target-ms", type=float, default=500.0, help="TTFT target")
    g.add_argument("--itl-target-ms", type=float, default=50.0, help="ITL target")
    g.add_argument("--interval-s", type=float, default=2.0,
                   help="seconds between decisions")  # fmt: skip
    g.add_argument("--cooldown-up-s", type=float, default=5.0,
                   help="no new scale-up this long after one")  # fmt: skip
    g.add_argument("--cooldown-down-s", type=float, default=15.0,
                   help="no new scale-down this long after a change")  # fmt: skip
    g.add_argument("--scale-down-stable-s", type=float, default=5.0,
                   help="scale down only after every decision this long said so")  # fmt: skip
    g.add_argument("--ready-timeout-s", type=float, default=60.0,
                   help="a new worker not ready by then is given up on")  # fmt: skip
    g.add_argument("--drain-timeout-s", type=float, default=120.0,
                   help="a draining worker still listed after this is counted stuck")  # fmt: skip
    g.add_argument("--scale-down-margin", type=float, default=0.7,
                   help="survivors must stay under target × this to scale down")  # fmt: skip
    g.add_argument("--max-total-workers", type=int, default=0,
                   help="budget over all pools (0 = the sum of their max)")  # fmt: skip
    g.add_argument("--predictor", default="holt", choices=PREDICTORS,
                   help="load forecaster (throughput mode)")  # fmt: skip
    g.add_argument("--profile", default=None,
                   help="engine profile JSON from `tandem profile` (throughput mode)")  # fmt: skip
    if not with_connector:
        return
    choices = [n for n in connector_names() if n != "inprocess"]  # in-process: tests only
    g.add_argument("--connector", default="local", choices=choices,
                   help="how workers are started and stopped")  # fmt: skip
    g.add_argument(
        "--worker-args",
        default="--engine mocker",
        help="flags of every worker the connector starts (one shell-quoted string)",
    )
    g.add_argument("--worker-drain-grace-s", type=float,
                   default=60.0,
                   help="how long a drained worker may finish its in-flight requests")  # fmt: skip
    g.add_argument("--worker-log-dir", default=None,
                   help="directory for the started workers' logs, worker-<id>.log (none: this "
                   "output); with --connector ray, on the node that runs each worker")  # fmt: skip
    ray = parser.add_argument_group("ray connector")
    ray.add_argument("--ray-address", default=None,
                     help="join this Ray cluster (e.g. 10.0.0.5:6379 on a node of it, or "
                     "ray://head:10001 from outside; RAY_ADDRESS below TANDEM_RAY_ADDRESS); "
                     "none: start a private one-node head on 127.0.0.1")  # fmt: skip
    ray.add_argument("--ray-worker-cpus", type=float, default=0.0,
                     help="CPUs each worker actor reserves on its node (0: not capped by the "
                     "nodes' CPUs, e.g. a mocker fleet)")  # fmt: skip
    ray.add_argument("--ray-worker-gpus", type=float, default=0.0,
                     help="GPUs each worker actor reserves (Ray sets its "
                     "CUDA_VISIBLE_DEVICES)")  # fmt: skip
    ray.add_argument("--ray-placement", default="spread", choices=RAY_PLACEMENTS,
                     help="spread: worker actors across the cluster's nodes; pack: Ray's "
                     "default (fill a node first)")  # fmt: skip


RAY_PLACEMENTS = ("spread", "pack")


def ray_options(ns: argparse.Namespace, env: Mapping[str, str]) -> dict[str, object]:
    """The Ray connector's options from the flags (`RAY_ADDRESS` in `env` when no
    --ray-address); a ray flag with another connector is an error, not ignored."""
    given = [f"--ray-{n.replace('_', '-')}" for n in ("address", "worker_cpus", "worker_gpus")
             if getattr(ns, f"ray_{n}", None) not in (None, 0.0)]  # fmt: skip
    if getattr(ns, "ray_placement", "spread") != "spread":
        given.append("--ray-placement")
    if getattr(ns, "connector", "local") != "ray":
        if given:
            raise ConfigError(f"{', '.join(given)} given without --connector ray (ray flags "
                              "apply only to it)")  # fmt: skip
        return {}
    check_range("ray_worker_cpus", ns.ray_worker_cpus, low=0)
    check_range("ray_worker_gpus", ns.ray_worker_gpus, low=0)
    return {
        "address": ns.ray_address or env.get("RAY_ADDRESS") or None,
        "num_cpus": ns.ray_worker_cpus,
        "num_gpus": ns.ray_worker_gpus,
        "spread": ns.ray_placement == "spread",
    }


def planner_config_from_args(ns: argparse.Namespace) -> PlannerConfig:
    return PlannerConfig(
        mode=ns.mode,
        pools=tuple(ns.pools or (PoolConfig(),)),
        ttft_target_ms=ns.ttft_target_ms,
        itl_target_ms=ns.itl_target_ms,
        interval_s=ns.interval_s,
        cooldown_up_s=ns.cooldown_up_s,
        cooldown_down_s=ns.cooldown_down_s,
        scale_down_stable_s=ns.scale_down_stable_s,
        ready_timeout_s=ns.ready_timeout_s,
        drain_timeout_s=ns.drain_timeout_s,
        scale_down_margin=ns.scale_down_margin,
        max_total_workers=ns.max_total_workers,
        predictor=ns.predictor,
        profile_path=ns.profile,
    )


def worker_argv(config: PlannerConfig, worker_args: str) -> dict[str, list[str]]:
    """Each pool's worker flags: the shared ones, plus the disaggregation role of prefill and
    decode pools."""
    shared = shlex.split(worker_args)
    roles = {"prefill": ["--disagg-mode", "prefill"], "decode": ["--disagg-mode", "decode"]}
    return {p.component: [*shared, *roles.get(p.kind, [])] for p in config.pools}
