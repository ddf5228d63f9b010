"""Units of tandem.disagg: params round trip, config validation, flags, the block guard,
and `tandem serve`'s disaggregated worker specs."""

from __future__ import annotations

import argparse
import threading

import pytest

from tandem.cli.serve import _validate, build_parser, worker_specs
from tandem.disagg.args import (
    add_disagg_route_args,
    add_disagg_worker_args,
    disagg_route_config_from_args,
    disagg_worker_config_from_args,
)
from tandem.disagg.config import DisaggRouteConfig, DisaggWorkerConfig
from tandem.disagg.guard import BlockGuard
from tandem.disagg.params import DisaggParams
from tandem.disagg.prefill import finishes_at_first
from tandem.errors import InvalidRequest
from tandem.protocols.engine import PreprocessedRequest, StopConditions, decode_request, encode


def test_params_survive_the_request_plane() -> None:
    p = DisaggParams(mode="push", op_id="o", address=("127.0.0.1", 5), meta=b"\x00\xff")
    req = PreprocessedRequest(
        request_id="r", model="m", token_ids=[1], stop=StopConditions(max_tokens=2),
        disagg_params=p.to_dict(),
    )  # fmt: skip
    back = decode_request(encode(req))
    assert DisaggParams.from_dict(back.disagg_params or {}) == p
    with pytest.raises(InvalidRequest, match="bad disagg_params"):
        DisaggParams.from_dict({"mode": "teleport"})


def test_configs_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown disagg mode 'both'; expected one of"):
        DisaggWorkerConfig(mode="both")
    with pytest.raises(ValueError, match="unknown transfer backend 'rdma'"):
        DisaggWorkerConfig(backends=("rdma",))
    with pytest.raises(ValueError, match="transfer_timeout_s=0"):
        DisaggWorkerConfig(transfer_timeout_s=0)
    with pytest.raises(ValueError, match="unknown disagg flow"):
        DisaggRouteConfig(flow="sideways")
    with pytest.raises(ValueError, match=r"min_uncached_ratio=1\.5"):
        DisaggRouteConfig(min_uncached_ratio=1.5)


def test_worker_flags() -> None:
    parser = argparse.ArgumentParser()
    add_disagg_worker_args(parser)
    ns = parser.parse_args(["--disagg-mode", "decode", "--disagg-transfer-backends", "tcp",
                            "--disagg-on-transfer-failure", "fail"])  # fmt: skip
    cfg = disagg_worker_config_from_args(ns)
    assert (cfg.mode, cfg.backends, cfg.on_transfer_failure) == ("decode", ("tcp",), "fail")


def test_route_flags_busy_prefill_queue() -> None:
    parser = argparse.ArgumentParser()
    add_disagg_route_args(parser)
    ns = parser.parse_args(["--disagg", "--disagg-max-prefill-queue", "4"])
    assert disagg_route_config_from_args(ns).max_prefill_queue == 4
    with pytest.raises(ValueError, match="max_prefill_queue=-1"):
        DisaggRouteConfig(max_prefill_queue=-1)


def test_first_token_can_end_the_request() -> None:
    def req(**stop: object) -> PreprocessedRequest:
        return PreprocessedRequest(request_id="r", model="m", token_ids=[1],
                                   stop=StopConditions(**{"max_tokens": 5, **stop}))  # type: ignore[arg-type]  # fmt: skip

    assert finishes_at_first(req(max_tokens=1), 7, [2]) == "length"
    assert finishes_at_first(req(), 2, [2]) == "stop"
    assert finishes_at_first(req(ignore_eos=True), 2, [2]) is None
    assert finishes_at_first(req(min_tokens=3), 2, [2]) is None
    assert finishes_at_first(req(stop_token_ids=[9]), 9, [2]) == "stop"


def test_block_guard_frees_once_after_the_transfer_thread() -> None:
    freed: list[int] = []
    guard = BlockGuard(lambda: freed.append(1))
    inside, release = threading.Event(), threading.Event()

    async def main() -> None:
        import asyncio

        task = asyncio.ensure_future(guard.run(lambda: (inside.set(), release.wait(5))))
        await asyncio.to_thread(inside.wait, 5)
        guard.give_up()
        assert freed == []  # the thread still touches the blocks
        release.set()
        await task
        guard.give_up()

    import asyncio

    asyncio.run(main())
    assert freed == [1]
    kept: list[int] = []
    g2 = BlockGuard(lambda: kept.append(1))
    g2.keep()
    g2.give_up()
    assert kept == []


def test_serve_builds_prefill_and_decode_specs() -> None:
    args, rest = build_parser().parse_known_args(
        ["--engine", "mocker", "--prefill-workers", "2", "--decode-workers", "1", "--x", "1"]
    )
    _validate(args)
    assert args.disagg
    specs = worker_specs(args, rest)
    assert [(s.name, s.component) for s in specs] == [
        ("prefill0", "prefill"), ("prefill1", "prefill"), ("decode0", "backend")]  # fmt: skip
    assert specs[0].argv[-2:] == ["--disagg-mode", "prefill"] and "--x" in specs[2].argv
    bad, _ = build_parser().parse_known_args(["--prefill-workers", "1"])
    with pytest.raises(SystemExit, match="needs --decode-workers"):
        _validate(bad)
