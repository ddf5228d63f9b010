"""Child process for runtime tests: serve `t.backend.generate` over TCP, registered in file
discovery, until SIGTERM (then drain) or SIGKILL. The handler yields b"start", waits
`hold_s`, then yields b"end".

    python -m tests.support.runtime_worker <discovery-dir> <hold_s>
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

from tandem.runtime.base import RequestContext
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.lifecycle import serve_until_stopped
from tandem.runtime.runtime import open_runtime


async def main(directory: str, hold_s: float) -> None:
    async def generate(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        yield b"start"
        await asyncio.sleep(hold_s)
        yield b"end"

    cfg = RuntimeConfig(namespace="t", discovery="file", discovery_dir=directory)
    async with open_runtime(cfg) as runtime:
        await runtime.serve_endpoint("backend", "generate", generate, instance_id="w1")
        print("READY", flush=True)
        await serve_until_stopped(runtime, grace_s=10)
    print("EXITED", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2])))
