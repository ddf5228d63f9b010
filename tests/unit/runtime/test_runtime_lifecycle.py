from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tandem.runtime.lifecycle import install_signal_handlers

pytestmark = pytest.mark.timeout(10)


async def test_sigterm_sets_the_stop_event() -> None:
    stop = asyncio.Event()
    install_signal_handlers(stop)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 2)
    finally:
        loop = asyncio.get_running_loop()
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGINT)
