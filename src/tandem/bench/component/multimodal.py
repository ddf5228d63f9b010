"""`tandem bench multimodal`: the encode stage, embedding transfer and E/PD vs EPD.

1. encoder: ms per image of the classifier-bridge encoder (MobileNetV2 + bridge), batches of 1
   and 16 real photos.
2. transfer: ms to pull embeddings from an encode-worker process (`EmbeddingSender`) into this
   process's receive pool (`EmbeddingReceiver`), per backend (shm, tcp, nixl when installed), for
   1 and 16 SmolLM2-sized images (50×576 float32 each) and one 3.7 MB tensor; the control
   handshake and the copy out of the pool are included.
3. ttft: `tandem serve --engine mocker` EPD (each worker's simulated encode stalls its steps) vs
   E/PD (simulated encode workers), the same mixed load of text-only and one-image chats
   (distinct images, no cache hits); TTFT p50/p99 per class. Then, on E/PD, the TTFT of a
   repeated image (embedding cache + prefix hit) against first sight.

    tandem bench multimodal [--parts encoder,transfer,ttft] [--requests 200] [--rate 20] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # aiohttp loads with the ttft part
    import aiohttp

ROWS, HIDDEN = 50, 576
BIG_ROWS = 1606  # 1606 × 576 × 4 B = 3.70 MB, the tensor size Dynamo publishes figures for


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ------------------------------------------------------------------ 1. encoder
def bench_encoder(iters: int, threads: int) -> dict[str, float]:
    import torch

    from tandem.multimodal.encoder.classifier_bridge import load_classifier_bridge
    from tandem.multimodal.image import decode_image

    torch.set_num_threads(threads)
    encoder = load_classifier_bridge()
    photos = [decode_image(_skimage_photo(n)) for n in ("chelsea.png", "coffee.png")]
    out: dict[str, float] = {}
    for batch in (1, 16):
        images = [photos[i % 2] for i in range(batch)]
        encoder.encode(images)  # warm-up: oneDNN builds its kernels for this shape
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            encoder.encode(images)
            times.append(time.perf_counter() - start)
        out[f"batch{batch}_ms_per_image"] = statistics.median(times) * 1e3 / batch
    return out


def _skimage_photo(name: str) -> bytes:
    """A photo of scikit-image's data folder (located, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the encoder bench needs scikit-image's photos: pip install scikit-image")
    with open(os.path.join(next(iter(spec.submodule_search_locations)), "data", name), "rb") as f:
        return f.read()


# ------------------------------------------------------------------ 2. transfer
def _owner(conn: Connection, backend: str, rows: int) -> None:
    from tandem.multimodal.embedding_transfer import EmbeddingSender
    from tandem.transfer import TransferAgent, TransferAgentConfig

    config = TransferAgentConfig(agent_id="bench-encoder", backends=(backend,))
    with TransferAgent(config) as agent:
        sender = EmbeddingSender(agent, slot_bytes=rows * HIDDEN * 4, num_slots=64, ttl_s=60)
        rng = np.random.default_rng(0)
        conn.send(agent.backend_names)
        while (count := conn.recv()) is not None:
            embs = [rng.standard_normal((rows, HIDDEN), dtype=np.float32) for _ in range(count)]
            conn.send(sender.offer(embs, list(range(count))))


def bench_transfer(iters: int) -> list[dict[str, Any]]:
    from tandem.multimodal.embedding_transfer import EmbeddingReceiver
    from tandem.transfer import TransferAgent, TransferAgentConfig
    from tandem.transfer.registry import installed_backends

    rows_list: list[tuple[int, int]] = [(ROWS, 1), (ROWS, 16), (BIG_ROWS, 1)]
    results = []
    for backend in installed_backends(("shm", "nixl", "tcp"), agent_id="bench"):
        for rows, count in rows_list:
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_owner, args=(child, backend, rows), daemon=True)
            proc.start()
            try:
                parent.recv()
                config = TransferAgentConfig(agent_id="bench-receiver", backends=(backend,))
                with TransferAgent(config) as agent:
                    receiver = EmbeddingReceiver(agent, num_slots=32)
                    times = []
                    for i in range(iters + 1):
                        parent.send(count)
                        handles = parent.recv()
                        start = time.perf_counter()
                        receiver.pull(handles, timeout_s=30)
                        if i:  # the first pull registers the receive pool
                            times.append(time.perf_counter() - start)
                parent.send(None)
            finally:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
            mb = rows * HIDDEN * 4 * count / 1e6
            ms = statistics.median(times) * 1e3
            results.append({"backend": backend, "images": count, "rows": rows, "mb": mb,
                            "ms": ms, "ms_per_mb": ms / mb})  # fmt: skip
    return results


# ------------------------------------------------------------------ 3. ttft
def _data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


