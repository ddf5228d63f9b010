"""`NativeKvHandoff`: the native engine's side of a disaggregated KV handoff.

Implements `tandem.engines.handoff.KvHandoff` with the engine's public hooks only:
`EngineCore.on_finish` pins a finished prefill's prompt blocks (an extra reference held by a
pin entry in the block manager's tables, so `check_integrity` and `num_active_blocks` see
it), `NativeEngine.run_locked` allocates / frees between steps, and
`NativeEngine.generate(install=)` puts a resumed sequence straight into the running queue
with its imported KV counted as computed. The transfer agent reads and writes the KV tensor
itself (`adopt_kv_cache` moves it into a shared-memory region), so no bytes are copied here.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import cast

import msgspec
import torch

from tandem.engines.handoff import FetchFigures, KvCacheSpec
from tandem.engines.native.engine import NativeEngine
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.sequence import Sequence, SequenceStatus
from tandem.engines.output_stream import DirectSink
from tandem.errors import InvalidRequest, Overloaded, TransferError
from tandem.protocols.engine import EngineOutput, PreprocessedRequest

logger = logging.getLogger(__name__)
DEFAULT_BANDWIDTH = 1e9  # bytes/s assumed for peer KV fetch until fetches measure it


class NativeKvHandoff:
    """Create after `engine.start()`. Thread-safe where the protocol says so."""

    def __init__(self, engine: NativeEngine) -> None:
        assert engine.core is not None, "NativeKvHandoff needs a started engine"
        self.engine = engine
        self.core: EngineCore = engine.core
        self._to_pin: set[str] = set()  # read by the step thread in on_finish
        self._pins: dict[str, tuple[int, list[int]]] = {}  # request_id -> (table key, blocks)
        self._allocs: dict[str, Sequence] = {}
        self._keys = itertools.count(-1, -1)  # pin entries never collide with seq ids (>= 0)
        self._lock = threading.Lock()
        self.core.on_finish = self._on_finish

    # ------------------------------------------------------------------ KV memory
    def kv_cache_spec(self) -> KvCacheSpec:
        kv = self.core.runner.kv_cache
        layers, _, blocks, block_size, heads, head_dim = kv.shape
        dtype = str(kv.dtype).removeprefix("torch.")
        return KvCacheSpec(
            num_layers=layers, num_blocks=blocks, block_size=block_size,
            num_kv_heads=heads, head_dim=head_dim, dtype=dtype,
        )  # fmt: skip

    def adopt_kv_cache(self, tensor: torch.Tensor) -> None:
        """Raises ValueError for an engine whose KV cache is not on the CPU: the transfer
        agent serves a host shared-memory region as the cache itself (zero copy), which a
        GPU's cache cannot be."""
        device = self.core.runner.kv_cache.device
        if device.type != "cpu":
            raise ValueError(
                f"disaggregated KV transfer needs the KV cache in host memory; this engine "
                f"runs on device '{device}': expected --device cpu for --disagg-mode workers"
            )

        def swap(core: EngineCore) -> None:
            old = core.runner.kv_cache
            if tensor.shape != old.shape or tensor.dtype != old.dtype:
                raise ValueError(f"KV tensor {tuple(tensor.shape)} {tensor.dtype} differs "
                                 f"from the engine's {tuple(old.shape)} {old.dtype}")  # fmt: skip
            tensor.copy_(old)
            core.runner.kv_cache = tensor

        self.engine.run_locked(swap)

    def fetch_figures(self) -> FetchFigures:
        """Bytes from the KV tensor; 1 GB/s (a TCP link, below a same-host memcpy) until
        measured; prefill speed unknown here (the router's default)."""
        spec = self.kv_cache_spec()
        itemsize = self.core.runner.kv_cache.element_size()
        per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * itemsize
        return FetchFigures(bytes_per_token=per_token, bandwidth_bytes_per_s=DEFAULT_BANDWIDTH)

    def transfer_delay_s(self, num_tokens: int) -> float:
        return 0.0  # real bytes move; their time is real

    # ------------------------------------------------------------------ prefill side
    async def prefill(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        stop = msgspec.structs.replace(request.stop, max_tokens=1, min_tokens=0)
        rid = request.request_id
        with self._lock:
            self._to_pin.add(rid)
        try:
            async for out in self.engine.generate(msgspec.structs.replace(request, stop=stop)):
                yield out
        finally:
            with self._lock:  # after this, the step thread cannot pin it any more
                self._to_pin.discard(rid)

    def _on_finish(self, seq: Sequence) -> None:
        """Step thread, step lock held: take an extra reference on the prompt's blocks."""
        with self._lock:
            if seq.request_id not in self._to_pin:
                return
            self._to_pin.discard(seq.request_id)
            bm = self.core.block_manager
            num_blocks = -(-seq.num_prompt_tokens // bm.block_size)
            blocks = list(bm.block_table(seq)[:num_blocks])
            key = next(self._keys)
            bm.tables[key] = blocks
            for block in blocks:
                bm.ref_counts[block] += 1
            self._pins[seq.request_id] = (key, blocks)

    def pinned_blocks(self, request_id: str) -> list[int]:
        with self._lock:
            return list(self._pins[request_id][1])

    def unpin(self, request_id: str) -> None:
        with self._lock:
            entry = self._pins.pop(request_id, None)
        if entry is not None:
            key = cast(Sequence, SimpleNamespace(seq_id=entry[0]))
            self.engine.run_locked(lambda core: core.block_manager.free(key))

    def pin_cached(self, request_id: str, block_hashes: list[int]) -> list[int]:
        def pin(core: EngineCore) -> list[int]:
            bm = core.block_manager
            blocks = bm.cached_run(block_hashes)
            for block in blocks:
                bm.share(block)
            if blocks:
                key = next(self._keys)
                bm.tables[key] = blocks
                with self._lock:
                    self._pins[request_id] = (key, blocks)
            return list(blocks)

        with self._lock:
            if request_id in self._pins:
                raise ValueError(f"request_id={request_id} already holds pinned blocks")
        return self.engine.run_locked(pin)

    @property
    def num_pinned(self) -> int:
        with self._lock:
            return len(self._pins)

    # ------------------------------------------------------------------ decode side
    async def cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        import asyncio

        def count(core: EngineCore) -> int:
            return len(core.block_manager.cached_run(block_hashes))

        return await asyncio.to_thread(self.engine.run_locked, count)

    async def allocate(
        self,
        request: PreprocessedRequest,
        num_tokens: int,
        *,
        prefix_only: bool = False,
        num_cached_blocks: int = 0,
    ) -> list[int]:
        import asyncio

        self.core.check(request)
        seq = Sequence(request, self.core.model.config.eos_token_ids)

        def take(core: EngineCore) -> list[int]:
            bm = core.block_manager
            if num_cached_blocks > 0:
                shared = bm.match_prefix(seq, max_blocks=num_cached_blocks) // bm.block_size
                if shared < num_cached_blocks:
                    bm.free(seq)
                    raise TransferError(
                        f"request_id={request.request_id}: {shared} of the prompt's first "
                        f"{num_cached_blocks} blocks are still cached here"
                    )
            if bm.blocks_needed(seq, num_tokens) > bm.num_free_blocks:
                needed = bm.blocks_needed(seq, num_tokens)
                bm.free(seq)
                raise Overloaded(
                    f"decode worker has {bm.num_free_blocks} free KV blocks; request_id="
                    f"{request.request_id} needs {needed}"
                )
            bm.ensure_slots(seq, num_tokens)
            return list(bm.block_table(seq))

        blocks = await asyncio.to_thread(self.engine.run_locked, take)
        with self._lock:
            self._allocs[request.request_id] = seq
        return blocks

    def release(self, request_id: str) -> None:
        with self._lock:
            seq = self._allocs.pop(request_id, None)
        if seq is not None:
            self.engine.run_locked(lambda core: core.block_manager.free(seq))

    def resume(
        self,
        request: PreprocessedRequest,
        num_computed: int,
        *,
        direct: DirectSink | None = None,
    ) -> AsyncIterator[EngineOutput]:
        with self._lock:
            seq = self._allocs.pop(request.request_id, None)
        if seq is None:
            raise InvalidRequest(f"request_id={request.request_id} has no allocated KV blocks")

        def install(core: EngineCore) -> None:
            if request.request_id in core.seqs:
                core.block_manager.free(seq)
                raise InvalidRequest(f"request_id={request.request_id} is already running")
            live = self._extended(core, seq, request)
            try:
                core.bind_lora(live)  # the adapter must be resident here too
            except Exception:
                core.block_manager.free(live)
                raise
            live.num_computed_tokens = num_computed
            live.num_cached_tokens = 0
            live.status = SequenceStatus.RUNNING
            core.seqs[request.request_id] = live
            core.scheduler.running.append(live)
            core.block_manager.commit(live)  # the imported full blocks join the prefix cache

        return self.engine.generate(request, install=install, direct=direct)

    def _extended(self, core: EngineCore, seq: Sequence, request: PreprocessedRequest) -> Sequence:
        """``seq`` as allocated, or — when ``request`` carries more tokens (decode-first: the
        prefill's first token, already sent) — a sequence of ``request`` that takes over its
        blocks, exactly as a prefill-first decode allocated for prompt + first token."""
        if len(request.token_ids) <= len(seq.token_ids):
            return seq
        if request.token_ids[: len(seq.token_ids)] != seq.token_ids:
            core.block_manager.free(seq)
            raise InvalidRequest(f"request_id={request.request_id}: resumed tokens do not "
                                 "extend the allocated prompt")  # fmt: skip
        live = Sequence(request, self.core.model.config.eos_token_ids)
        bm = core.block_manager
        bm.tables[live.seq_id] = bm.tables.pop(seq.seq_id)
        bm.num_committed[live.seq_id] = bm.num_committed.pop(seq.seq_id)
        return live
