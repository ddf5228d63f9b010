"""A simulated clock for mocker engines (`MockerEngine(clock=..., sleep=...)`): the step
loop's sleeps advance it at once, so each step lasts its modelled time exactly, however busy
the host is."""

from __future__ import annotations

import asyncio


class SimTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)
        await asyncio.sleep(0)
