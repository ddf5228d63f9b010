"""`tandem profile --engine mocker|native|vllm [engine flags] --output FILE`: measure an engine
over a grid of ISL (prefill: TTFT) and batch × context (decode: ITL) and write the profile JSON
the planner's throughput mode and the mocker's `--perf-profile` read (tandem.engines.profile).
`--engine vllm` re-executes in the vLLM virtualenv (.venv-vllm), as `tandem serve` does."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if len(values) < 2 or sorted(set(values)) != values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected >= 2 increasing positive integers")
    return values


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from tandem.cli.worker import _engine_from_argv
    from tandem.engines.base import add_engine_args, engine_names

    engine = _engine_from_argv(argv, "profile")
    parser = argparse.ArgumentParser(prog="tandem profile", description=__doc__)
    if engine not in engine_names():
        parser.error(f"unknown engine '{engine}'; expected one of: {', '.join(engine_names())}")
    g = parser.add_argument_group("profile")
    g.add_argument("--engine", default=engine, help=f"one of: {', '.join(engine_names())}")
    g.add_argument("--output", "-o", required=True, help="profile JSON to write")
    g.add_argument("--isl", type=_ints, default=_ints("128,512,1024,2048,4096"),
                   help="prompt lengths of the prefill curve")  # fmt: skip
    g.add_argument("--batch", type=_ints, default=_ints("1,4,16,64"),
                   help="decode batch sizes")  # fmt: skip
    g.add_argument("--context", type=_ints, default=_ints("128,512,2048"),
                   help="decode context lengths (tokens per sequence)")  # fmt: skip
    g.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per point")
    g.add_argument("--repeats", type=int, default=2, help="measurements per point (median)")
    g.add_argument("--log-level", default="INFO", help="logging level")
    add_engine_args(engine, parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tandem.engines.base import engine_config_from_args, make_engine
    from tandem.engines.profile import ProfileFile
    from tandem.planner.profiler import profile_engine
    from tandem.runtime.flag_parser import parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    from tandem.cli.worker import _engine_from_argv

    if _engine_from_argv(argv, "profile") == "vllm":
        from tandem.engines.vllm.venv import reexec_in_vllm_venv

        reexec_in_vllm_venv(["profile", *argv])  # vLLM lives in its own venv, as for serve
    args = parse_args(build_parser(argv), argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    engine = make_engine(args.engine, engine_config_from_args(args.engine, args))
    try:
        profile = asyncio.run(
            profile_engine(
                engine,
                engine_name=args.engine,
                isls=args.isl,
                batches=args.batch,
                contexts=args.context,
                decode_steps=args.decode_steps,
                repeats=args.repeats,
            )
        )
    except ValueError as exc:
        raise SystemExit(f"tandem profile: {exc}") from None
    ProfileFile(Path(args.output)).write(profile)
    print(f"wrote {args.output}: prefill {len(args.isl)} points, decode "
          f"{len(args.batch)}x{len(args.context)} points")  # fmt: skip
    return 0
