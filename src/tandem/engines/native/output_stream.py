"""Per-request hand-off of outputs from the engine thread to a `generate()` consumer."""

from __future__ import annotations

import asyncio
from collections import deque

from tandem.protocols.engine import EngineOutput


class OutputStream:
    """One producer (callbacks on the event loop), one consumer. Bounded by max_tokens:
    a request gets at most one output per step."""

    __slots__ = ("_outputs", "_ready")

    def __init__(self) -> None:
        self._outputs: deque[EngineOutput] = deque()
        self._ready = asyncio.Event()

    def push(self, output: EngineOutput) -> None:
        self._outputs.append(output)
        self._ready.set()

    async def get(self) -> EngineOutput:
        """All outputs queued so far, merged into one (waits for at least one)."""
        if not self._outputs:
            self._ready.clear()
            await self._ready.wait()
        outputs = list(self._outputs)
        self._outputs.clear()
        return merge_outputs(outputs)


def merge_outputs(outputs: list[EngineOutput]) -> EngineOutput:
    """Tokens and logprobs of consecutive outputs in one; the first's cached count, the
    finishing one's reason (anything after it dropped)."""
    if len(outputs) == 1:
        return outputs[0]
    merged = EngineOutput(token_ids=[])
    for out in outputs:
        merged.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            merged.logprobs = (merged.logprobs or []) + out.logprobs
            merged.top_logprobs = (merged.top_logprobs or []) + (out.top_logprobs or [])
        if merged.num_cached_tokens is None:
            merged.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None:
            merged.finish_reason, merged.error = out.finish_reason, out.error
            break
    return merged