def _synthetic_png(seed: int, size: int = 64) -> bytes:
    import io

    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


async def _ttft(
    session: aiohttp.ClientSession, url: str, image: bytes | None, question: str
) -> float:
    content: str | list[dict[str, Any]] = question
    if image is not None:
        content = [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                   {"type": "text", "text": question}]  # fmt: skip
    body = {"model": "smollm2", "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip
    start = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        ttft = float("nan")
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content"' in line and ttft != ttft:
                ttft = time.perf_counter() - start
        return ttft


async def _mixed_load(url: str, requests: int, rate: float, seed0: int) -> dict[str, list[float]]:
    import aiohttp

    rng = np.random.default_rng(seed0)
    out: dict[str, list[float]] = {"text": [], "image": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def one(i: int) -> None:
            is_image = i % 2 == 1
            image = _synthetic_png(seed0 * 100_000 + i) if is_image else None
            ttft = await _ttft(session, url, image, f"Question {i}: what do you see?")
            out["image" if is_image else "text"].append(ttft * 1e3)

        tasks = []
        for i in range(requests):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        await asyncio.gather(*tasks)
    return out


async def _repeat_effect(url: str, n: int) -> dict[str, float]:
    import aiohttp

    first, again = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for i in range(n):
            image = _synthetic_png(900_000 + i)
            first.append(await _ttft(session, url, image, "What is this?") * 1e3)
            again.append(await _ttft(session, url, image, "What is this?") * 1e3)
    return {"first_sight_ttft_ms_p50": statistics.median(first),
            "repeat_ttft_ms_p50": statistics.median(again)}  # fmt: skip


def bench_ttft(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.bench.process_stack import ProcessStack, free_port, tandem_argv, wait_ready

    mocker = ["--engine", "mocker", "--workers", str(args.workers), "--router", "kv",
              "--mm-num-tokens-per-image",
              str(ROWS), "--mm-encode-ms-per-image", str(args.encode_ms)]  # fmt: skip
    stacks = {
        "EPD": [],
        "E/PD": ["--encode-workers", str(args.encode_workers), "--encoder-args",
                 f"--mm-encoder sim --mm-sim-ms-per-image {args.encode_ms} --mm-sim-base-ms 1"],
    }  # fmt: skip
    results: dict[str, Any] = {}
    for i, (name, extra) in enumerate(stacks.items()):
        port = free_port()
        log_dir = tempfile.mkdtemp(prefix="tandem-bench-mm-")
        with ProcessStack(log_dir) as stack:
            stack.spawn("serve", tandem_argv("serve", "--port", str(port), *mocker, *extra))
            url = f"http://127.0.0.1:{port}"
            asyncio.run(wait_ready(url, timeout_s=120, stack=stack))
            if extra:  # the encode workers register after the frontend is up
                _wait_log(os.path.join(log_dir, "serve.log"), "tandem serve ready")
            load = asyncio.run(_mixed_load(url, args.requests, args.rate, seed0=i + 1))
            row = {f"{cls}_ttft_ms_{q}": _pct(v, int(q[1:])) for cls, v in load.items()
                   for q in ("p50", "p99")}  # fmt: skip
            if extra:
                row |= asyncio.run(_repeat_effect(url, 10))
            results[name] = row
    return results


def _wait_log(path: str, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                if text in f.read():
                    return
        time.sleep(0.1)
    raise TimeoutError(f"{path} never logged {text!r}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tandem bench multimodal",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--parts", default="encoder,transfer,ttft")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--encoder-threads", type=int, default=1, help="encoder: torch threads (as the worker)"
    )
    parser.add_argument("--requests", type=int, default=200, help="ttft: requests per stack")
    parser.add_argument("--rate", type=float, default=20.0, help="ttft: requests/s (Poisson)")
    parser.add_argument("--workers", type=int, default=2, help="ttft: LM workers per stack")
    parser.add_argument("--encode-workers", type=int, default=2, help="ttft: E/PD encoders")
    parser.add_argument(
        "--encode-ms", type=float, default=40.0, help="ttft: simulated ms per image (both stacks)"
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {"load_average": os.getloadavg()}
    if "encoder" in parts:
        report["encoder"] = bench_encoder(args.iters, args.encoder_threads)
        print("encoder:", json.dumps(report["encoder"]))
    if "transfer" in parts:
        report["transfer"] = bench_transfer(args.iters)
        for row in report["transfer"]:
            print(
                f"transfer {row['backend']:5s} {row['images']:2d} x {row['rows']} rows "
                f"({row['mb']:.2f} MB): {row['ms']:.3f} ms, {row['ms_per_mb']:.3f} ms/MB"
            )
    if "ttft" in parts:
        report["ttft"] = bench_ttft(args)
        for name, row in report["ttft"].items():
            print(f"ttft {name}: " + ", ".join(f"{k}={v:.1f}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
