"""Headless Chromium (Debian's `chromium` package) driven over the DevTools protocol.

`open_page(url, tmp)` starts one browser on a private profile with `--remote-debugging-port=0`,
reads the port Chromium picked from `DevToolsActivePort`, and connects to its page's
websocket; `evaluate` runs JavaScript in the page, `screenshot` captures it as PNG. Stopped by
PID. Where Chromium is not installed the caller skips, unless TANDEM_REQUIRE_CHROMIUM=1
(CI installs it; `.ci/run`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,900",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
]


def chromium_path() -> str:
    """The Chromium binary, or skip (fail under TANDEM_REQUIRE_CHROMIUM=1)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("TANDEM_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium is not installed (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return path


class Page:
    """One page's DevTools session; one task at a time."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws, self._ids = ws, itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self._ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        async with asyncio.timeout(10):
            while True:
                reply = json.loads((await self._ws.receive()).data)
                if reply.get("id") == msg_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return dict(reply["result"])

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode((await self.call("Page.captureScreenshot", format="png"))["data"])
        await asyncio.to_thread(path.write_bytes, data)
        return data


def _launch(url: str, profile: Path, log_path: Path) -> subprocess.Popen[bytes]:
    profile.mkdir()
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [chromium_path(), *FLAGS, f"--user-data-dir={profile}", url],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopped with all its helpers
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.asynccontextmanager
async def open_page(url: str, tmp: Path) -> AsyncIterator[Page]:
    profile = tmp / "chromium-profile"
    proc = _launch(url, profile, tmp / "chromium.log")
    try:
        port_file = profile / "DevToolsActivePort"
        async with asyncio.timeout(30):
            while not port_file.exists() or not port_file.read_text().strip():
                if proc.poll() is not None:
                    raise AssertionError(f"chromium exited: {(tmp / 'chromium.log').read_text()}")
                await asyncio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(30):
                while True:
                    async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                        pages = [p for p in await resp.json() if p.get("type") == "page"]
                    if pages:
                        break
                    await asyncio.sleep(0.05)
            async with session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield Page(ws)
    finally:
        await asyncio.to_thread(_stop, proc)
