"""`tandem worker` wiring in-process: flags → engine + runtime (file discovery) → serve → stop."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import pytest

from tandem.cli import worker as worker_cli
from tandem.protocols.engine import PreprocessedRequest, StopConditions, decode_output, encode
from tandem.runtime.discovery.file import FileDiscovery
from tandem.runtime.tcp import TcpRequestClient

pytestmark = pytest.mark.timeout(20)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser, argv)
    return parser.parse_args(argv)


def test_engine_flag_is_read_first_and_unknown_engines_fail(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parse(["--engine", "mocker", "--speedup-ratio", "0", "--num-blocks", "32"])
    assert (args.engine, args.speedup_ratio, args.num_blocks) == ("mocker", 0.0, 32)
    with pytest.raises(SystemExit):
        _parse(["--engine", "warp"])
    expected = "unknown engine 'warp'; expected one of: encoder, mocker, native"
    assert expected in capsys.readouterr().err


async def test_serves_on_file_discovery_until_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tandem.cli.worker")
    args = _parse(
        [
            *("--discovery", "file", "--discovery-dir", str(tmp_path), "--namespace", "cli"),
            *("--speedup-ratio", "0", "--tokenizer", "none", "--drain-grace-s", "1"),
        ]
    )
    stop = asyncio.Event()
    serving = asyncio.create_task(worker_cli.serve(args, stop))
    disc = FileDiscovery(str(tmp_path), ttl_s=2.0, poll_interval_s=0.05)
    client = TcpRequestClient()
    try:
        watch = disc.watch("cli.backend.generate")
        event = await asyncio.wait_for(anext(watch), 10)
        assert event.kind == "added"
        inst = event.instance
        assert f"instance_id={inst.instance_id}" in caplog.text and inst.address in caplog.text
        req = PreprocessedRequest(
            request_id="r", model="smollm2", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=4)
        )
        stream = client.stream(inst.address, inst.path, encode(req), request_id="r")
        outs = [decode_output(p) async for p in stream]
        assert sum(len(o.token_ids) for o in outs) == 4 and outs[-1].finish_reason == "length"
        stop.set()
        await asyncio.wait_for(serving, 10)
        assert await disc.list_instances("cli.") == []
    finally:
        stop.set()
        await client.close()
        await disc.close()
        if not serving.done():
            serving.cancel()
