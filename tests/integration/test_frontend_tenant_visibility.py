"""What an operator sees of tenants and batches (issue 33) on `/dashboard/state` and
`/metrics`, on a frontend and a mocker worker in one process: tokens served and 429s per
tenant, the router queue per priority class and tenant (depth, waits, deadline misses) while
requests wait behind a held worker, and a running batch's line counts."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import openai
import pytest
from tests.support.frontend_stack import COMPLETIONS, FrontendStack

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.frontend.batch.config import BatchConfig
from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.router.config import RouterConfig

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"
PROMPT = [1000 + i for i in range(40)]  # 40 prompt tokens


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **fields}


def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
limits_db: {tmp_path / "limits.sqlite"}
tenants:
  acme:
    weight: 2
    requests_per_minute: 2
  tiny:
    tokens_per_minute: 100
  bulk:
    weight: 3
""")
    return path


class Gate:
    """Holds a worker's requests in its engine: open, every request runs; `hold(n)` lets the
    next `n` through and holds the rest until `release`."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.released.set()
        self.passes = 0
        self.num_held = 0

    def hold(self, passes: int = 0) -> None:
        self.passes = passes
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    def wrap(self, engine: MockerEngine) -> MockerEngine:
        generate = engine.generate

        async def gated(
            request: PreprocessedRequest, **kw: Any
        ) -> AsyncGenerator[EngineOutput, None]:
            if not self.released.is_set():
                if self.passes > 0:
                    self.passes -= 1
                else:
                    self.num_held += 1
                    await self.released.wait()
            async for out in generate(request, **kw):
                yield out

        engine.generate = gated  # type: ignore[method-assign]
        return engine


async def start(stack: AsyncExitStack, gate: Gate | None = None, **config: Any) -> FrontendStack:
    s = FrontendStack(stack)
    engine = MockerEngine(MockerConfig(num_blocks=256, block_size=16, speedup_ratio=0))
    await s.add_worker(gate.wrap(engine) if gate is not None else engine)
    await s.start_frontend(body(), ready_path=COMPLETIONS, **config)
    if gate is not None:
        stack.callback(gate.release)  # a failed test's held requests end before the stack
    return s


async def post(s: FrontendStack, payload: dict[str, Any], **headers: str) -> tuple[int, Any]:
    assert s.http is not None
    async with s.http.post(f"{s.base}{COMPLETIONS}", json=payload, headers=headers) as resp:
        return resp.status, await resp.json()


async def state(s: FrontendStack) -> dict[str, Any]:
    status, text = await s.get("/dashboard/state")
    assert status == 200, text
    return dict(json.loads(text))


async def poll_state(s: FrontendStack, pred: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    """The first state `pred` accepts (polled every 20 ms)."""
    async with asyncio.timeout(timeout_s):
        while not pred(current := await state(s)):  # noqa: ASYNC110 - over HTTP
            await asyncio.sleep(0.02)
    return current


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample of `name` with exactly `labels` in the exposition `text`."""
    shown = ",".join(f'{k}="{v}"' for k, v in labels.items())
    found = re.search(rf"^{name}\{{{re.escape(shown)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


async def test_tokens_served_and_limit_hits_per_tenant(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        s = await start(stack, tenants_file=tenants_file(tmp_path))
        completion = {"acme": 0, "tiny": 0}
        for tenant in ("acme", "tiny"):
            # acme: 2 requests/min; tiny: 100 tokens/min, a 40-token prompt fits twice
            codes = []
            for _ in range(3):
                status, reply = await post(s, body(), **{"x-tenant-id": tenant})
                codes.append(status)
                if status == 200:
                    completion[tenant] += reply["usage"]["completion_tokens"]
            assert codes == [200, 200, 429], (tenant, codes)
        assert completion["acme"] > 0 and completion["tiny"] > 0

        rows = {r["tenant"]: r for r in (await state(s))["tenants"]}
        assert rows["acme"] == {
            "tenant": "acme", "weight": 2.0, "prompt_tokens": 80,
            "completion_tokens": completion["acme"],
            "limit_hits": {"requests": 1, "tokens": 0},
            "limits": {"requests_per_minute": 2, "tokens_per_minute": None},
        }  # fmt: skip
        assert rows["tiny"]["prompt_tokens"] == 80  # the refused third prompt is not served
        assert rows["tiny"]["completion_tokens"] == completion["tiny"]
        assert rows["tiny"]["limit_hits"] == {"requests": 0, "tokens": 1}
        assert rows["tiny"]["limits"]["tokens_per_minute"] == 100
        # a configured tenant that sent nothing has its row, all zeros
        assert rows["bulk"]["weight"] == 3.0
        assert rows["bulk"]["prompt_tokens"] == rows["bulk"]["completion_tokens"] == 0
        assert rows["bulk"]["limit_hits"] == {"requests": 0, "tokens": 0}
        # the ready probe's request was the default tenant's
        assert rows["default"]["prompt_tokens"] > 0

        # the same counts as /metrics, and not the router's fair-share figure, which weighs
        # output twice
        _, text = await s.get("/metrics")
        for tenant in ("acme", "tiny"):
            for kind, key in (("prompt", "prompt_tokens"), ("output", "completion_tokens")):
                served = metric(text, "tandem_frontend_tenant_tokens_total",
                                tenant=tenant, kind=kind)  # fmt: skip
                assert served == rows[tenant][key], (tenant, kind)
            for limit in ("requests", "tokens"):
                hits = metric(text, "tandem_frontend_tenant_rate_limited_total",
                              tenant=tenant, limit=limit)  # fmt: skip
                assert (hits or 0) == rows[tenant]["limit_hits"][limit], (tenant, limit)
        (pool,) = (await state(s))["models"][0]["router"]["pools"]
        assert pool["tenant_tokens"]["acme"] != 80 + completion["acme"]


async def test_without_a_tenants_file_there_is_no_tenant_table() -> None:
    async with AsyncExitStack() as stack:
        s = await start(stack)
        assert (await state(s))["tenants"] is None


def queue_rows(current: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    (pool,) = current["models"][0]["router"]["pools"]
    return {(r["priority_class"], r["tenant"]): r for r in pool["tenants"]}


async def test_queue_depth_and_waits_per_class_and_tenant(tmp_path: Path) -> None:
    gate = Gate()
    router = RouterConfig(busy_inflight_requests=1, queue_size=8)
    async with AsyncExitStack() as stack:
        s = await start(stack, gate, tenants_file=tenants_file(tmp_path), router=router)
        gate.hold()
        # the worker's one slot taken by a held request of the most urgent class; the others
        # wait in the router queue (none is one its engine would preempt that request for)
        high = {"x-tandem-priority": "high"}
        blocker = asyncio.create_task(post(s, body(), **{"x-tenant-id": "bulk", **high}))
        await poll_state(s, lambda _: gate.num_held == 1)
        # a deadline that passes in the queue: answered 504, counted on its row
        status, reply = await post(
            s, body(), **{"x-tenant-id": "acme", "x-tandem-deadline-ms": "200"}
        )
        assert status == 504, reply
        waiting = [
            asyncio.create_task(post(s, body(), **{"x-tenant-id": "bulk", **high})),
            *(asyncio.create_task(post(s, body(), **{"x-tenant-id": "tiny",
                                                     "x-tandem-priority": "low"}))
              for _ in range(2)),
        ]  # fmt: skip
        current = await poll_state(
            s, lambda st: {k: r["queued"] for k, r in queue_rows(st).items() if r["queued"]}
            == {("high", "bulk"): 1, ("low", "tiny"): 2},
        )  # fmt: skip
        missed = queue_rows(current)[("normal", "acme")]
        assert missed["queued"] == 0 and missed["waited"] == 1
        assert missed["deadline_misses"] == 1 and missed["mean_wait_s"] > 0.05
        # a request answered 504 before it ran was not served: none of its tokens count
        (acme,) = [row for row in current["tenants"] if row["tenant"] == "acme"]
        assert acme["prompt_tokens"] == acme["completion_tokens"] == 0, acme
        assert current["frontend"]["queued"] == 3
        _, text = await s.get("/metrics")
        pattern = r'^tandem_router_tenant_queued_requests\{priority_class="low",tenant="tiny"'
        assert re.search(pattern + r"[^}]*\} 2(\.0)?$", text, re.M), text

        gate.release()
        answers = await asyncio.gather(blocker, *waiting)
        assert [status for status, _ in answers] == [200] * 4
        rows = queue_rows(await state(s))
        assert all(r["queued"] == 0 for r in rows.values())
        # bulk's first request found the worker free and never queued: one wait, not two
        for key, num in ((("high", "bulk"), 1), (("low", "tiny"), 2)):
            assert rows[key]["waited"] == num and rows[key]["mean_wait_s"] > 0, rows[key]
            assert rows[key]["deadline_misses"] == 0


def line(custom_id: str) -> str:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": custom_id}],
               "max_tokens": 2}  # fmt: skip
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": payload})  # fmt: skip


async def test_a_running_batch_shows_its_progress() -> None:
    gate = Gate()
    async with AsyncExitStack() as stack:
        s = await start(stack, gate, batch=BatchConfig(poll_s=0.05))
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="none", max_retries=0)
        stack.push_async_callback(client.close)
        gate.hold(passes=2)  # two lines answer, three are held in the engine
        lines = [line(f"req-{i}") for i in range(5)] + ["{not json"]
        content = ("\n".join(lines) + "\n").encode()
        file_id = (await client.files.create(file=("in.jsonl", content), purpose="batch")).id
        batch = await client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        progress = {"id": batch.id, "total": 6, "completed": 2, "failed": 1}
        current = await poll_state(
            s, lambda st: st["batches"]["running"] == [progress] and gate.num_held == 3
        )
        assert current["batches"]["lines_inflight"] == 3
        assert current["batches"]["by_status"]["in_progress"] == 1
        _, text = await s.get("/metrics")
        for state_name, value in (("total", 6), ("completed", 2), ("failed", 1)):
            shown = metric(text, "tandem_frontend_batch_lines", batch_id=batch.id,
                           state=state_name)  # fmt: skip
            assert shown == value, (state_name, shown)

        gate.release()
        current = await poll_state(s, lambda st: st["batches"]["by_status"]["completed"] == 1)
        assert current["batches"]["running"] == [] and current["batches"]["lines_inflight"] == 0
        _, text = await s.get("/metrics")
        assert f'batch_id="{batch.id}"' not in text  # a finished batch leaves the gauge
        done = await client.batches.retrieve(batch.id)
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (5, 1)
