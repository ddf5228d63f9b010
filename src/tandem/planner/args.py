"""Planner flags (`tandem planner`, `tandem serve --planner`), `TANDEM_PLANNER_*` env fallbacks."""

from __future__ import annotations

import argparse
import os
import shlex

from tandem.planner.config import MODES, PlannerConfig, PoolConfig
from tandem.planner.connector.base import connector_names
from tandem.planner.predictor import PREDICTORS


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TANDEM_PLANNER_{name}") or default


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
        default=_env("MODE", "load"),
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
    g.add_argument("--ttft-target-ms", type=float, default=float(_env("TTFT_TARGET_MS", "500")))
    g.add_argument("--itl-target-ms", type=float, default=float(_env("ITL_TARGET_MS", "50")))
    g.add_argument("--interval-s", type=float, default=float(_env("INTERVAL_S", "2")),
                   help="seconds between decisions")  # fmt: skip
    g.add_argument("--cooldown-up-s", type=float, default=float(_env("COOLDOWN_UP_S", "5")))
    g.add_argument("--cooldown-down-s", type=float, default=float(_env("COOLDOWN_DOWN_S", "15")))
    g.add_argument("--ready-timeout-s", type=float, default=float(_env("READY_TIMEOUT_S", "60")),
                   help="a new worker not ready by then is given up on")  # fmt: skip
    g.add_argument("--drain-timeout-s", type=float, default=float(_env("DRAIN_TIMEOUT_S", "120")))
    g.add_argument("--scale-down-margin", type=float, default=float(_env("MARGIN", "0.7")),
                   help="survivors must stay under target × this to scale down")  # fmt: skip
    g.add_argument("--max-total-workers", type=int, default=int(_env("MAX_TOTAL_WORKERS", "0")),
                   help="budget over all pools (0 = the sum of their max)")  # fmt: skip
    g.add_argument("--predictor", default=_env("PREDICTOR", "holt"), choices=PREDICTORS)
    g.add_argument("--profile", default=os.environ.get("TANDEM_PLANNER_PROFILE"),
                   help="engine profile JSON from `tandem profile` (throughput mode)")  # fmt: skip
    if not with_connector:
        return
    choices = [n for n in connector_names() if n != "inprocess"]  # in-process: tests only
    g.add_argument("--connector", default=_env("CONNECTOR", "local"), choices=choices)
    g.add_argument(
        "--worker-args",
        default=_env("WORKER_ARGS", "--engine mocker"),
        help="flags of every worker the connector starts (one shell-quoted string)",
    )
    g.add_argument("--worker-drain-grace-s", type=float,
                   default=float(_env("WORKER_DRAIN_GRACE_S", "60")),
                   help="how long a drained worker may finish its in-flight requests")  # fmt: skip
    g.add_argument("--worker-log-dir", default=os.environ.get("TANDEM_PLANNER_WORKER_LOG_DIR"))


def planner_config_from_args(ns: argparse.Namespace) -> PlannerConfig:
    return PlannerConfig(
        mode=ns.mode,
        pools=tuple(ns.pools or (PoolConfig(),)),
        ttft_target_ms=ns.ttft_target_ms,
        itl_target_ms=ns.itl_target_ms,
        interval_s=ns.interval_s,
        cooldown_up_s=ns.cooldown_up_s,
        cooldown_down_s=ns.cooldown_down_s,
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
