"""E/PD and E/P/D (issue 15) as real `tandem serve` process trees, against EPD.

Exactness matrix: greedy answers about real scikit-image photos are identical in EPD (each worker
encodes), E/PD (encode worker + aggregated worker), E/P/D prefill-first and E/P/D decode-first,
both on the first sight of each image (encoded remotely, pulled through shm) and on a second
question about it (the worker's embedding cache answers; the encode worker sees no new image).
Faults: an encode worker killed mid-request fails over to the other encoder; with every encoder
gone the request is a clear 503 within the encode timeout; an embedding that expired before the
pull (TTL) is encoded locally by the worker; no embedding outlives its TTL on the encoder."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tests.support.images import data_url, photo_bytes
from tests.support.services import free_port
from tests.support.tandem_procs import MODEL, TandemProcess, http_request, start_tandem

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

PHOTOS = ("chelsea.png", "coffee.png", "rocket.jpg")
FIRST, SECOND = "What is in this picture?", "Describe the picture in one sentence."
WORKER_FLAGS = ["--kv-cache-memory-gb", "0.25", "--max-num-seqs", "8"]
_answers: dict[str, dict[tuple[str, str], str]] = {}


class Stack:
    def __init__(self, proc: TandemProcess, port: int, run_dir: Path) -> None:
        self.proc, self.base_url, self.run_dir = proc, f"http://127.0.0.1:{port}", run_dir

    def ask(self, photo: str, question: str, max_tokens: int = 16) -> tuple[int, dict[str, Any]]:
        parts = [
            {"type": "image_url", "image_url": {"url": data_url(photo_bytes(photo), _mime(photo))}},
            {"type": "text", "text": question},
        ]
        body = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": parts}]}  # fmt: skip
        status, _, raw = http_request(f"{self.base_url}/v1/chat/completions", body, timeout_s=180)
        return status, json.loads(raw)

    def answer(self, photo: str, question: str) -> str:
        status, out = self.ask(photo, question)
        assert status == 200, out
        return str(out["choices"][0]["message"]["content"])

    def encoder_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"started encoder\d+ pid=(\d+)", self.proc.log())]

    def encoder_stats(self) -> list[dict[str, Any]]:
        return asyncio.run(_encoder_stats(self.run_dir))


async def _encoder_stats(run_dir: Path) -> list[dict[str, Any]]:
    """Each live encode worker's counters, asked over the request plane (`mm_stats`) with the
    stack's cluster secret (its discovery records and workers refuse anyone without it)."""
    from tandem.protocols.engine import PreprocessedRequest, StopConditions, decode_output, encode
    from tandem.runtime.config import RuntimeConfig
    from tandem.runtime.runtime import open_runtime

    config = RuntimeConfig(
        discovery="file",
        discovery_dir=str(run_dir / "discovery"),
        events="memory",
        cluster_secret=(run_dir / "cluster-secret").read_text().strip(),
    )
    async with open_runtime(config) as runtime:
        view = runtime.instance_set("encoder", "encode")
        await view.start()
        await asyncio.sleep(0.3)  # the file watch lists what is there on its first scan
        stats = []
        for instance in list(view.instances.values()):
            ask = PreprocessedRequest(
                request_id="stats",
                model=MODEL,
                token_ids=[],
                stop=StopConditions(max_tokens=1),
                annotations=["mm_stats"],
            )
            async with runtime.stream(instance, encode(ask), request_id="stats") as stream:
                out = decode_output(await anext(stream))
            stats.append(out.disagg_params or {})
        await view.close()
        return stats


def _start(tmp: Path, *flags: str) -> Iterator[Stack]:
    port = free_port()
    args = ["serve", "--engine", "native", "--port", str(port), "--run-dir", str(tmp / "run")]
    proc = start_tandem("serve", [*args, *flags, *WORKER_FLAGS], tmp)
    try:
        proc.wait_log(r"tandem serve ready", timeout_s=300)
        yield Stack(proc, port, tmp / "run")
    finally:
        pids = re.findall(r"started \w+ pid=(\d+)", proc.log())
        code = proc.stop()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    assert code == 0, proc.log()[-3000:]


