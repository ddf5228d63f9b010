"""Backends chosen by name: `make_discovery(config)`, `make_event_bus(config, discovery)`;
the blob store and the catalog go where the discovery is: `make_blob_store(config,
discovery)`, `make_catalog(config, discovery)`.

Real backends are imported only when chosen, so `memory` needs nothing else installed.
"""

from __future__ import annotations

from tandem.errors import StartupError
from tandem.runtime.address import resolve_addresses
from tandem.runtime.base import Discovery, EventBus
from tandem.runtime.blobs.base import BlobStore
from tandem.runtime.catalog.base import RecordStore
from tandem.runtime.config import DISCOVERY_BACKENDS, EVENT_BACKENDS, RuntimeConfig


def _unknown(what: str, name: str, allowed: tuple[str, ...]) -> ValueError:
    return ValueError(f"unknown {what} '{name}'; expected one of: {', '.join(sorted(allowed))}")


def make_discovery(config: RuntimeConfig) -> Discovery:
    """A new discovery client for `config.discovery`; the caller closes it."""
    name = config.discovery
    if name == "memory":
        from tandem.runtime.discovery.memory import MemoryDiscovery

        return MemoryDiscovery()
    if name == "file":
        from tandem.runtime.discovery.file import FileDiscovery

        return FileDiscovery(
            config.resolved_discovery_dir,
            ttl_s=config.lease_ttl_s,
            poll_interval_s=config.poll_interval_s,
            secret=config.cluster_secret,
        )
    if name == "etcd":
        from tandem.runtime.discovery.etcd import EtcdAuth, EtcdDiscovery

        auth = EtcdAuth(
            user=config.etcd_user,
            password=config.etcd_password,
            ca_file=config.etcd_ca_file,
            cert_file=config.etcd_cert_file,
            key_file=config.etcd_key_file,
        )
        return EtcdDiscovery(
            config.etcd_url, ttl_s=config.lease_ttl_s, secret=config.cluster_secret, auth=auth
        )
    raise _unknown("discovery", name, DISCOVERY_BACKENDS)


def make_blob_store(config: RuntimeConfig, discovery: Discovery) -> BlobStore:
    """A new blob store kept where `discovery` keeps its records: etcd keys, files in the
    discovery directory, or memory shared by every store on the same in-process discovery
    (any other discovery object). The caller closes it before the discovery."""
    from tandem.runtime.discovery.etcd import EtcdDiscovery
    from tandem.runtime.discovery.file import FileDiscovery

    if isinstance(discovery, EtcdDiscovery):
        from tandem.runtime.blobs.etcd import EtcdBlobStore

        return EtcdBlobStore(
            discovery.call, where=f"etcd at {discovery.url}", ttl_s=config.lease_ttl_s
        )
    if isinstance(discovery, FileDiscovery):
        from tandem.runtime.blobs.file import FileBlobStore

        return FileBlobStore(discovery.directory)
    from tandem.runtime.blobs.memory import MemoryBlobStore, space_of

    return MemoryBlobStore(space_of(discovery))


def make_catalog(config: RuntimeConfig, discovery: Discovery) -> RecordStore:
    """The catalog's record store, kept where `discovery` keeps its records: etcd keys (no
    lease), files in the discovery directory, or memory shared by every store on the same
    in-process discovery."""
    from tandem.runtime.discovery.etcd import EtcdDiscovery
    from tandem.runtime.discovery.file import FileDiscovery

    secret = config.cluster_secret
    if isinstance(discovery, EtcdDiscovery):
        from tandem.runtime.catalog.etcd import EtcdRecordStore

        return EtcdRecordStore(discovery.call, where=f"etcd at {discovery.url}", secret=secret)
    if isinstance(discovery, FileDiscovery):
        from tandem.runtime.catalog.file import FileRecordStore

        return FileRecordStore(discovery.directory, secret=secret)
    from tandem.runtime.catalog.memory import MemoryRecordStore, records_of

    return MemoryRecordStore(records_of(discovery))


async def check_discovery(discovery: Discovery) -> None:
    """Fail now, with the backend's message, when the discovery service refuses this process
    (etcd credentials, certificates, permissions) or cannot be reached, rather than in a watch
    that retries: StartupError, which the CLI prints as one line."""
    from tandem.runtime.discovery.etcd import EtcdDiscovery, EtcdError

    if isinstance(discovery, EtcdDiscovery):
        try:
            await discovery.check_access()
        except EtcdError as exc:  # unreachable or refused: one line at start, no traceback
            raise StartupError(str(exc)) from exc


def make_event_bus(config: RuntimeConfig, discovery: Discovery) -> EventBus:
    """A new event bus for `config.events`; zmq finds its peers through `discovery`.
    Async backends connect lazily on first use; the caller closes the bus."""
    name = config.events
    if name == "memory":
        from tandem.runtime.events.memory import MemoryEventBus

        return MemoryEventBus(buffer_size=config.event_buffer_size)
    if name == "zmq":
        from tandem.runtime.events.zmq import ZmqEventBus

        return ZmqEventBus(
            discovery,
            namespace=config.namespace,
            host=config.host,
            advertise_host=resolve_addresses(config).advertise_host,
            port=config.events_port,
            buffer_size=config.event_buffer_size,
            secret=config.cluster_secret,
            max_message_bytes=config.max_frame_bytes,
        )
    if name == "nats":
        from tandem.runtime.events.nats import NatsAuth, NatsEventBus

        auth = NatsAuth(
            user=config.nats_user,
            password=config.nats_password,
            token=config.nats_token,
            creds_file=config.nats_creds_file,
            nkey_seed_file=config.nats_nkey_seed_file,
            ca_file=config.nats_ca_file,
            cert_file=config.nats_cert_file,
            key_file=config.nats_key_file,
        )
        return NatsEventBus(
            config.nats_url,
            buffer_size=config.event_buffer_size,
            secret=config.cluster_secret,
            auth=auth,
        )
    raise _unknown("event bus", name, EVENT_BACKENDS)
