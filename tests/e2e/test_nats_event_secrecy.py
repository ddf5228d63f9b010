"""Prompts do not leak over NATS: a frontend and two workers on `--events nats` with a cluster
secret, and a spy that subscribes to every subject on the same nats-server (as anyone who
can reach it could). The workers put each stored block's token ids in their KV events
(`--kv-events-token-ids`, as real engines do). The spy sees the KV events go by but cannot
find the prompt's token ids in them (nor the msgpack field names of a plain KV event), while
tandem's own subscribers decrypt them: each prompt's repeat is routed to the worker that
cached it."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import aiohttp
import msgspec
import nats
import pytest
from tests.support.services import Service, free_port
from tests.support.tandem_procs import MODEL, TandemProcess, start_tandem, wait_instances

from tandem.protocols import kv_events as kv
from tandem.runtime.events.envelope import EventOpener

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
BLOCK = 16


async def _complete(http: aiohttp.ClientSession, base: str, prompt: str) -> int:
    """Cached prompt tokens of one completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    async with http.post(f"{base}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        usage = (await r.json())["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def test_kv_events_on_nats_are_unreadable_without_the_secret(
    tmp_path: Path, nats_server: Service
) -> None:
    secret = secrets.token_hex(32)
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    flags = ["--namespace", "spy", "--discovery", "file", "--discovery-dir",
             str(tmp_path / "disc"), "--events", "nats", "--nats-url", nats_server.url,
             "--cluster-secret-file", str(secret_file)]  # fmt: skip
    spy = await nats.connect(nats_server.url)
    raw: list[tuple[str, bytes]] = []

    async def keep(msg: nats.aio.msg.Msg) -> None:
        raw.append((msg.subject, msg.data))

    await spy.subscribe(">", cb=keep)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs: list[TandemProcess] = []
    try:
        front_argv = ["frontend", "--port", str(port), "--router", "kv", *flags]
        procs.append(start_tandem("frontend", front_argv, tmp_path))
        for i in range(2):
            argv = ["worker", "--speedup-ratio", "0", "--block-size", str(BLOCK),
                    "--kv-events-token-ids", *flags]  # fmt: skip
            procs.append(start_tandem(f"worker{i}", argv, tmp_path))
        ids = {p.wait_log(r"worker ready: instance_id=(\w+)", timeout_s=40).group(1)
               for p in procs[1:]}  # fmt: skip
        wait_instances(base, lambda seen: seen == ids, timeout_s=30, proc=procs[0])

        prompts = [
            f"the secret plan number {i} is " + "alpha bravo charlie " * 12 for i in range(3)
        ]
        cached = []
        async with aiohttp.ClientSession() as http:
            for prompt in prompts:
                assert await _complete(http, base, prompt) == 0
                await asyncio.sleep(0.3)  # let the KV event reach the router
                cached.append(await _complete(http, base, prompt))
        assert all(n >= BLOCK for n in cached), cached  # each repeat found its holder
    finally:
        for proc in reversed(procs):
            proc.stop()
        await spy.close()

    opener = EventOpener(secret)
    stored: list[list[int]] = []
    kv_raw = [(s, d) for s, d in raw if s.endswith(".kv_events")]
    assert kv_raw, "the spy saw no KV events"
    for subject, data in kv_raw:
        payload = opener.open(subject, data)
        assert payload is not None  # tandem's own, sealed with the secret
        for event in kv.decode_batch(payload).events:
            if isinstance(event, kv.BlockStored) and event.token_ids:
                stored.append(event.token_ids)
                plain = msgspec.msgpack.encode(event.token_ids)
                assert plain not in data  # the ids' bytes as a plain event carries them
        assert b"token_ids" not in data and b"block_hashes" not in data
    assert stored, "no stored blocks with token ids were published"
    assert all(b"token_ids" not in d for _, d in raw)