def _matrix(stack: Stack, name: str) -> dict[tuple[str, str], str]:
    answers = {(p, FIRST): stack.answer(p, FIRST) for p in PHOTOS}
    answers |= {(p, SECOND): stack.answer(p, SECOND) for p in PHOTOS}
    _answers[name] = answers
    return answers


@pytest.fixture(scope="module")
def epd_answers(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    for stack in _start(tmp_path_factory.mktemp("epd"), "--workers", "1"):
        answers = _matrix(stack, "EPD")
    assert "cat" in answers[("chelsea.png", FIRST)].lower()
    assert answers[("chelsea.png", FIRST)] != answers[("coffee.png", FIRST)]
    return answers


@pytest.mark.parametrize(
    ("name", "flags"),
    [
        ("E/PD", ["--encode-workers", "1", "--workers", "1"]),
        ("E/P/D prefill-first", ["--encode-workers", "1", "--prefill-workers", "1",
                                 "--decode-workers", "1", "--disagg-min-prefill-tokens", "1"]),
        ("E/P/D decode-first", ["--encode-workers", "1", "--prefill-workers", "1",
                                "--decode-workers", "1", "--disagg-min-prefill-tokens", "1",
                                "--disagg-flow", "decode-first"]),
    ],
)  # fmt: skip
def test_greedy_answers_match_epd(
    name: str, flags: list[str], epd_answers: dict[tuple[str, str], str], tmp_path: Path
) -> None:
    for stack in _start(tmp_path, *flags):
        answers = _matrix(stack, name)
        [stats] = stack.encoder_stats()
    assert answers == epd_answers, name
    # the second question about each photo came from the worker's embedding cache
    assert stats["num_images"] == len(PHOTOS), stats
    assert stats["num_held_embeddings"] == 0, stats


def test_killed_encoder_fails_over_and_none_left_is_503(
    epd_answers: dict[tuple[str, str], str], tmp_path: Path
) -> None:
    flags = ["--encode-workers", "2", "--workers", "1", "--no-mm-local-fallback",
             "--mm-encode-timeout-s", "90",
             "--encoder-args", "--mm-encoder-batch-wait-ms 3000"]  # fmt: skip
    for stack in _start(tmp_path, *flags):
        victim, survivor = stack.encoder_pids()
        with ThreadPoolExecutor(2) as pool:
            asked = [pool.submit(stack.ask, p, FIRST) for p in PHOTOS[:2]]
            # both requests now wait in their encoders' batch window (one each: least in flight)
            _wait_queued(stack, 2)
            os.kill(victim, signal.SIGKILL)
            results = [f.result() for f in asked]
        for photo, (status, out) in zip(PHOTOS[:2], results, strict=True):
            assert status == 200, out
            assert out["choices"][0]["message"]["content"] == epd_answers[(photo, FIRST)]
        os.kill(survivor, signal.SIGKILL)
        started = time.monotonic()
        status, out = stack.ask(PHOTOS[2], FIRST)
        assert status == 503, out
        assert time.monotonic() - started < 30, "the 503 came after the encode timeout"
        # the worker's reason; the frontend, which tried every worker, answers its own 503
        assert "no encode worker (component 'encoder') encoded" in stack.proc.log()


def _wait_queued(stack: Stack, n: int) -> None:
    deadline = time.monotonic() + 30
    while sum(s["num_queued_images"] for s in stack.encoder_stats()) < n:
        assert time.monotonic() < deadline, "the images never reached the encoders"


def test_expired_embedding_is_encoded_locally(
    epd_answers: dict[tuple[str, str], str], tmp_path: Path
) -> None:
    flags = ["--encode-workers", "1", "--workers", "1",
             "--encoder-args", "--mm-embedding-ttl-s 0.001"]  # fmt: skip
    for stack in _start(tmp_path, *flags):
        assert stack.answer("coffee.png", FIRST) == epd_answers[("coffee.png", FIRST)]
        [stats] = stack.encoder_stats()
        log = stack.proc.log()
    assert "remote encode failed" in log and "encoding locally" in log
    assert stats["num_images"] == 1 and stats["num_held_embeddings"] == 0, stats


def _mime(photo: str) -> str:
    return "image/jpeg" if photo.endswith(".jpg") else "image/png"
