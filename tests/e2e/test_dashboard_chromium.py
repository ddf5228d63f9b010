"""`/dashboard` in headless Chromium against `tandem serve --engine mocker --workers 2 --router
kv`: the page lists both workers by instance id, its numbers move after requests are sent (it
polls `/dashboard/state` live; the page is loaded once), the routing decisions of those
requests appear with their per-worker costs, the tenants table shows the tokens each tenant was
served and its 429s (a tenants file is in force), and a screenshot is taken
(TANDEM_DASHBOARD_SCREENSHOT=path also writes it there, e.g. docs/img/dashboard.png). The
page's tables for a router queue per class and tenant and for a running batch are rendered from
a fixed state, with no server."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

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
TENANT_ROWS = """Object.fromEntries(Array.from(
  document.querySelectorAll('table.tenant-usage tbody tr')).map(r => [r.dataset.tenant, {
    prompt: r.querySelector('.prompt-tokens').textContent,
    completion: r.querySelector('.completion-tokens').textContent,
    limited: r.querySelector('.limited-requests').textContent}]))"""


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


def _post(base: str, suffix: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    status, _, body = http_request(
        f"{base}/v1/completions",
        {"model": MODEL, "prompt": PROMPT + suffix, "max_tokens": 4},
        timeout_s=30,
        headers=headers,
    )
    return status, body


def _complete(base: str, suffix: str) -> str:
    status, body = _post(base, suffix)
    assert status == 200, body
    return str(json.loads(body)["id"])


async def test_dashboard_in_headless_chromium(tmp_path: Path) -> None:
    chromium_path()  # skip early when absent
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = ["serve", "--engine", "mocker", "--workers", "2", "--router", "kv", "--host"]
    argv += ["127.0.0.1", "--port", str(port), "--speedup-ratio", "20"]
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        f"limits_db: {tmp_path / 'limits.sqlite'}\ntenants:\n  acme:\n    requests_per_minute: 1\n"
    )
    argv += ["--tenants-file", str(tenants_file)]
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

            # tokens served per tenant and its 429s: acme's second request is over its limit
            acme = {"x-tenant-id": "acme"}
            codes = [(await asyncio.to_thread(_post, base, f" acme {i}", acme))[0] for i in (1, 2)]
            assert codes == [200, 429]
            tenants = await _eval_until(
                page, TENANT_ROWS, lambda t: t.get("acme", {}).get("limited") == "1"
            )
            served = {t["tenant"]: t for t in get_json(f"{base}/dashboard/state")[1]["tenants"]}
            assert tenants["acme"]["prompt"] == str(served["acme"]["prompt_tokens"]) != "0"
            assert tenants["acme"]["completion"] == str(served["acme"]["completion_tokens"])
            assert int(tenants["default"]["prompt"]) > int(tenants["acme"]["prompt"])  # 4 sent
            assert tenants["default"]["limited"] == "0"
            assert int(await page.evaluate("document.body.dataset.polls")) > 1

            png = await page.screenshot(tmp_path / "dashboard.png")
            assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
            if target := os.environ.get("TANDEM_DASHBOARD_SCREENSHOT"):
                shutil.copyfile(tmp_path / "dashboard.png", target)
    finally:
        serve.stop()


PAGE = Path(__file__).parents[2] / "src/tandem/frontend/static/dashboard.html"
QUEUE = [
    {"priority_class": "high", "tenant": "bulk", "queued": 1, "waited": 4, "mean_wait_s": 0.25,
     "deadline_misses": 0},
    {"priority_class": "low", "tenant": "tiny", "queued": 2, "waited": 0, "mean_wait_s": None,
     "deadline_misses": 1},
]  # fmt: skip
BATCHES = {"by_status": {"in_progress": 1, "completed": 2}, "lines_inflight": 3,
           "running": [{"id": "batch_1", "total": 6, "completed": 2, "failed": 1}]}  # fmt: skip


def _fixed_state(
    queue: list[dict[str, Any]], sessions: dict[str, int], batches: dict[str, Any] | None
) -> dict[str, Any]:
    """A `/dashboard/state` of one model whose router pool has `queue` rows and `sessions`."""
    pool = {"pool": "aggregated", "policy": "kv", "queued": 3, "num_decisions": 1,
            "hit_rate": None, "kv_fetches": 0, "tenants": queue,
            "tenant_tokens": {"bulk": 88, "tiny": 0}, "sessions": sessions}  # fmt: skip
    router = {"policy": "kv", "queued": 3, "hit_rate": None, "num_decisions": 1,
              "kv_fetches": 0, "pools": [pool]}  # fmt: skip
    frontend = {"healthy": True, "missing": [], "inflight": 1, "max_inflight": 8,
                "loop_lag_ms": 0.0, "queued": 3}  # fmt: skip
    return {
        "time_s": 0,
        "frontend": frontend,
        "models": [{"name": "smollm2", "workers": [], "decisions": [], "router": router}],
        "tenants": None,
        "batches": batches,
    }


QUEUE_ROWS = """Array.from(document.querySelectorAll('table.tenants tbody tr')).map(r => ({
  klass: r.dataset.class, tenant: r.dataset.tenant, queued: r.querySelector('.queued').textContent,
  waited: r.querySelector('.waited').textContent,
  fair: r.querySelector('.fair-share-tokens').textContent,
  cells: Array.from(r.children).map(c => c.textContent)}))"""
HEADINGS = "Array.from(document.querySelectorAll('h2')).map(h => h.textContent)"
BATCH_ROWS = """Array.from(document.querySelectorAll('table.batches tr[data-batch]')).map(r =>
  [r.dataset.batch, ...Array.from(r.children).slice(1).map(c => c.textContent)])"""


async def test_dashboard_renders_queue_rows_and_batch_progress(tmp_path: Path) -> None:
    """No server: the page from its file (its polls fail and leave the tables alone)."""
    chromium_path()  # skip early when absent
    async with open_page(PAGE.as_uri(), tmp_path) as page:
        await _eval_until(page, "typeof render", lambda t: t == "function")
        queued = _fixed_state(QUEUE, {"bound": 1, "hits": 2, "rebinds": 3}, BATCHES)
        await page.evaluate(f"render({json.dumps(queued)})")
        rows = await page.evaluate(QUEUE_ROWS)
        assert [(r["klass"], r["tenant"], r["queued"], r["waited"], r["fair"]) for r in rows] == [
            ("high", "bulk", "1", "4", "88"), ("low", "tiny", "2", "0", "0")
        ]  # fmt: skip
        assert rows[0]["cells"][4] == "250 ms" and rows[1]["cells"][5] == "1"  # wait, misses
        headings = await page.evaluate(HEADINGS)
        assert "queue by class and tenant (aggregated) — sessions 1 bound, 2 hits, 3 rebinds" in (
            headings
        )
        assert "batches — 1 in_progress, 2 completed, 3 lines in flight" in headings
        assert await page.evaluate(BATCH_ROWS) == [["batch_1", "6", "2", "1"]]

        # sessions in use while nothing ever queued: the bindings still show, with no table
        idle = _fixed_state([], {"bound": 1, "hits": 0, "rebinds": 2}, None)
        await page.evaluate(f"render({json.dumps(idle)})")
        headings = await page.evaluate(HEADINGS)
        assert "sessions 1 bound, 0 hits, 2 rebinds (aggregated)" in headings
        assert await page.evaluate(QUEUE_ROWS) == []
