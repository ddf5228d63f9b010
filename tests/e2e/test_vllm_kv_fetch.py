"""Peer KV fetch between two vLLM workers (issue 31): `tandem serve --engine vllm --workers 2
--router kv --kv-fetch`. A long prompt is computed on worker A; while A is busy with a long
generation, the same prompt goes to idle worker B with a fetch hint: the frontend has A export
the prefix (vLLM's NixlConnector, do_remote_decode), B pulls it (do_remote_prefill) and then
serves the request with the pulled tokens as cached. B's greedy tokens equal A's; B's vLLM
counts the prefix as loaded from external KV. A frozen holder (SIGSTOP) exports nothing: the
request is computed on B, with the same tokens and no error."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import REPO, TandemProcess, http_request, wait_instances
from tests.support.vllm_env import BLOCK_SIZE, ENGINE_FLAGS, ENV, require_vllm_venv

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(420)]
MODEL = "smollm2"
ADMIN_KEY = "admin-kv-fetch-e2e"  # /v1/route/explain is an admin route
START_TIMEOUT_S = 300
OTHER_PREFIX = "Other context: " + " ".join(f"entry{j} holds {j * 5 % 11}." for j in range(40))
BUSY_PROMPT = "Count slowly: " + ", ".join(str(i) for i in range(60))
PREFIX = "Shared context: " + " ".join(f"item{j} is number {j * 7 % 13}." for j in range(40))


class Stack:
    def __init__(self, proc: TandemProcess, base: str, ids: set[str]) -> None:
        self.proc, self.base, self.ids = proc, base, sorted(ids)

    def complete(self, prompt: str, max_tokens: int, pin: str | None = None) -> dict[str, Any]:
        headers = {"x-worker-instance-id": pin} if pin else {}
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        status, _, raw = http_request(f"{self.base}/v1/completions", body, headers=headers,
                                      timeout_s=120)  # fmt: skip
        assert status == 200, raw
        out: dict[str, Any] = json.loads(raw)
        return out

    def explain(self, prompt: str) -> dict[str, Any]:
        status, _, body = http_request(
            f"{self.base}/v1/route/explain", {"model": MODEL, "prompt": prompt, "max_tokens": 16},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )  # fmt: skip
        assert status == 200, body
        out: dict[str, Any] = json.loads(body)
        return out

    def worker_pids(self) -> dict[str, int]:
        """worker name -> pid, from the serve log."""
        return {n: int(p) for n, p in re.findall(r"started (worker\d+) pid=(\d+)", self.proc.log())}

    def metrics_urls(self) -> list[str]:
        return re.findall(r"vLLM engine started: .* metrics=(http://\S+)", self.proc.log())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, vllm_hf_dir: Path) -> Iterator[Stack]:
    python = require_vllm_venv()
    tmp = tmp_path_factory.mktemp("vllm-kv-fetch")
    port = free_port()
    args = ["-m", "tandem.cli", "serve", "--engine", "vllm", "--workers", "2", "--router", "kv"]
    args += ["--kv-fetch", "--kv-fetch-timeout-s", "30", "--port", str(port)]
    # a worker with ~3 of its 728 KV blocks in use counts as busy: the holder, generating for
    # the long request beside it, is passed over for the idle worker (which then fetches)
    args += ["--busy-active-blocks-fraction", "0.004"]
    args += ["--run-dir", str(tmp / "run"), "--model", str(vllm_hf_dir)]
    args += ["--served-model-name", MODEL, "--admin-api-key", ADMIN_KEY, *ENGINE_FLAGS]
    # this checkout's tandem first (the venv's editable install may be another's)
    env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO / "src")}
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            [str(python), *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip
    proc = TandemProcess(name="serve", proc=popen, log_path=log)
    try:
        base = f"http://127.0.0.1:{port}"
        ids = wait_instances(base, lambda i: len(i) == 2, timeout_s=START_TIMEOUT_S, proc=proc)
        yield Stack(proc, base, ids)
    finally:
        proc.stop(grace_s=30)


def _metric_sum(url: str, name: str, label: str = "") -> float:
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = resp.read().decode()
    pattern = rf"^{name}(?:{{([^}}]*)}})? ([0-9.e+-]+)$"
    return sum(float(v) for labels, v in re.findall(pattern, body, re.M) if label in labels)


def _busy(stack: Stack, worker_id: str) -> threading.Thread:
    """A long generation pinned to `worker_id`, in the background (a frozen holder's is
    refused once the frontend takes it for gone: no matter)."""

    def run() -> None:
        with contextlib.suppress(AssertionError):
            stack.complete(BUSY_PROMPT, 200, worker_id)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _worker_pid(stack: Stack, instance_id: str) -> int:
    """The pid of the worker process serving `instance_id` (it listens on its address)."""
    log = stack.proc.log()
    (port,) = re.findall(rf"instance_id={instance_id} address=[\d.]+:(\d+)", log)
    for pid in stack.worker_pids().values():
        listening = psutil.Process(pid).net_connections(kind="tcp")
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == int(port) for c in listening):
            return pid
    raise AssertionError(f"no worker process listens on {port}")


def _until_fetch_planned(stack: Stack, prompt: str, holder: str) -> dict[str, Any]:
    """Wait until the router would send `prompt` to the other worker with a fetch from
    `holder` (the holder's KV events and busy load, the other's idle load, have reached it)."""
    deadline = time.monotonic() + 30
    while True:
        explain = stack.explain(prompt)
        plan = explain.get("kv_fetch")
        if explain.get("choice") not in (None, holder) and plan and plan["source_id"] == holder:
            return explain
        assert time.monotonic() < deadline, explain
        time.sleep(0.2)


def test_a_frozen_holder_exports_nothing_and_the_prompt_is_computed(stack: Stack) -> None:
    """First: before a fetch measured the setup time the router charges from then on."""
    holder = stack.ids[0]
    prompt = OTHER_PREFIX + " Question: which item is number 5?"
    expected = stack.complete(prompt, 16, pin=holder)["choices"][0]["text"]
    busy = _busy(stack, holder)
    _until_fetch_planned(stack, prompt, holder)
    pid = _worker_pid(stack, holder)
    os.kill(pid, signal.SIGSTOP)  # its request plane answers nothing: no export
    try:
        out = stack.complete(prompt, 16)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert out["choices"][0]["text"] == expected
    log = stack.proc.log()
    assert "did not export the prefix" in log, log[-3000:]
    assert re.search(r"peer KV fetch from \w+ failed \(holder \w+ exported nothing\)", log)
    busy.join(120)
    # the frozen worker was taken for gone meanwhile; thawed, it is live again
    wait_instances(stack.base, lambda ids: holder in ids, timeout_s=60, proc=stack.proc)


def test_idle_vllm_worker_pulls_the_busy_holders_prefix(stack: Stack) -> None:
    holder = stack.ids[0]
    prompt = PREFIX + " Question: what is item3?"
    log_start = len(stack.proc.log())
    first = stack.complete(prompt, 16, pin=holder)
    assert first["usage"]["prompt_tokens"] >= 4 * BLOCK_SIZE
    expected = first["choices"][0]["text"]
    busy = _busy(stack, holder)
    explain = _until_fetch_planned(stack, prompt, holder)
    out = stack.complete(prompt, 16)
    assert out["choices"][0]["text"] == expected
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 4 * BLOCK_SIZE, out["usage"]
    log = stack.proc.log()[log_start:]  # this test's: the frozen holder's fell back
    assert "did not export" not in log and "peer KV fetch from" not in log, log[-3000:]
    # the fetcher's vLLM loaded the prefix from the holder over NIXL
    moved = [u for u in stack.metrics_urls()
             if _metric_sum(u, "vllm:prompt_tokens_by_source_total",
                            'source="external_kv_transfer"') > 0]  # fmt: skip
    assert len(moved) == 1, (explain, stack.proc.log()[-4000:])
    assert _metric_sum(moved[0], "vllm:nixl_bytes_transferred_sum") > 0
    assert _metric_sum(moved[0], "vllm:nixl_num_failed_transfers_total") == 0
    busy.join(120)
