"""Per-request hand-off of engine outputs from the step loop to a `generate()` consumer."""

from __future__ import annotations

import asyncio
from collections import deque

from tandem.protocols.engine import EngineOutput


class OutputStream:
    """Unbounded only in principle: a request gets at most one output per step and at most
    max_tokens steps produce one. One producer (step loop), one consumer."""

    __slots__ = ("_outputs", "_ready")

    def __init__(self) -> None:
        self._outputs: deque[EngineOutput] = deque()
        self._ready = asyncio.Event()

    def push(self, output: EngineOutput) -> None:
        self._outputs.append(output)
        self._ready.set()

    async def wait(self) -> None:
        if not self._outputs:
            self._ready.clear()
            await self._ready.wait()

    def take_all(self) -> list[EngineOutput]:
        outputs = list(self._outputs)
        self._outputs.clear()
        return outputs


def merge_outputs(outputs: list[EngineOutput]) -> EngineOutput:
    """One output carrying the tokens of several consecutive ones; the first one's cached
    count, the last one's finish reason (anything after a finished output is dropped)."""
    if len(outputs) == 1:
        return outputs[0]
    merged = EngineOutput(token_ids=[])
    for out in outputs:
        merged.token_ids.extend(out.token_ids)
        if merged.num_cached_tokens is None:
            merged.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None:
            merged.finish_reason, merged.error = out.finish_reason, out.error
            break
    return merged
