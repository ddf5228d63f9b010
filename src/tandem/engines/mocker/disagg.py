"""`MockerKvHandoff`: the mocker's side of a disaggregated KV handoff (no KV bytes).

Implements `tandem.engines.handoff.KvHandoff` over the mocker `Scheduler`'s pins and held
sequences. The transfer itself is simulated: the worker still runs a transfer-agent
operation over one byte per block (so claims, acks, expiry and failures behave as for a
real engine) and then waits `transfer_delay_s` = tokens × kv_bytes_per_token / bandwidth
(divided by the speedup ratio). A resumed request continues the same pseudo-token stream
the aggregated mocker would produce for its prompt.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tandem.engines.handoff import FetchFigures
from tandem.engines.mocker.admission import make_sequence
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.mocker.scheduler import Scheduler
from tandem.engines.mocker.sequence import request_seed
from tandem.engines.output_stream import DirectSink
from tandem.errors import Overloaded
from tandem.protocols.engine import EngineOutput, PreprocessedRequest

PIN_TIMEOUT_S = 5.0  # a connection thread's wait for the engine loop to pin a peer's blocks


class MockerKvHandoff:
    """Create on the engine's event loop after `engine.start()`."""

    def __init__(self, engine: MockerEngine) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def kv_cache_spec(self) -> None:
        return None

    def adopt_kv_cache(self, tensor: Any) -> None:
        raise NotImplementedError("the mocker has no KV tensor")

    def fetch_figures(self) -> FetchFigures:
        """The simulated figures: the config's KV size and bandwidth, the perf model's
        prefill time per token (of a 2048-token pass), both scaled by the speedup ratio."""
        c = self.engine.config
        speedup = c.speedup_ratio or 1e6  # 0: as fast as possible
        tokens = 2048
        perf = self.scheduler.perf
        prefill_ms = perf.step_ms(tokens, 0, 0, 0.0) - perf.step_ms(0, 0, 0, 0.0)
        return FetchFigures(
            bytes_per_token=c.kv_bytes_per_token,
            bandwidth_bytes_per_s=c.kv_transfer_bandwidth_gbps * 1e9 * speedup,
            prefill_s_per_token=prefill_ms / 1e3 / tokens / speedup,
        )

    def transfer_delay_s(self, num_tokens: int) -> float:
        c = self.engine.config
        if c.speedup_ratio == 0:
            return 0.0
        seconds = num_tokens * c.kv_bytes_per_token / (c.kv_transfer_bandwidth_gbps * 1e9)
        return seconds / c.speedup_ratio

    def _on_loop(self, fn: Any, *args: Any) -> None:
        """Run on the engine's loop: the scheduler is not thread-safe."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------------ prefill side
    async def prefill(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        stop = msgspec.structs.replace(request.stop, max_tokens=1, min_tokens=0)
        rid = request.request_id
        self.scheduler.pin_on_finish.add(rid)
        try:
            async for out in self.engine.generate(msgspec.structs.replace(request, stop=stop)):
                yield out
        finally:
            self.scheduler.pin_on_finish.discard(rid)

    def pinned_blocks(self, request_id: str) -> list[int]:
        return list(self.scheduler.pins[request_id])

    def unpin(self, request_id: str) -> None:
        self._on_loop(self.scheduler.unpin, request_id)

    def pin_cached(self, request_id: str, block_hashes: list[int]) -> list[int]:
        def pin() -> list[int]:
            sched = self.scheduler
            if request_id in sched.pins:
                raise ValueError(f"request_id={request_id} already holds pinned blocks")
            blocks = sched.pool.match_prefix(block_hashes)
            if blocks:
                sched.pool.acquire(blocks)
                sched.pins[request_id] = list(blocks)
            return list(blocks)

        if threading.get_ident() == self._loop_thread:
            return pin()

        async def on_loop() -> list[int]:
            return pin()

        return asyncio.run_coroutine_threadsafe(on_loop(), self._loop).result(PIN_TIMEOUT_S)

    # ------------------------------------------------------------------ decode side
    async def cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        return len(self.scheduler.pool.match_prefix(block_hashes))

    async def allocate(
        self,
        request: PreprocessedRequest,
        num_tokens: int,
        *,
        prefix_only: bool = False,
        num_cached_blocks: int = 0,
    ) -> list[int]:
        sched = self.scheduler
        seq = make_sequence(sched.config, request, {**sched.held})
        # the prefill's first token, when given (a peer fetch's tokens beyond stay prompt)
        extra = 0 if prefix_only else seq.num_prompt_tokens - num_tokens
        if extra > 0:  # continue the stream the prompt alone seeds, as aggregated would
            seq.num_prompt_tokens = num_tokens
            seq.max_tokens += extra
            seq.min_tokens += extra
            prompt = msgspec.structs.replace(request, token_ids=request.token_ids[:num_tokens])
            seq.seed = request_seed(prompt)
        blocks = sched.hold(seq, num_tokens, num_cached_blocks)
        if blocks is None:
            raise Overloaded(
                f"decode worker has {sched.pool.num_allocatable_blocks} free KV blocks; "
                f"request_id={request.request_id} needs more"
            )
        return blocks

    def release(self, request_id: str) -> None:
        self._on_loop(self.scheduler.release_held, request_id)

    def resume(
        self,
        request: PreprocessedRequest,
        num_computed: int,
        *,
        direct: DirectSink | None = None,
    ) -> AsyncIterator[EngineOutput]:
        def install(sched: Scheduler) -> None:
            held = sched.held.get(request.request_id)
            if held is not None and len(request.token_ids) > len(held.token_ids):
                # decode-first: the prefill's first token(s), already sent, count as output
                held.token_ids.extend(request.token_ids[len(held.token_ids) :])
            sched.resume(request.request_id, num_computed)

        return self.engine.generate(request, install=install, direct=direct)
