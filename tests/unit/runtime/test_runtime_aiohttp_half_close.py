"""The aiohttp servers (a process's --system-port server, the global router) answer a client
that shuts down its write side after its requests (`shutdown(SHUT_WR)`, `nc -N`): every
complete request, in order, then the close; at once when nothing is owed. On asyncio's loop and
uvloop (what the worker runs)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from typing import Any

import msgspec
import pytest
import uvloop
from aiohttp import web

from tandem.planner.global_router.app import GlobalRouterApp
from tandem.planner.global_router.config import GlobalRouterConfig, GlobalRouterFile
from tandem.runtime import aiohttp_half_close as half_close
from tandem.runtime.aiohttp_half_close import serve_app
from tandem.runtime.system_server import SystemServer

pytestmark = pytest.mark.timeout(60)
LOOPS = pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop],
                                ids=["asyncio", "uvloop"])  # fmt: skip
PROMPT_CLOSE_S = 2.0  # not the keep-alive timeout (75 s and more)
CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
POST_CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n%s" % (
    len(CHAT), CHAT)  # fmt: skip


def _run(
    new_loop: Callable[[], asyncio.AbstractEventLoop], main: Coroutine[Any, Any, None]
) -> None:
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main)


def _exchange(addr: tuple[str, int], sent: bytes) -> tuple[bytes, float]:
    """Send `sent`, shut down the write side, read until the server closes (bounded): what
    came back and how long the close took."""
    with socket.create_connection(addr, timeout=5) as sock:
        sock.sendall(sent)
        sock.shutdown(socket.SHUT_WR)
        start, chunks = time.monotonic(), []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            chunks.append(b"<no close>")
        except ConnectionResetError:
            chunks.append(b"<reset>")
        return b"".join(chunks), time.monotonic() - start


def _responses(data: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each response in `data`, in order (chunked bodies joined)."""
    out = []
    while data:
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, f"truncated response head: {head!r}"
        status, *lines = head.split(b"\r\n")
        headers = dict(line.lower().split(b": ", 1) for line in lines)
        if b"content-length" in headers:
            n = int(headers[b"content-length"])
            body, data = data[:n], data[n:]
        else:
            assert headers.get(b"transfer-encoding") == b"chunked", head
            body = b""
            while True:
                size, _, data = data.partition(b"\r\n")
                chunk, data = data[: int(size, 16)], data[int(size, 16) + 2 :]
                if not chunk:
                    break
                body += chunk
        out.append((int(status.split()[1]), body))
    return out


async def _check(addr: tuple[str, int], sent: bytes, expected: list[tuple[int, bytes]]) -> None:
    data, took_s = await asyncio.to_thread(_exchange, addr, sent)
    assert not data.endswith((b"<no close>", b"<reset>")), data
    got = _responses(data)
    if len(got) == len(expected) + 1 and got[-1][0] == 405 and b"Content-Length: 9" in sent:
        got.pop()  # half a body to a GET-only route: 405 needs no body, may precede the EOF
    assert [s for s, _ in got] == [s for s, _ in expected], data
    for (_, body), (_, part) in zip(got, expected, strict=True):
        assert part in body, (part, body)
    assert took_s < PROMPT_CLOSE_S, f"closed {took_s:.1f} s after the client's EOF"


