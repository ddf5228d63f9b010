"""`tandem global-router` as a real process in front of two live `tandem serve --engine mocker`
pools: an aggregated one (namespace `agg`, one worker) and a prefill-first disaggregated one
(namespace `pd`, one prefill + one decode worker). Requests whose targets fall in the grid's
"disaggregated" cell go through the pair's frontend, where the prefill worker sends KV and
the decode worker pulls it; the others reach the aggregated pool, whose worker is the only
one counting them. Streaming passes through the global router."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import (
    MODEL,
    TandemProcess,
    http_request,
    start_tandem,
    wait_healthy,
)

from tandem.runtime.metrics import parse

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]
MOCKER = ["--engine", "mocker", "--speedup-ratio", "0", "--block-size", "16"]


class Stack:
    def __init__(self, router: str, agg: str, pd: str) -> None:
        self.router, self.agg, self.pd = router, agg, pd


def _serve(name: str, namespace: str, tmp: Path, *flags: str) -> tuple[TandemProcess, str]:
    port = free_port()
    args = ["serve", *MOCKER, *flags, "--namespace", namespace, "--port", str(port)]
    args += ["--run-dir", str(tmp / name), "--log-level", "INFO"]
    return start_tandem(name, args, tmp), f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("grouter")
    procs: list[TandemProcess] = []
    try:
        agg, agg_url = _serve("agg", "agg", tmp, "--workers", "1")
        procs.append(agg)
        pd, pd_url = _serve("pd", "pd", tmp, "--prefill-workers", "1", "--decode-workers", "1",
                        "--disagg-flow", "prefill-first")  # fmt: skip
        procs.append(pd)
        port = free_port()
        config = {
            "port": port,
            "pools": [{"name": "agg", "namespace": "agg", "url": agg_url},
                      {"name": "prefill", "namespace": "pd"},
                      {"name": "gone", "namespace": "pd"},  # a second, dead pd frontend
                      {"name": "decode", "namespace": "pd"}],
            # tight TTFT targets (≤ 500 ms) go to a disaggregated pair, the rest to `agg`;
            # the middle target (the default) is 2000 ms: aggregated
            "aggregated": {"ttft_ms": [500, 2000, 10_000], "itl_ms": [50],
                           "pools": [["disaggregated"], ["agg"], ["agg"]]},
            # prompts over 200 tokens: the pair whose frontend is down
            "prefill": {"isl": [200, 100_000], "ttft_ms": [10_000],
                        "pools": [["prefill"], ["gone"]]},
            "decode": {"context": [100_000], "itl_ms": [10_000], "pools": [["decode"]]},
            "disaggregated": [{"prefill": "prefill", "decode": "decode", "url": pd_url},
                              {"prefill": "gone", "decode": "decode", "url": _dead_url()}],
        }  # fmt: skip
        (tmp / "grouter.json").write_text(json.dumps(config))
        router = start_tandem("global-router", ["global-router", "--config",
                              str(tmp / "grouter.json")], tmp)  # fmt: skip
        procs.append(router)
        for proc in (agg, pd):
            proc.wait_log("tandem serve ready", timeout_s=90)
        wait_healthy(agg_url, timeout_s=60)
        wait_healthy(pd_url, timeout_s=60)
        base = f"http://127.0.0.1:{port}"
        wait_healthy_router(base, router)
        yield Stack(base, agg_url, pd_url)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connection refused


def wait_healthy_router(base: str, router: TandemProcess) -> None:
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError):
            if http_request(f"{base}/v1/models", timeout_s=2)[0] == 200:
                return
        assert router.proc.poll() is None, router.log()[-3000:]
        assert time.monotonic() < deadline, router.log()[-3000:]
        time.sleep(0.1)


def _workers(url: str) -> dict[str, Any]:
    return parse(http_request(f"{url}/metrics/workers", timeout_s=5)[2].decode())


def _by_component(rows: dict[Any, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in rows.items():
        comp = dict(labels)["component"]
        out[comp] = out.get(comp, 0) + value
    return out


def _counts(url: str) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    m = _workers(url)
    requests = _by_component(m.get("tandem_worker_requests_total", {}))
    moved: dict[tuple[str, str], float] = {}
    for labels, value in m.get("tandem_transfer_bytes_total", {}).items():
        key = (dict(labels)["component"], dict(labels)["direction"])
        moved[key] = moved.get(key, 0) + value
    return requests, moved


def _ask(stack: Stack, **extra: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": MODEL, "prompt": "tell me about the sea " * 8, "max_tokens": 5, **extra}
    status, headers, raw = http_request(f"{stack.router}/v1/completions", body, timeout_s=30)
    assert status == 200, raw
    return headers["x-tandem-pool"], json.loads(raw)


def test_targets_pick_the_aggregated_or_the_prefill_first_pool(stack: Stack) -> None:
    agg0, _ = _counts(stack.agg)
    pd0, moved0 = _counts(stack.pd)
    for _ in range(2):
        pool, reply = _ask(stack, tandem={"ttft_target_ms": 200})
        assert pool == "prefill+decode" and reply["usage"]["completion_tokens"] == 5
    agg1, _ = _counts(stack.agg)
    pd1, moved1 = _counts(stack.pd)
    assert agg1 == agg0  # the aggregated pool's worker saw none of them
    assert pd1["prefill"] - pd0.get("prefill", 0) >= 2  # the prefill leg ran on the prefill pool
    assert pd1["backend"] - pd0.get("backend", 0) >= 2  # and the decode leg on the decode pool
    sent = moved1[("prefill", "sent")] - moved0.get(("prefill", "sent"), 0)
    received = moved1[("backend", "received")] - moved0.get(("backend", "received"), 0)
    assert sent == received > 0  # the KV went from prefill to decode worker

    for extra in ({}, {"tandem": {"ttft_target_ms": 1500, "itl_target_ms": 20}}):
        pool, reply = _ask(stack, **extra)  # default (the middle, 2000 ms) or a loose target
        assert pool == "agg" and reply["usage"]["completion_tokens"] == 5
    agg2, _ = _counts(stack.agg)
    pd2, moved2 = _counts(stack.pd)
    assert agg2["backend"] - agg1.get("backend", 0) == 2
    assert pd2 == pd1 and moved2 == moved1  # the disaggregated pool saw none of them


def test_streaming_through_the_global_router_to_the_disaggregated_pool(stack: Stack) -> None:
    pd0, moved0 = _counts(stack.pd)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 30}],
            "max_tokens": 6, "stream": True, "tandem": {"ttft_target_ms": 100}}  # fmt: skip
    status, headers, raw = http_request(f"{stack.router}/v1/chat/completions", body, 30)
    assert status == 200, raw
    assert headers["x-tandem-pool"] == "prefill+decode"
    assert headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(1 for c in chunks for ch in c["choices"] if ch["delta"].get("content")) >= 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" or any(
        ch.get("finish_reason") == "length" for c in chunks for ch in c["choices"]
    )
    pd1, moved1 = _counts(stack.pd)
    assert pd1["prefill"] > pd0.get("prefill", 0) and pd1["backend"] > pd0.get("backend", 0)
    assert moved1[("prefill", "sent")] > moved0.get(("prefill", "sent"), 0)


def test_a_dead_pair_hands_over_to_the_faster_aggregated_pool(stack: Stack) -> None:
    agg0, _ = _counts(stack.agg)
    pd0, _ = _counts(stack.pd)
    long = {"model": MODEL, "prompt": "waves " * 400, "max_tokens": 3}
    status, headers, raw = http_request(
        f"{stack.router}/v1/completions", {**long, "tandem": {"ttft_target_ms": 200}}, 30
    )
    assert status == 200, raw  # the `gone` pair refused the connection before any byte
    assert headers["x-tandem-pool"] == "agg"
    assert _counts(stack.agg)[0]["backend"] == agg0.get("backend", 0) + 1
    assert _counts(stack.pd)[0] == pd0
