"""`eventually`: wait for state that other tasks change, with a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(
    pred: Callable[[], bool], timeout_s: float = 5.0, poll_s: float = 0.005
) -> None:
    """Return once `pred()` is true; TimeoutError after `timeout_s`. For state spread over
    several tasks with no single event to wait on."""
    async with asyncio.timeout(timeout_s):
        while not pred():  # noqa: ASYNC110 - state spread over several tasks
            await asyncio.sleep(poll_s)
