"""`/dashboard` in headless Chromium against `tandem serve --engine mocker --workers 2 --router
kv`: the page lists both workers by instance id, its numbers move after requests are sent (it
polls `/dashboard/state` live; the page is loaded once), the routing decisions of those
requests appear with their per-worker costs, and a screenshot is taken
(TANDEM_DASHBOARD_SCREENSHOT=path also writes it there, e.g. docs/img/dashboard.png)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from tests.support.chromium import chromium_path, open_page
from tests.support.eventually import eventually
from tests.support.services import free_port
from tests.support.tandem_procs import (
    MODEL,
    get_json,
    http_request,
    start_tandem,
    wait_healthy,
    wait_instances,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PROMPT = " ".join(f"word{i}" for i in range(200))  # several 64-token blocks

WORKER_ROWS = """Array.from(document.querySelectorAll('table.workers tbody tr')).map(r => ({
  id: r.dataset.workerId, role: r.dataset.role,
  routed: r.querySelector('.routed').textContent, hit: r.querySelector('.hit-rate').textContent,
  health: r.children[2].textContent}))"""
DECISIONS = """Array.from(document.querySelectorAll('table.decisions tbody tr')).map(r => ({
  request: r.dataset.requestId, worker: r.dataset.workerId,
  candidates: r.lastChild.querySelectorAll('code').length}))"""


async def _eval_until(page, expression: str, pred, timeout_s: float = 20.0):  # type: ignore[no-untyped-def]
    last = None

    async def check() -> bool:
        nonlocal last
        last = await page.evaluate(expression)
        return bool(pred(last))

    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - the page polls on its own timer
            await asyncio.sleep(0.1)
    return last


def _complete(base: str, suffix: str) -> str:
    status, _, body = http_request(
        f"{base}/v1/completions",
        {"model": MODEL, "prompt": PROMPT + suffix, "max_tokens": 4},
        timeout_s=30,
    )
    assert status == 200, body
    import json

    return str(json.loads(body)["id"])


async def test_dashboard_in_headless_chromium(tmp_path: Path) -> None:
    chromium_path()  # skip early when absent
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = ["serve", "--engine", "mocker", "--workers", "2", "--router", "kv", "--host"]
    argv += ["127.0.0.1", "--port", str(port), "--speedup-ratio", "20"]
    serve = start_tandem("serve", argv, tmp_path)
    try:
        await asyncio.to_thread(wait_healthy, base, 60.0)
        # healthy is one worker ready; the second may register a moment later
        worker_ids = await asyncio.to_thread(
            wait_instances, base, lambda ids: len(ids) == 2, timeout_s=60.0, proc=serve
        )
        async with open_page(f"{base}/dashboard", tmp_path) as page:
            rows = await _eval_until(page, WORKER_ROWS, lambda r: len(r) == 2)
            assert {r["id"] for r in rows} == worker_ids
            assert {r["role"] for r in rows} == {"aggregated"}
            assert all(r["routed"] == "0" for r in rows)
            assert all(r["health"].startswith("alive") for r in rows), rows
            assert await page.evaluate(DECISIONS) == []

            first = await asyncio.to_thread(_complete, base, " first")
            # the prefix is cached on one worker once its KV events reached the router
            await eventually(
                lambda: any(
                    (w["cached_blocks"] or 0) > 0
                    for w in get_json(f"{base}/dashboard/state")[1]["models"][0]["workers"]
                ),
                timeout_s=10,
                poll_s=0.05,
            )
            later = [await asyncio.to_thread(_complete, base, f" again {i}") for i in range(3)]
            sent = {first, *later}

            decisions = await _eval_until(
                page, DECISIONS, lambda d: {x["request"] for x in d} >= sent
            )
            assert {d["worker"] for d in decisions} <= worker_ids
            assert all(d["candidates"] >= 2 for d in decisions)  # both workers' costs shown
            rows = await _eval_until(
                page, WORKER_ROWS, lambda r: sum(int(x["routed"]) for x in r) == 4
            )
            hits = [x["hit"] for x in rows if x["hit"] != "–"]
            assert any(float(h.split()[0]) > 0 for h in hits), rows  # shared prefix reused
            assert int(await page.evaluate("document.body.dataset.polls")) > 1

            png = await page.screenshot(tmp_path / "dashboard.png")
            assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
            if target := os.environ.get("TANDEM_DASHBOARD_SCREENSHOT"):
                shutil.copyfile(tmp_path / "dashboard.png", target)
    finally:
        serve.stop()
