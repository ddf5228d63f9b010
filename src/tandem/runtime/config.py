"""Runtime configuration: which discovery and event-plane backends, where they live.

Built once from flags + `TANDEM_*` env vars (`tandem.runtime.args`), never read deep in the code.
"""

from __future__ import annotations

import getpass
import os
import tempfile
from dataclasses import dataclass, field

from tandem.config_check import check_range
from tandem.runtime.secret import check_secret
from tandem.runtime.tls import TlsFiles

DISCOVERY_BACKENDS = ("etcd", "file", "memory")
EVENT_BACKENDS = ("memory", "nats", "zmq")
# etcd's and NATS's own auth and TLS files (checked to exist at start)
_SERVICE_FILES = (
    *("etcd_ca_file", "etcd_cert_file", "etcd_key_file"),
    *("nats_creds_file", "nats_nkey_seed_file", "nats_ca_file", "nats_cert_file", "nats_key_file"),
    *("tls_cert_file", "tls_key_file", "tls_ca_file"),
)


def default_discovery_dir() -> str:
    """One directory per user on this host, shared by every tandem process of that user."""
    return os.path.join(tempfile.gettempdir(), f"tandem-{getpass.getuser()}", "discovery")


def _check_name(field: str, value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} '{value}'; expected one of: {', '.join(allowed)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeConfig:
    """Everything `open_runtime` needs. Times in seconds."""

    namespace: str = "tandem"
    discovery: str = "memory"
    discovery_dir: str | None = None  # file backend; None = default_discovery_dir()
    etcd_url: str = "http://127.0.0.1:2379"
    events: str = "memory"
    nats_url: str = "nats://127.0.0.1:4222"
    host: str = "127.0.0.1"  # request-plane server and event publisher bind host
    # the address others dial ("" = decided at start: `tandem.runtime.address`)
    advertise_host: str = ""
    port: int = 0  # request-plane server port; 0 = any free port
    events_port: int = 0  # ZMQ event publisher port; 0 = any free port
    # a record/lease outlives its last heartbeat by this long (etcd rounds up to whole seconds
    # and clamps to its minimum, 2 s with default election settings)
    lease_ttl_s: float = 2.0
    poll_interval_s: float = 0.25  # file discovery watch polling period
    max_inflight_per_connection: int = 1024  # request-plane streams; over it -> Overloaded
    connect_timeout_s: float = 5.0
    drain_grace_s: float = 10.0
    event_buffer_size: int = 10_000  # per subscription; the oldest are dropped beyond it
    # the cluster secret (`tandem.runtime.secret`): authenticates request-plane connections,
    # event-plane messages and file-discovery records; None = no authentication (one process)
    cluster_secret: str | None = field(default=None, repr=False)
    max_frame_bytes: int = 16 << 20  # request-plane frame limit, both directions
    stream_window: int = 256  # request-plane credit: response frames in flight per stream
    stream_stall_timeout_s: float = 60.0  # a stream whose consumer reads nothing this long ends
    max_connections: int = 4096  # request-plane server; more are closed at accept
    # etcd's own access control (None = not used): a user (v3 auth), client certificates and
    # the CA of etcd's server certificate (https:// URLs)
    etcd_user: str | None = None
    etcd_password: str | None = field(default=None, repr=False)
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None
    # NATS's own access control (None = not used): one of user/password, token, a .creds file
    # or an nkey seed file; TLS with a CA and optionally a client certificate
    nats_user: str | None = None
    nats_password: str | None = field(default=None, repr=False)
    nats_token: str | None = field(default=None, repr=False)
    nats_creds_file: str | None = None
    nats_nkey_seed_file: str | None = None
    nats_ca_file: str | None = None
    nats_cert_file: str | None = None
    nats_key_file: str | None = None
    # request-plane TLS (`tandem.runtime.tls`): this process's certificate and key, the CA that
    # signed every peer's; all three or none. Mutual TLS only with tls_require_client_cert
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    tls_require_client_cert: bool = False

    def __post_init__(self) -> None:
        if not self.namespace or "." in self.namespace:
            raise ValueError(f"namespace={self.namespace!r} must be non-empty without '.'")
        _check_name("discovery", self.discovery, DISCOVERY_BACKENDS, "discovery")
        _check_name("events", self.events, EVENT_BACKENDS, "event bus")
        check_range("port", self.port, low=0, high=65535)
        check_range("events_port", self.events_port, low=0, high=65535)
        check_range("lease_ttl_s", self.lease_ttl_s, low=0.5, high=3600)
        check_range("poll_interval_s", self.poll_interval_s, low=0.01, high=10)
        check_range(
            "max_inflight_per_connection", self.max_inflight_per_connection, low=1, high=1 << 20
        )
        check_range("connect_timeout_s", self.connect_timeout_s, low=0.01, high=600)
        check_range("drain_grace_s", self.drain_grace_s, low=0, high=3600)
        check_range("event_buffer_size", self.event_buffer_size, low=1, high=1 << 24)
        check_range("max_frame_bytes", self.max_frame_bytes, low=64 << 10, high=1 << 30)
        check_range("stream_window", self.stream_window, low=2, high=1 << 16)
        check_range("stream_stall_timeout_s", self.stream_stall_timeout_s, low=0.1, high=86400)
        check_range("max_connections", self.max_connections, low=1, high=1 << 20)
        if self.cluster_secret is not None:
            check_secret(self.cluster_secret)
        self._check_service_auth()

    def _check_service_auth(self) -> None:
        """Options that go together are given together; named files exist; TLS options
        match the URL's scheme (a mode tandem would not honour is an error, not ignored)."""
        for a, b in (
            ("etcd_user", "etcd_password"),
            ("etcd_cert_file", "etcd_key_file"),
            ("nats_user", "nats_password"),
            ("nats_cert_file", "nats_key_file"),
        ):
            if (getattr(self, a) is None) != (getattr(self, b) is None):
                raise ValueError(f"{a} and {b} go together: give both or neither")
        nats_auth = [
            n
            for n in ("nats_user", "nats_token", "nats_creds_file", "nats_nkey_seed_file")
            if getattr(self, n) is not None
        ]
        if len(nats_auth) > 1:
            raise ValueError(f"{' and '.join(nats_auth)} are all set; give NATS one credential")
        for name in _SERVICE_FILES:
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}={path!r} is not a readable file")
        etcd_tls = self.etcd_ca_file or self.etcd_cert_file
        if etcd_tls and not self.etcd_url.startswith("https://"):
            raise ValueError(
                f"etcd TLS files are given but etcd_url={self.etcd_url!r} is not https://"
            )
        tls = [self.tls_cert_file, self.tls_key_file, self.tls_ca_file]
        if any(tls) and not all(tls):
            raise ValueError(
                "request-plane TLS needs tls_cert_file, tls_key_file and tls_ca_file together "
                f"(got cert={self.tls_cert_file!r}, key={self.tls_key_file!r}, "
                f"ca={self.tls_ca_file!r})"
            )
        if self.tls_require_client_cert and not all(tls):
            raise ValueError("tls_require_client_cert needs the request-plane TLS files")
        nats_tls = self.nats_ca_file or self.nats_cert_file
        if nats_tls and not self.nats_url.startswith("tls://"):
            raise ValueError(
                f"NATS TLS files are given but nats_url={self.nats_url!r} is not tls://"
            )

    @property
    def tls(self) -> TlsFiles | None:
        """The request plane's TLS files, or None (plaintext)."""
        if self.tls_cert_file and self.tls_key_file and self.tls_ca_file:
            return TlsFiles(
                cert_file=self.tls_cert_file,
                key_file=self.tls_key_file,
                ca_file=self.tls_ca_file,
                require_client_cert=self.tls_require_client_cert,
            )
        return None

    @property
    def resolved_discovery_dir(self) -> str:
        return self.discovery_dir or default_discovery_dir()
