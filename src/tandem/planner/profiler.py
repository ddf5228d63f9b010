"""`profile_engine`: measure an engine over a grid and return its `EngineProfile`.

- prefill: for each ISL, one request of ISL fresh tokens (no prefix hits) and max_tokens 1,
  alone on the engine; the time to its first token (median of `repeats`).
- decode: for each (batch, context), `batch` requests of `context` fresh tokens each, decoding
  `decode_steps` + 2 tokens together; the ITL is the median over requests of their token gaps
  after the whole batch has its first token (steps that still prefill someone are excluded).
A grid point whose KV (batch × (context + steps)) exceeds the engine's capacity or whose batch
exceeds max_num_seqs is an error naming it, never silently skipped.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections.abc import Callable

from tandem.engines.base import Engine, EngineInfo
from tandem.engines.profile import DecodeGrid, EngineProfile, PrefillCurve
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions

logger = logging.getLogger(__name__)


class Prompts:
    """Fresh random prompts (so the prefix cache never helps) and unique request ids."""

    def __init__(self, vocab: tuple[int, int] = (100, 40_000), seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._vocab = vocab
        self._n = 0

    def request(self, model: str, num_tokens: int, max_tokens: int) -> PreprocessedRequest:
        self._n += 1
        return PreprocessedRequest(
            request_id=f"profile-{self._n}",
            model=model,
            token_ids=[self._rng.randrange(*self._vocab) for _ in range(num_tokens)],
            sampling=SamplingParams(temperature=0.0),
            stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        )


async def _token_times(
    engine: Engine, request: PreprocessedRequest, clock: Callable[[], float]
) -> list[float]:
    times: list[float] = []
    async for out in engine.generate(request):
        now = clock()
        times.extend(now for _ in out.token_ids)
        if out.finish_reason is not None:
            if out.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"profile request ended with {out.finish_reason}: {out.error}")
            break
    return times


def check_grid(info: EngineInfo, batches: list[int], contexts: list[int], steps: int) -> None:
    capacity = info.num_total_blocks * info.block_size
    for b in batches:
        if b > info.max_num_seqs:
            raise ValueError(f"batch {b} exceeds the engine's max_num_seqs {info.max_num_seqs}")
        for c in contexts:
            need = b * (c + steps + 2 + info.block_size)
            if need > capacity:
                raise ValueError(
                    f"batch {b} × context {c} needs ~{need} KV tokens; the engine holds "
                    f"{capacity}: lower --batch/--context or give the engine more blocks"
                )
    if max(contexts) + steps + 2 > info.context_length:
        raise ValueError(f"context {max(contexts)} exceeds the model's {info.context_length}")


def decode_itl_ms(runs: list[list[float]]) -> float:
    """Median per-request token gap once every request of the batch has its first token
    (before that, steps also carry other requests' prefill chunks)."""
    all_started = max(t[0] for t in runs)
    gaps = []
    for times in runs:
        after = [t for t in times if t >= all_started]
        if len(after) >= 2:
            gaps.append((after[-1] - after[0]) / (len(after) - 1) * 1000.0)
    if not gaps:
        raise RuntimeError("no decode steps after the batch's prefill: raise --decode-steps")
    return statistics.median(gaps)


async def profile_engine(
    engine: Engine,
    *,
    engine_name: str,
    isls: list[int],
    batches: list[int],
    contexts: list[int],
    decode_steps: int = 8,
    repeats: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> EngineProfile:
    """Start `engine`, measure the grid, stop it."""
    info = await engine.start()
    try:
        check_grid(info, batches, contexts, decode_steps)
        prompts = Prompts()
        ttft: list[float] = []
        for isl in isls:
            samples = []
            for _ in range(repeats):
                t0 = clock()
                times = await _token_times(engine, prompts.request(info.model_name, isl, 1), clock)
                samples.append((times[0] - t0) * 1000.0)
            ttft.append(statistics.median(samples))
            logger.info("prefill isl=%d ttft=%.1f ms", isl, ttft[-1])
        itl: list[list[float]] = []
        for b in batches:
            row = []
            for c in contexts:
                reqs = [prompts.request(info.model_name, c, decode_steps + 2) for _ in range(b)]
                runs = await asyncio.gather(*(_token_times(engine, r, clock) for r in reqs))
                row.append(decode_itl_ms(runs))
                logger.info("decode batch=%d context=%d itl=%.2f ms", b, c, row[-1])
            itl.append(row)
    finally:
        await engine.stop()
    return EngineProfile(
        engine=engine_name,
        model=info.model_name,
        block_size=info.block_size,
        num_total_blocks=info.num_total_blocks,
        max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens,
        prefill=PrefillCurve(isl=list(isls), ttft_ms=ttft),
        decode=DecodeGrid(batch=list(batches), context=list(contexts), itl_ms=itl),
    )
