"""`open_runtime`: one process's discovery, event bus, request server and client, wired."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from tandem.protocols.discovery import Instance, ModelCard, endpoint_path
from tandem.runtime.address import resolve_addresses
from tandem.runtime.base import Discovery, EventBus, Handler
from tandem.runtime.blobs.base import BlobStore
from tandem.runtime.catalog.base import RecordStore
from tandem.runtime.catalog.lora import LoraCatalog
from tandem.runtime.catalog.memory import MemoryRecordStore, records_of
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.instances import InstanceSet
from tandem.runtime.registry import (
    check_discovery,
    make_blob_store,
    make_catalog,
    make_discovery,
    make_event_bus,
)
from tandem.runtime.tcp import ResponseStream, TcpRequestClient, TcpRequestServer

logger = logging.getLogger(__name__)


class Runtime:
    """The planes of one process. `server` is started; endpoints served with `serve_endpoint`
    are unregistered from discovery by `shutdown` (SIGTERM path) or when the runtime closes.
    `blobs` keeps files (a model's tokenizer) where the discovery is, for other hosts;
    `loras` is the catalog of LoRA adapters, kept there too (no lease: they outlive us)."""

    def __init__(
        self,
        config: RuntimeConfig,
        discovery: Discovery,
        events: EventBus,
        server: TcpRequestServer,
        client: TcpRequestClient,
        blobs: BlobStore,
        catalog: RecordStore | None = None,
    ) -> None:
        self.config, self.discovery, self.events = config, discovery, events
        self.server, self.client, self.blobs = server, client, blobs
        store = catalog if catalog is not None else MemoryRecordStore(records_of(discovery))
        self.loras = LoraCatalog(store, config.namespace)
        self.instance_ids: list[str] = []

    @property
    def namespace(self) -> str:
        return self.config.namespace

    def endpoint_path(self, component: str, endpoint: str) -> str:
        return endpoint_path(self.namespace, component, endpoint)

    async def serve_endpoint(
        self,
        component: str,
        endpoint: str,
        handler: Handler,
        *,
        model: ModelCard | None = None,
        metadata: dict[str, Any] | None = None,
        instance_id: str | None = None,
    ) -> Instance:
        """Serve `handler` at `namespace.component.endpoint` and register it in discovery."""
        instance = Instance(
            instance_id=instance_id or uuid.uuid4().hex[:16],
            namespace=self.namespace,
            component=component,
            endpoint=endpoint,
            address=self.server.address,
            model=model,
            metadata=metadata or {},
        )
        self.server.register(instance.path, handler)
        await self.discovery.register(instance)
        self.instance_ids.append(instance.instance_id)
        logger.info(
            "serving %s as instance_id=%s at %s",
            instance.path,
            instance.instance_id,
            instance.address,
        )
        return instance

    def instance_set(self, component: str, endpoint: str) -> InstanceSet:
        """A (not yet started) live view of the instances of `component.endpoint`."""
        return InstanceSet(self.discovery, self.endpoint_path(component, endpoint))

    def stream(
        self,
        instance: Instance,
        payload: bytes,
        *,
        request_id: str,
        deadline_s: float | None = None,
    ) -> ResponseStream:
        return self.client.stream(
            instance.address, instance.path, payload, request_id=request_id, deadline_s=deadline_s
        )

    async def unregister_all(self) -> None:
        ids, self.instance_ids = self.instance_ids, []
        for instance_id in ids:
            await self.discovery.unregister(instance_id)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting → unregister → drain in-flight within `grace_s` → cancel the rest."""
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        self.server.stop_accepting()
        await self.unregister_all()
        await self.server.stop(grace)


@asynccontextmanager
async def open_runtime(
    config: RuntimeConfig, *, discovery: Discovery | None = None, events: EventBus | None = None
) -> AsyncIterator[Runtime]:
    """Yield a started Runtime. `discovery`/`events` passed in are shared and stay open
    (the caller owns them); those built here from `config` are closed on exit."""
    config = resolve_addresses(config)  # refuses a loopback address when etcd/NATS are remote
    own_discovery = discovery is None
    disc = make_discovery(config) if discovery is None else discovery
    if own_discovery:
        try:
            await check_discovery(disc)  # refused credentials fail the process here
        except BaseException:
            await disc.close()
            raise
    bus = make_event_bus(config, disc) if events is None else events
    tls = config.tls
    server = TcpRequestServer(
        host=config.host,
        advertise_host=config.advertise_host,
        port=config.port,
        max_inflight_per_connection=config.max_inflight_per_connection,
        secret=config.cluster_secret,
        max_frame_bytes=config.max_frame_bytes,
        max_connections=config.max_connections,
        handshake_timeout_s=config.connect_timeout_s,
        stream_stall_timeout_s=config.stream_stall_timeout_s,
        ssl_context=tls.server_context() if tls is not None else None,
    )
    client = TcpRequestClient(
        connect_timeout_s=config.connect_timeout_s,
        secret=config.cluster_secret,
        max_frame_bytes=config.max_frame_bytes,
        stream_window=config.stream_window,
        ssl_context=tls.client_context() if tls is not None else None,
    )
    blobs, catalog = make_blob_store(config, disc), make_catalog(config, disc)
    runtime = Runtime(config, disc, bus, server, client, blobs, catalog)
    try:
        await server.start()
        yield runtime
    finally:
        # a graceful drain is the caller's `runtime.shutdown()` (lifecycle); here we just close
        await runtime.shutdown(grace_s=0.0)
        await client.close()
        await runtime.blobs.close()
        if events is None:
            await bus.close()
        if own_discovery:
            await disc.close()
