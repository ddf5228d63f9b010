"""`DisaggEngine`: wraps a worker's engine for a prefill or decode role (DESIGN.md §4).

It is an `Engine`, so the `Worker` hosts it unchanged: on `start` it starts the engine,
opens a `TransferAgent`, registers the KV cache as the region ``kv`` (moving a real KV
tensor into shared memory so same-host peers can memcpy it; a one-byte-per-block region for
engines that move no bytes) and builds the engine's `KvHandoff`. `generate` sends a
prefill worker's requests through `PrefillSide`, a decode worker's requests that carry
`disagg_params` through `DecodeSide`, requests that carry a router's `kv_fetch` hint through
`PeerFetch` (``--kv-fetch``, any role but prefill; mode ``none`` is an aggregated worker with
peer fetch), and everything else to the engine as usual. `instance_metadata()` tells the
frontend the role and the agent's address, and the router the peer-fetch figures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec

from tandem.disagg.config import DisaggWorkerConfig
from tandem.disagg.decode import DecodeSide
from tandem.disagg.peer_fetch import PeerFetch
from tandem.disagg.prefill import REGION, PrefillSide
from tandem.engines.base import Engine, EngineCapabilities, EngineDefaults, EngineInfo, EngineLoad
from tandem.engines.handoff import KvHandoff
from tandem.engines.output_stream import DirectSink
from tandem.engines.vision import EmbeddingProvider
from tandem.protocols.engine import FETCH_METADATA_KEY, EngineOutput, PreprocessedRequest
from tandem.protocols.kv_events import KvEvent
from tandem.protocols.lora import LoraLoaded
from tandem.protocols.scaling import StepSample
from tandem.runtime.tls import TlsFiles
from tandem.transfer import RegionLayout, TransferAgent, TransferAgentConfig

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray
    from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

MAX_TRANSFER_THREADS = 32  # concurrent pulls/pushes of one worker (a transfer is bounded)
# engine name (EngineInfo.engine) -> "module:class" of its KvHandoff(engine)
HANDOFFS = {
    "mocker": "tandem.engines.mocker.disagg:MockerKvHandoff",
    "native": "tandem.engines.native.kv_transfer:NativeKvHandoff",
}


def make_handoff(engine_name: str, engine: Engine) -> KvHandoff:
    try:
        module, cls = HANDOFFS[engine_name].split(":")
    except KeyError:
        raise ValueError(
            f"unknown disaggregated engine '{engine_name}'; expected one of: "
            f"{', '.join(sorted(HANDOFFS))}"
        ) from None
    handoff: KvHandoff = getattr(importlib.import_module(module), cls)(engine)
    return handoff


class DisaggEngine(EngineDefaults):
    """Not reusable: `start` once, `stop` once; runs on the worker's event loop.
    Its capabilities are the wrapped engine's, less the prompt as bytes and the direct sink
    (the prefill and decode sides read token_ids and consume every output)."""

    def __init__(
        self,
        engine: Engine,
        config: DisaggWorkerConfig,
        agent_config: TransferAgentConfig | None = None,
        *,
        cluster_secret: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        if not config.enabled:
            raise ValueError("DisaggEngine needs mode 'prefill' or 'decode', or kv_fetch")
        self.engine, self.config = engine, config
        self._agent_config = agent_config or TransferAgentConfig(
            host=config.transfer_host,
            port=config.transfer_port,
            backends=config.backends,
            lazy_backends=config.lazy_backends,
            default_ttl_s=config.pin_ttl_s,
            cluster_secret=cluster_secret,
            tls=tls,
        )
        self.agent: TransferAgent | None = None
        self.handoff: KvHandoff | None = None
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self.fetch: PeerFetch | None = None
        self._executor = ThreadPoolExecutor(MAX_TRANSFER_THREADS, thread_name_prefix="kv-xfer")

    async def start(self) -> EngineInfo:
        info = await self.engine.start()
        self.handoff = make_handoff(info.engine, self.engine)
        self.agent = await asyncio.to_thread(TransferAgent, self._agent_config)
        spec = self.handoff.kv_cache_spec()
        if spec is None:
            layout = RegionLayout.contiguous(num_blocks=info.num_total_blocks, block_bytes=1)
            self.agent.create_region(REGION, layout)
        else:
            layout = RegionLayout.for_kv_cache(
                num_layers=spec.num_layers, num_blocks=spec.num_blocks,
                block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, dtype=spec.dtype,
            )  # fmt: skip
            region = self.agent.create_region(REGION, layout)
            await asyncio.to_thread(
                self.handoff.adopt_kv_cache, region.as_torch(spec.dtype, spec.shape)
            )
        pool = self._executor
        if self.config.mode == "prefill":
            self.prefill = PrefillSide(
                self.handoff, self.agent, self.config, info.eos_token_ids, pool
            )
        elif self.config.mode == "decode":
            self.decode = DecodeSide(self.engine, self.handoff, self.agent, self.config, pool)
        if self.config.kv_fetch and self.prefill is None:
            figures = self.handoff.fetch_figures()
            self.fetch = PeerFetch(
                self.engine, self.handoff, self.agent, self.config,
                block_size=info.block_size, bytes_per_token=figures.bytes_per_token,
                bandwidth_bytes_per_s=figures.bandwidth_bytes_per_s, executor=pool,
            )  # fmt: skip
        logger.info("disagg %s worker: transfer agent %s at %s:%d", self.config.mode,
                    self.agent.agent_id, *self.agent.address)  # fmt: skip
        return info

    @property
    def capabilities(self) -> EngineCapabilities:
        """The engine's, but token bytes are never read, and a direct sink is taken only by a
        worker that serves requests itself (not prefill, not decode: peer fetch alone), which
        passes it to the engine wherever its outputs go out unchanged."""
        direct = self.engine.capabilities.accepts_direct_sink and self.config.mode == "none"
        return dataclasses.replace(
            self.engine.capabilities, reads_token_bytes=False, accepts_direct_sink=direct
        )

    def attach_embedding_provider(self, provider: EmbeddingProvider) -> None:
        self.engine.attach_embedding_provider(provider)

    def metric_families(self) -> list[Metric]:
        """The wrapped engine's, then the transfer agent's counters."""
        agent = self.agent.families() if self.agent is not None else []
        fetch = self.fetch.families() if self.fetch is not None else []
        return [*self.engine.metric_families(), *agent, *fetch]

    def instance_metadata(self) -> dict[str, Any]:
        """Discovery metadata: the role and where the frontend/peers reach the agent."""
        assert self.agent is not None, "instance_metadata before start()"
        out: dict[str, Any] = {
            "disagg_mode": self.config.mode,
            "kv_transfer_address": list(self.agent.address),
            "kv_transfer_agent_id": self.agent.agent_id,
            "kv_transfer_backends": list(self.agent.backend_names),
        }
        if self.fetch is not None and self.handoff is not None:
            figures = self.handoff.fetch_figures()
            out[FETCH_METADATA_KEY] = {
                "address": list(self.agent.address),
                "agent_id": self.agent.agent_id,
                "bytes_per_token": figures.bytes_per_token,
                "bandwidth_bytes_per_s": self.fetch.stats.bandwidth_bytes_per_s,
                "prefill_s_per_token": figures.prefill_s_per_token,
            }
        return out

    def generate(
        self, request: PreprocessedRequest, *, direct: DirectSink | None = None
    ) -> AsyncGenerator[EngineOutput, None]:
        """`direct` (given only where `capabilities` take one) reaches the engine on the
        paths whose outputs pass through unchanged: a request computed here, and a peer
        fetch that fetched nothing; the other paths ignore it and yield every output."""
        if self.prefill is not None:
            return self.prefill.generate(request)
        if self.decode is not None and request.disagg_params is not None:
            return self.decode.generate(request)
        if self.fetch is not None and request.kv_fetch is not None:
            return self.fetch.generate(request, direct=direct)
        if request.kv_fetch is not None:  # a hint this worker cannot take: compute it
            request = msgspec.structs.replace(request, kv_fetch=None)
        return self.engine.generate(request, direct=direct)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def wait_failed(self) -> str:
        return await self.engine.wait_failed()

    def kv_events(self) -> AsyncIterator[list[KvEvent]]:
        return self.engine.kv_events()

    def kv_snapshot(self) -> list[KvEvent]:
        return self.engine.kv_snapshot()

    def load(self) -> EngineLoad:
        """The engine's, with the bandwidth its peer fetches measured (once there are some)."""
        load = self.engine.load()
        if self.fetch is None or not self.fetch.stats.num_succeeded:
            return load
        stats = self.fetch.stats
        return dataclasses.replace(
            load, kv_fetch_bytes_per_s=stats.bandwidth_bytes_per_s, kv_fetch_setup_s=stats.setup_s
        )

    def take_step_samples(self) -> list[StepSample]:
        return self.engine.take_step_samples()

    async def embed(self, inputs: list[list[int]]) -> NDArray[np.float32]:
        """Embeddings need no KV handoff: the wrapped engine's own (InvalidRequest when it
        has none; its EngineInfo then says embedding_dim 0 and the worker offers none)."""
        return await self.engine.embed(inputs)

    async def load_lora(self, name: str, path: str) -> LoraLoaded:
        """LoRA adapters are the wrapped engine's: a prefill and a decode worker each load
        the adapter a request names (its KV is computed with it on both sides)."""
        return await self.engine.load_lora(name, path)

    async def unload_lora(self, name: str) -> None:
        await self.engine.unload_lora(name)

    def loras(self) -> list[str]:
        return self.engine.loras()

    async def stop(self) -> None:
        if self.fetch is not None:  # once per process: what peer fetch did over its life
            s = self.fetch.stats
            logger.info("peer KV fetch: %d started, %d succeeded (%d blocks, %.3f s), %d fell "
                        "back; %d exported (%d blocks)", s.num_started, s.num_succeeded,
                        s.num_blocks, s.seconds, s.num_fell_back, s.num_exported,
                        s.num_export_blocks)  # fmt: skip
        await self.engine.stop()
        if self.agent is not None:
            await asyncio.to_thread(self.agent.close)
        self._executor.shutdown(wait=False, cancel_futures=True)
