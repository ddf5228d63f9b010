"""The batch lane (`/v1/files`, `/v1/batches`) through a real frontend to mocker workers, driven
by the official `openai` SDK: upload, create, progress, output and error files in OpenAI's line
format, a bad line reported while the rest runs, chat and completions lines (the latter answered
as the same requests sent online), list, cancel, ownership between two keys, the refusals
(oversized file, unknown endpoint, a model that is not served), the lines' priority class, a
restarted frontend resuming a batch from its database, and a worker stopped, or a worker process
killed (SIGKILL), mid-batch losing no line."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from openai.types import Batch
from tests.support.frontend_stack import FrontendStack
from tests.support.tandem_procs import start_worker

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.frontend.batch.config import BatchConfig
from tandem.protocols.engine import PreprocessedRequest
from tandem.protocols.tenancy import BATCH_PRIORITY
from tandem.runtime.base import Discovery
from tandem.runtime.discovery.file import FileDiscovery

pytestmark = pytest.mark.timeout(90)
MODEL = "smollm2"
CHAT: Literal["/v1/chat/completions"] = "/v1/chat/completions"
COMPLETIONS: Literal["/v1/completions"] = "/v1/completions"
READY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _line(custom_id: str, text: str, max_tokens: int = 3, url: str = CHAT) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens}  # fmt: skip
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _completion_line(custom_id: str, prompt: str, max_tokens: int = 4) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body})


@asynccontextmanager
async def _stack(
    db: Path | None,
    *,
    num_workers: int = 1,
    speedup: float = 0,
    api_keys: tuple[str, ...] = (),
    discovery: Discovery | None = None,
    **batch: Any,
) -> AsyncIterator[tuple[FrontendStack, list[PreprocessedRequest], openai.AsyncOpenAI]]:
    """A frontend with the batch lane and `num_workers` in-process mocker workers (their
    requests recorded); `discovery` (default: in memory) can be shared with worker processes."""
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        if discovery is not None:
            s.discovery = discovery
        seen: list[PreprocessedRequest] = []
        for _ in range(num_workers):
            engine = MockerEngine(MockerConfig(speedup_ratio=speedup))
            generate = engine.generate

            def recording(request: PreprocessedRequest, _g: Any = generate, **kw: Any) -> Any:
                seen.append(request)
                return _g(request, **kw)

            engine.generate = recording  # type: ignore[method-assign]
            await s.add_worker(engine)
        config = BatchConfig(db_path=db, poll_s=0.05, lease_s=2.0, **batch)
        await s.start_frontend(READY, batch=config, api_keys=api_keys)
        client = openai.AsyncOpenAI(
            base_url=f"{s.base}/v1", api_key=api_keys[0] if api_keys else "none", max_retries=0
        )
        exit_stack.push_async_callback(client.close)
        seen.clear()
        yield s, seen, client


async def _upload(client: openai.AsyncOpenAI, lines: list[str]) -> str:
    content = ("\n".join(lines) + "\n").encode()
    return (await client.files.create(file=("in.jsonl", content), purpose="batch")).id


async def _until(
    client: openai.AsyncOpenAI, batch_id: str, done: Callable[[Batch], bool], timeout_s: float = 60
) -> Batch:
    """The batch once `done(batch)`, polled over HTTP."""
    async with asyncio.timeout(timeout_s):
        while not done(batch := await client.batches.retrieve(batch_id)):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    return batch


async def _wait(
    client: openai.AsyncOpenAI, batch_id: str, status: str, timeout_s: float = 60
) -> Batch:
    return await _until(client, batch_id, lambda b: b.status == status, timeout_s)


def _completed(batch: Batch) -> int:
    assert batch.request_counts is not None
    return batch.request_counts.completed


async def _lines(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    text = (await client.files.content(file_id)).text
    return [json.loads(line) for line in text.splitlines()]


async def test_a_batch_runs_with_the_sdk_and_a_bad_line_lands_in_the_error_file() -> None:
    async with _stack(None) as (_s, seen, client):
        lines = [_line(f"req-{i}", f"question {i}") for i in range(4)]
        lines.insert(2, "{not json")
        lines.append(_line("wrong-url", "x", url="/v1/completions"))
        file_id = await _upload(client, lines)
        assert (await client.files.retrieve(file_id)).purpose == "batch"
        batch = await client.batches.create(
            input_file_id=file_id, endpoint=CHAT, completion_window="24h",
            metadata={"job": "nightly"},
        )  # fmt: skip
        # OpenAI's walk: validating (its lines were checked) until a runner takes it
        assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
        assert batch.in_progress_at is None
        done = await _wait(client, batch.id, "completed")
        assert done.in_progress_at is not None and done.in_progress_at >= batch.created_at
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (6, 4)
        assert done.request_counts.failed == 2 and done.completed_at is not None
        out = await _lines(client, done.output_file_id)
        assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(4)]
        for o in out:
            assert o["error"] is None and o["response"]["status_code"] == 200
            assert o["id"].startswith("batch_req_") and o["response"]["request_id"]
            body = o["response"]["body"]
            assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
        errors = await _lines(client, done.error_file_id)
        assert [e["custom_id"] for e in errors] == ["line-3", "wrong-url"]
        assert all(e["response"] is None and e["error"]["code"] for e in errors)
        assert "not valid JSON" in errors[0]["error"]["message"]
        # the lines ran at the batch class, as the creator's tenant
        assert len(seen) == 4 and {r.priority for r in seen} == {BATCH_PRIORITY}
        assert batch.id in [b.id async for b in client.batches.list()]
        _, state = await _s.get("/dashboard/state")
        assert json.loads(state)["batches"]["by_status"]["completed"] == 1
        assert file_id in [f.id async for f in client.files.list()]
        # /v1/embeddings lines run the same way
        emb = json.dumps({"custom_id": "e0", "method": "POST", "url": "/v1/embeddings",
                          "body": {"model": MODEL, "input": "hello"}})  # fmt: skip
        batch = await client.batches.create(
            input_file_id=await _upload(client, [emb]), endpoint="/v1/embeddings",
            completion_window="24h",
        )  # fmt: skip
        done = await _wait(client, batch.id, "completed")
        (answer,) = await _lines(client, done.output_file_id)
        assert answer["response"]["body"]["data"][0]["object"] == "embedding"
        await client.files.delete(file_id)
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(file_id)


async def test_refusals_cancel_and_another_keys_view(tmp_path: Path) -> None:
    keys = ("sk-alice", "sk-bob")
    async with _stack(None, api_keys=keys, max_file_bytes=4096, speedup=1) as (s, _, alice):
        bob = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="sk-bob", max_retries=0)
        try:
            with pytest.raises(openai.APIStatusError) as err:
                await _upload(alice, [_line(f"r{i}", "x" * 100) for i in range(40)])
            assert err.value.status_code == 413 and "--batch-max-file-mb" in err.value.message
            file_id = await _upload(alice, [_line(f"r{i}", "long", 200) for i in range(12)])
            with pytest.raises(openai.BadRequestError) as bad:
                await alice.batches.create(input_file_id=file_id, endpoint="/v1/moderations",
                                           completion_window="24h")  # fmt: skip
            assert "endpoint" in bad.value.message
            no_model = await _upload(alice, [_line("a", "x").replace(MODEL, "no-such-model")])
            with pytest.raises(openai.BadRequestError) as bad:
                await alice.batches.create(input_file_id=no_model, endpoint=CHAT,
                                           completion_window="24h")  # fmt: skip
            assert "no-such-model" in bad.value.message and "line 1" in bad.value.message
            # bob sees none of alice's files or batches
            with pytest.raises(openai.NotFoundError):
                await bob.files.content(file_id)
            with pytest.raises(openai.NotFoundError):
                await bob.batches.create(input_file_id=file_id, endpoint=CHAT,
                                         completion_window="24h")  # fmt: skip
            batch = await alice.batches.create(input_file_id=file_id, endpoint=CHAT,
                                               completion_window="24h")  # fmt: skip
            with pytest.raises(openai.NotFoundError):
                await bob.batches.retrieve(batch.id)
            with pytest.raises(openai.NotFoundError):
                await bob.batches.cancel(batch.id)
            assert [b async for b in bob.batches.list()] == []
            cancelling = await alice.batches.cancel(batch.id)
            assert cancelling.status in ("cancelling", "cancelled")
            cancelled = await _wait(alice, batch.id, "cancelled")
            assert cancelled.request_counts is not None
            assert cancelled.request_counts.completed < 12 and cancelled.cancelled_at
        finally:
            await bob.close()


async def test_a_restarted_frontend_resumes_and_a_killed_worker_loses_no_line(
    tmp_path: Path,
) -> None:
    db = tmp_path / "batches.sqlite"
    num = 24
    lines = [_line(f"req-{i}", f"turn {i}", 16) for i in range(num)]
    async with _stack(db, speedup=4, max_inflight=4) as (_s, _, client):
        batch = await client.batches.create(
            input_file_id=await _upload(client, lines), endpoint=CHAT, completion_window="24h"
        )
        await _until(client, batch.id, lambda b: _completed(b) > 0)
    # the frontend stopped mid-batch; a new one on the same database finishes it, and one of
    # its two workers is stopped while it runs
    async with _stack(db, num_workers=2, speedup=4, max_inflight=4) as (s, _, client):
        before = (await client.batches.retrieve(batch.id)).request_counts
        assert before is not None and before.completed < num
        await _until(client, batch.id, lambda b: _completed(b) >= before.completed + 2)
        await s.workers[0].stop(0)
        done = await _wait(client, batch.id, "completed")
        assert done.request_counts is not None and done.request_counts.completed == num
        out = await _lines(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(num))
        assert all(o["response"]["status_code"] == 200 for o in out)
        _, metrics = await s.get("/metrics")
        assert 'tandem_frontend_batches{status="completed"} 1\n' in metrics


async def test_a_completions_batch_runs_with_the_sdk_and_answers_as_online() -> None:
    prompts = ["the first line", "a second, longer line of text", "3"]
    async with _stack(None) as (_s, seen, client):
        lines = [_completion_line(f"c{i}", prompt) for i, prompt in enumerate(prompts)]
        batch = await client.batches.create(
            input_file_id=await _upload(client, lines), endpoint=COMPLETIONS,
            completion_window="24h",
        )  # fmt: skip
        assert batch.endpoint == COMPLETIONS
        done = await _wait(client, batch.id, "completed")
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (3, 3)
        assert done.request_counts.failed == 0 and done.error_file_id is None
        out = await _lines(client, done.output_file_id)
        assert [o["custom_id"] for o in out] == ["c0", "c1", "c2"]
        assert len(seen) == 3 and {r.priority for r in seen} == {BATCH_PRIORITY}
        for o, prompt in zip(out, prompts, strict=True):
            assert o["error"] is None and o["response"]["status_code"] == 200
            body = o["response"]["body"]
            assert body["object"] == "text_completion" and body["model"] == MODEL
            assert body["usage"]["completion_tokens"] == 4
            online = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=4, temperature=0
            )
            assert body["choices"][0]["text"] == online.choices[0].text
            assert online.usage is not None
            assert body["usage"] == online.usage.model_dump(exclude_none=True)


async def _inflight_on(s: FrontendStack, worker_id: str) -> float:
    """The router's count of requests in flight on `worker_id`, from /metrics."""
    _, text = await s.get("/metrics")
    labels = f'model="{MODEL}",worker_id="{worker_id}",metric="inflight"'
    m = re.search(rf"^tandem_frontend_worker_load\{{{labels}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_a_worker_process_killed_mid_batch_loses_no_line(tmp_path: Path) -> None:
    """Two workers, one in its own process: SIGKILL it while lines run on it; they run again
    on the other worker and every line completes with its result."""
    directory = tmp_path / "discovery"
    runtime = ["--discovery", "file", "--discovery-dir", str(directory)]
    # slow (a line ~1 s): the lines the router counts in flight on it are still running when
    # the kill lands
    victim, victim_id = await asyncio.to_thread(
        start_worker, "victim", runtime, tmp_path, "--speedup-ratio", "0.1"
    )
    discovery = FileDiscovery(str(directory), poll_interval_s=0.05)
    num = 16
    lines = [_line(f"req-{i}", f"turn {i}", 16) for i in range(num)]
    try:
        async with _stack(None, speedup=4, max_inflight=4, discovery=discovery) as stack:
            s, seen, client = stack
            assert victim_id in await s.instance_ids(MODEL)
            batch = await client.batches.create(
                input_file_id=await _upload(client, lines), endpoint=CHAT,
                completion_window="24h",
            )  # fmt: skip
            async with asyncio.timeout(30):
                while await _inflight_on(s, victim_id) == 0:  # noqa: ASYNC110 - over HTTP
                    await asyncio.sleep(0.01)
            victim.signal(signal.SIGKILL)  # lines in flight on it
            assert await asyncio.to_thread(victim.proc.wait, 10) == -signal.SIGKILL
            assert _completed(await client.batches.retrieve(batch.id)) < num
            num_seen = len(seen)
            done = await _wait(client, batch.id, "completed", timeout_s=45)
            assert done.request_counts is not None
            assert (done.request_counts.completed, done.request_counts.failed) == (num, 0)
            assert done.error_file_id is None
            out = await _lines(client, done.output_file_id)
            assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(num))
            for o in out:
                assert o["error"] is None and o["response"]["status_code"] == 200
                assert o["response"]["body"]["usage"]["completion_tokens"] == 16
            assert len(seen) > num_seen  # the survivor ran lines after the kill
    finally:
        victim.stop(grace_s=0)
        await discovery.close()
