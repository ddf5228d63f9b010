"""The `tandem frontend` process: open the runtime, serve the frontend (`serve.py`) until
SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib

from tandem.errors import StartupError
from tandem.frontend.config import FrontendConfig
from tandem.frontend.serve import serve_frontend
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.runtime import open_runtime


async def run_frontend(config: FrontendConfig, runtime_config: RuntimeConfig) -> None:
    """The `tandem frontend` process: open the runtime, serve until SIGTERM/SIGINT."""
    from tandem.runtime.lifecycle import install_signal_handlers

    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as resources:
        try:
            runtime = await resources.enter_async_context(open_runtime(runtime_config))
        except (OSError, ValueError) as exc:  # etcd or NATS not reachable, ...
            raise StartupError(f"cannot open the runtime: {exc}") from exc
        install_signal_handlers(stop)
        await serve_frontend(config, runtime, stop=stop)


def run(config: FrontendConfig, runtime_config: RuntimeConfig) -> int:
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(run_frontend(config, runtime_config))
    return 0
