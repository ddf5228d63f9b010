"""`PeerFetch`: peer KV fetch on a worker (issue 31), over the disaggregation machinery.

Holder side: the agent's exporter. A peer's ``Export`` names chained block hashes; the
engine pins the longest prefix of them it caches (`KvHandoff.pin_cached`) and a readable op
opens over those blocks; the op's release (the peer's completed pull, a cancel, its TTL)
unpins them.

Fetcher side: a request whose `PreprocessedRequest.kv_fetch` names a holder keeps the
leading blocks of the prompt its own prefix cache holds, asks the holder to export the
blocks after them, allocates fresh blocks for what it exported, pulls them (shm / tcp / nixl,
as the agents choose), then resumes the request with those tokens computed: only the rest is
prefilled, and the fetched full blocks join the prefix cache (KV stored events as usual).
Whatever fails — the holder gone, refusing, evicted, no room here, the pull erring or
passing ``kv_fetch_timeout_s`` — frees the blocks and the prompt is computed here as if
there had been no hint; the request never fails because of a fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, TypeVar

import msgspec

from tandem.disagg.config import DisaggWorkerConfig
from tandem.disagg.guard import BlockGuard
from tandem.disagg.prefill import REGION
from tandem.engines.base import Engine
from tandem.engines.fetch_stats import PeerFetchStats
from tandem.engines.handoff import KvHandoff
from tandem.errors import Overloaded, TransferError
from tandem.protocols.engine import EngineOutput, KvFetchHint, PreprocessedRequest
from tandem.transfer import OpRef, TransferAgent

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from tandem.engines.output_stream import DirectSink

logger = logging.getLogger(__name__)
T = TypeVar("T")


class PeerFetch:
    """One per worker with ``--kv-fetch``; create after the engine and agent started."""

    def __init__(
        self,
        engine: Engine,
        handoff: KvHandoff,
        agent: TransferAgent,
        config: DisaggWorkerConfig,
        *,
        block_size: int,
        bytes_per_token: int,
        bandwidth_bytes_per_s: float,
        executor: Executor | None = None,
    ) -> None:
        self.engine, self.handoff, self.agent, self.config = engine, handoff, agent, config
        self.block_size, self.bytes_per_token = block_size, bytes_per_token
        self.executor = executor
        self.stats = PeerFetchStats(bandwidth_bytes_per_s)
        agent.exporter = self.export

    # ------------------------------------------------------------------ holder side
    def export(self, op_id: str, block_hashes: list[int], ttl_s: float) -> int:
        """Agent thread: pin what we cache of ``block_hashes`` as readable op ``op_id``."""
        pin_id = f"kv-fetch:{op_id}"
        blocks = self.handoff.pin_cached(pin_id, block_hashes)
        if not blocks:
            return 0
        try:
            self.agent.create_readable(
                REGION,
                blocks,
                ttl_s=min(max(ttl_s, 0.01), self.config.pin_ttl_s),
                op_id=op_id,
                on_release=lambda _op: self.handoff.unpin(pin_id),
            )
        except BaseException:
            self.handoff.unpin(pin_id)
            raise
        self.stats.num_exported += 1
        self.stats.num_export_blocks += len(blocks)
        return len(blocks)

    # ------------------------------------------------------------------ fetcher side
    async def generate(
        self, request: PreprocessedRequest, *, direct: DirectSink | None = None
    ) -> AsyncGenerator[EngineOutput, None]:
        """`direct` goes to the engine: as given when nothing was fetched, through
        `_CountFetched` (which counts the fetched tokens as cached) when it resumes."""
        assert request.kv_fetch is not None
        local = msgspec.structs.replace(request, kv_fetch=None)
        num_fetched = await self._fetch(local, request.kv_fetch)
        if num_fetched == 0:
            stream: AsyncIterator[EngineOutput] = self.engine.generate(local, direct=direct)
        else:
            counted = _CountFetched(num_fetched)
            sink = counted.sink(direct) if direct is not None else None
            stream = counted.stream(self.handoff.resume(local, num_fetched, direct=sink))
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for out in stream:
                yield out

    async def _fetch(self, request: PreprocessedRequest, hint: KvFetchHint) -> int:
        """Tokens whose KV now sits in blocks allocated to ``request``: its own cached
        leading blocks and the pulled ones after them (resume from there); 0: nothing was
        fetched, nothing is allocated (compute the prompt)."""
        size = self.block_size
        max_blocks = (request.num_prompt_tokens - 1) // size  # the last token is computed here
        hashes = hint.block_hashes[:max_blocks]
        if hint.block_size != size or not hashes:
            return 0
        # the leading blocks this engine caches itself stay; only the rest is pulled
        num_local = await self.handoff.cached_prefix_blocks(hashes)
        if num_local >= len(hashes):
            return 0
        self.stats.num_started += 1
        started = time.monotonic()
        deadline = started + self.config.kv_fetch_timeout_s
        target = OpRef(address=hint.address, agent_id=hint.agent_id,
                       op_id=f"{request.request_id}-fetch-{secrets.token_hex(4)}")  # fmt: skip
        rid = request.request_id
        guard = BlockGuard(lambda: self.handoff.release(rid))  # release is idempotent
        done = False
        try:
            ttl_s = self.config.kv_fetch_timeout_s
            num_blocks = await self._in_thread(
                lambda: self.agent.request_export(
                    target, hashes[num_local:], ttl_s=ttl_s, timeout_s=_left(deadline)
                )
            )
            if num_blocks == 0:
                raise TransferError(f"holder {hint.source_instance_id} no longer caches them")
            num_tokens = (num_local + num_blocks) * size
            blocks = await self.handoff.allocate(
                request, num_tokens, prefix_only=True, num_cached_blocks=num_local
            )
            pull_started = time.monotonic()
            result = await guard.run(
                lambda: self.agent.pull(
                    target, REGION, blocks[num_local:], timeout_s=_left(deadline)
                ),
                self.executor,
            )
            # the mocker's simulated transfer time, of the blocks that moved
            await asyncio.sleep(self.handoff.transfer_delay_s(num_blocks * size))
            done = True
        except (TransferError, Overloaded, TimeoutError) as exc:
            self.stats.num_fell_back += 1
            logger.info("request_id=%s: peer KV fetch from %s failed (%s); computing the "
                        "prompt here", rid, hint.source_instance_id, exc)  # fmt: skip
            return 0
        finally:
            if not done:
                self.agent.cancel_remote_soon(target, "fetch given up")
                guard.give_up()
        guard.keep()
        now = time.monotonic()
        self._count(num_blocks * size, result.num_bytes, now - started, now - pull_started)
        return num_tokens

    def _count(self, num_tokens: int, moved_bytes: int, seconds: float, pull_s: float) -> None:
        """Count a fetch of ``seconds`` in all, ``pull_s`` of it the pull (the bytes moving,
        and the mocker's simulated time)."""
        num_bytes = max(moved_bytes, num_tokens * self.bytes_per_token)  # mocker: 1 B/block
        self.stats.succeeded(num_blocks=num_tokens // self.block_size, num_bytes=num_bytes,
                             seconds=seconds, pull_s=pull_s)  # fmt: skip

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    def families(self) -> list[Metric]:
        """``tandem_kv_fetch_*``: this worker's peer KV fetches and exports."""
        return self.stats.families()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("kv fetch timeout passed")
    return left


class _CountFetched:
    """A resumed stream whose first output counts the fetched tokens as cached (they were
    not computed here), whichever way it leaves: through the direct sink or the stream. An
    output the sink refuses comes out of the stream next, so the count waits for it."""

    def __init__(self, num_fetched: int) -> None:
        self.num_fetched = num_fetched
        self.first = True

    def counted(self, out: EngineOutput) -> EngineOutput:
        if not self.first:
            return out
        cached = max(out.num_cached_tokens or 0, self.num_fetched)
        return msgspec.structs.replace(out, num_cached_tokens=cached)

    def sink(self, direct: DirectSink) -> DirectSink:
        def take(out: EngineOutput) -> bool:
            if not direct(self.counted(out)):
                return False
            self.first = False
            return True

        return take

    async def stream(self, stream: AsyncIterator[EngineOutput]) -> AsyncIterator[EngineOutput]:
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for out in stream:
                counted = self.counted(out)
                self.first = False
                yield counted
