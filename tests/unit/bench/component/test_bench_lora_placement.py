"""`tandem bench lora-placement` on a small fleet, in simulated time: deterministic, and
tandem's placement loads fewer adapters than random routing with no request lost."""

from __future__ import annotations

import asyncio

import pytest

from tandem.bench.component.lora_placement import format_result, parse_args, run, workload
from tandem.bench.component.virtual_time import run_virtual

pytestmark = pytest.mark.timeout(120)

SMALL = ["--workers", "3", "--adapters", "12", "--max-loras", "2", "--requests", "150",
         "--rate", "20", "--isl", "64", "--system-tokens", "32", "--osl", "4"]  # fmt: skip


def test_virtual_time_jumps_to_the_next_timer() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        await asyncio.gather(asyncio.sleep(50.0), asyncio.sleep(3600.0))
        return loop.time(), 0.0

    assert run_virtual(main())[0] == 3600.0
    with pytest.raises(RuntimeError, match="no timer"):
        run_virtual(asyncio.Event().wait())


def test_placement_loads_fewer_adapters_than_random_and_is_deterministic() -> None:
    args = parse_args(SMALL)
    assert len(workload(args)) == 150
    result = run(args)
    rows = {r["policy"]: r for r in result["rows"]}
    assert all(r["failed"] == 0 for r in rows.values())
    tandem, rnd = rows["tandem"], rows["random"]
    assert tandem["adapter_loads"] < rnd["adapter_loads"]
    assert tandem["waited_for_load"] < rnd["waited_for_load"]
    assert tandem["placements"].get("holder", 0) > tandem["placements"].get("placed", 0)
    again = run(parse_args([*SMALL, "--policies", "tandem"]))["rows"][0]
    assert again["adapter_loads"] == tandem["adapter_loads"]  # simulated time: same figures
    assert again["ttft_p99_ms"] == tandem["ttft_p99_ms"]
    text = format_result(result)
    assert "random/tandem loads" in text and "tandem" in text


def test_bad_flags_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--policies", "tandem,fifo"])
    with pytest.raises(SystemExit):
        parse_args(["--system-tokens", "600", "--isl", "512"])
