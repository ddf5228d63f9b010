"""`HttpConfig`: the limits of the HTTP edge (the server's own configuration)."""

from __future__ import annotations

from dataclasses import dataclass


def check_at_least(name: str, value: float, low: float, allowed: str) -> None:
    """Raise ValueError naming `name` when `value` is below `low` (`allowed` says the range)."""
    if value < low:
        raise ValueError(f"{name}={value} out of range; expected {allowed}")


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
        check_at_least("max_body_bytes", self.max_body_bytes, 1024, ">= 1024")
        check_at_least("max_header_bytes", self.max_header_bytes, 1024, ">= 1024")
        check_at_least("max_header_count", self.max_header_count, 8, ">= 8")
        check_at_least("header_timeout_s", self.header_timeout_s, 0.01, ">= 0.01")
        check_at_least("body_timeout_s", self.body_timeout_s, 0.01, ">= 0.01")
        check_at_least("idle_timeout_s", self.idle_timeout_s, 0.01, ">= 0.01")
        check_at_least("max_connections", self.max_connections, 1, ">= 1")
        check_at_least("drain_grace_s", self.drain_grace_s, 0.0, ">= 0")