def _get(path: bytes, extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: h\r\n%s\r\n" % (path, extra)


SYSTEM_CASES = {
    "get": (_get(b"/live"), [(200, b'"live"')]),
    "get-connection-close": (_get(b"/metrics", b"Connection: close\r\n"), [(200, b"up 1")]),
    "http-1.0": (b"GET /live HTTP/1.0\r\n\r\n", [(200, b'"live"')]),
    "post-with-body": (
        b"POST /live HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello",
        [(405, b"")],
    ),
    "pipelined": (
        _get(b"/live") + _get(b"/health") + _get(b"/metrics") + _get(b"/nope"),
        [(200, b'"live"'), (503, b'"warming"'), (200, b"up 1"), (404, b"")],
    ),
    "pipelined-then-half-a-body": (
        _get(b"/live") + b"POST /live HTTP/1.1\r\nHost: h\r\nContent-Length: 9\r\n\r\nhal",
        [(200, b'"live"')],
    ),
    "half-a-head": (b"GET /live HTTP/1.1\r\nHost:", []),
    "half-a-body": (b"POST /live HTTP/1.1\r\nHost: h\r\nContent-Length: 9\r\n\r\nhal", []),
    "nothing": (b"", []),
}


@LOOPS
@pytest.mark.parametrize("case", list(SYSTEM_CASES))
def test_system_server_answers_a_half_closed_client(new_loop: Any, case: str) -> None:
    sent, expected = SYSTEM_CASES[case]

    async def main() -> None:
        server = SystemServer(
            metrics=lambda: b"up 1\n", health=lambda: (False, {"status": "warming"})
        )
        addr = await server.start("127.0.0.1", 0)
        try:
            await _check(addr, sent, expected)
        finally:
            await server.close()

    _run(new_loop, main())


@LOOPS
def test_system_server_closes_an_idle_connection_at_eof(new_loop: Any) -> None:
    async def main() -> None:
        server = SystemServer(metrics=lambda: b"", health=lambda: (True, {}))
        addr = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(_get(b"/live"))
        assert (await asyncio.wait_for(reader.readuntil(b'"live"}'), 5)).startswith(b"HTTP/1.1 200")
        writer.write_eof()  # nothing owed
        assert await asyncio.wait_for(reader.read(), PROMPT_CLOSE_S) == b""
        writer.close()
        await server.close()

    _run(new_loop, main())


class _Pool:
    """A stand-in pool frontend: answers chat after a moment (the client's EOF arrives while
    the router waits on it)."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy", "namespace": "fast"})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "pool-model"}]})

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(0.2)
        return web.json_response({"object": "chat.completion", "echo": body["messages"][0]})


def _router_app(pool_url: str) -> web.Application:
    pool = {"name": "fast", "namespace": "fast", "url": pool_url}
    grid = {"ttft_ms": [200], "itl_ms": [50], "pools": [["fast"]]}
    raw = msgspec.convert({"pools": [pool], "aggregated": grid}, GlobalRouterFile)
    return GlobalRouterApp(GlobalRouterConfig(raw), tokenizer=None, api_keys=()).app()


ROUTER_CASES = {
    "get": (_get(b"/live"), [(200, b'"live"')]),
    "get-connection-close": (_get(b"/v1/models", b"Connection: close\r\n"), [(200, b"pool-model")]),
    "post-with-body": (POST_CHAT, [(200, b'"content": "hi"')]),
    "pipelined": (
        _get(b"/live") + POST_CHAT + _get(b"/v1/models") + POST_CHAT,
        [(200, b'"live"'), (200, b"chat.completion"), (200, b"pool-model"), (200, b"chat.")],
    ),
    "half-a-body": (POST_CHAT[:-9], []),
    "half-a-head": (b"GET /live HTTP/1.1\r\nHost:", []),
}


@LOOPS
@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_global_router_answers_a_half_closed_client(new_loop: Any, case: str) -> None:
    sent, expected = ROUTER_CASES[case]

    async def main() -> None:
        async with AsyncExitStack() as stack:
            pool = web.AppRunner(_Pool().app())
            await pool.setup()
            stack.push_async_callback(pool.cleanup)
            site = web.TCPSite(pool, "127.0.0.1", 0)
            await site.start()
            host, port = pool.addresses[0][:2]
            app = _router_app(f"http://{host}:{port}")
            bound: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
            stop = asyncio.Event()
            serving = asyncio.create_task(
                serve_app(app, "127.0.0.1", 0, started=bound.set_result, stop=stop)
            )
            try:
                await _check(await asyncio.wait_for(bound, 10), sent, expected)
            finally:
                stop.set()
                await asyncio.wait_for(serving, 10)

    _run(new_loop, main())


def test_an_aiohttp_without_the_internals_gets_the_stock_handler(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(half_close, "_HANDLER_ATTRS", (*half_close._HANDLER_ATTRS, "_gone"))
    monkeypatch.setattr(half_close, "_warned", False)

    async def main() -> None:
        server = SystemServer(metrics=lambda: b"", health=lambda: (True, {}))
        addr = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(_get(b"/live"))  # still served, as stock aiohttp serves it
        assert (await asyncio.wait_for(reader.readuntil(b'"live"}'), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
        await server.close()

    _run(asyncio.new_event_loop, main())
    assert "RequestHandler lacks _gone: half-closed clients may get no answer" in caplog.text
