"""A tiny OpenAI-style SSE server for load-generator tests (aiohttp.web on port 0).

Completions stream: a text-less first chunk, `num_tokens` text chunks `token_gap_s` apart
(the first after `first_token_delay_s`), a usage chunk, then [DONE]. Usage reports
prompt_tokens = prompt length and cached_tokens = prompt length // 2. Model "bad" → 400.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import pytest
from aiohttp import web


@dataclass
class FakeOpenAI:
    num_tokens: int = 4
    first_token_delay_s: float = 0.05
    token_gap_s: float = 0.02
    cpu_burn_s: float = 0.0
    peers: set = field(default_factory=set)
    bodies: list = field(default_factory=list)
    runner: web.AppRunner | None = None
    port: int = 0

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.peers.add(request.transport.get_extra_info("peername"))
        body = await request.json()
        self.bodies.append(body)
        burn_until = time.process_time() + self.cpu_burn_s
        while time.process_time() < burn_until:
            pass
        if body["model"] == "bad":
            return web.json_response({"error": {"message": "bad model"}}, status=400)
        prompt = body.get("prompt") or body["messages"][0]["content"].split()
        chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: object) -> None:
            data = f"data: {json.dumps(obj)}\n\n".encode()
            half = len(data) // 2  # split events across writes, as real servers do
            await resp.write(data[:half])
            await resp.write(data[half:])

        def choice(text: str) -> dict:
            return {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}

        await send({"choices": [{"index": 0, "delta": {"role": "assistant"}, "text": ""}]})
        await asyncio.sleep(self.first_token_delay_s)
        for i in range(self.num_tokens):
            if i:
                await asyncio.sleep(self.token_gap_s)
            await send({"choices": [choice(f" t{i}")]})
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": self.num_tokens,
            "prompt_tokens_details": {"cached_tokens": len(prompt) // 2},
        }
        await send({"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
async def fake_openai():
    server = FakeOpenAI()
    await server.start()
    yield server
    await server.stop()
