"""`HttpConfig`: the limits of the HTTP edge (the server's own configuration)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config_check import check_range


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpConfig:
    """Limits of the HTTP edge (STYLE: every socket reader has sizes, timeouts and a cap).

    `header_timeout_s` bounds the time from a request's first byte to the end of its headers,
    `body_timeout_s` from there to the end of its body, `idle_timeout_s` a keep-alive connection
    with no request; a peer past them gets 408 (idle: a plain close). `max_connections` is
    lowered at start to what RLIMIT_NOFILE leaves after a reserve for discovery, the event bus
    and the request plane. `drain_grace_s`: on SIGTERM, how long in-flight responses may run.
    `reuse_port`: bind with SO_REUSEPORT, so several frontend processes share one port and the
    kernel spreads new connections over them (`tandem serve --frontend-processes`)."""

    max_body_bytes: int = 8 << 20
    max_header_bytes: int = 64 << 10
    max_header_count: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    max_connections: int = 10_000
    drain_grace_s: float = 30.0
    reuse_port: bool = False

    def __post_init__(self) -> None:
        check_range("max_body_bytes", self.max_body_bytes, low=1024)
        check_range("max_header_bytes", self.max_header_bytes, low=1024)
        check_range("max_header_count", self.max_header_count, low=8)
        check_range("header_timeout_s", self.header_timeout_s, low=0.01)
        check_range("body_timeout_s", self.body_timeout_s, low=0.01)
        check_range("idle_timeout_s", self.idle_timeout_s, low=0.01)
        check_range("max_connections", self.max_connections, low=1)
        check_range("drain_grace_s", self.drain_grace_s, low=0)
