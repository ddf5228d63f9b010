"""Configuration of a `TransferAgent`."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config_check import check_range
from tandem.runtime.tls import TlsFiles
from tandem.transfer.base import BACKEND_NAMES, LAZY_BACKENDS


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferAgentConfig:
    """``backends`` lists the enabled backends, fastest preferred first; the missing
    optional ones (nixl, mooncake) are skipped with an INFO log at start.

    ``lazy_backends``: those of ``backends`` that start only when the first peer on
    another host needs them (a transfer with such a peer, either side), not at start: NIXL's
    progress thread busy-polls about half a core even when idle, and a single-host stack
    never uses it. Names not in ``backends`` are ignored. Empty (the default here): every
    named backend starts at once. `tandem worker` makes nixl and mooncake lazy unless
    ``--disagg-transfer-backends`` names them."""

    agent_id: str = ""  # default: hostname-pid-random
    host: str = "127.0.0.1"  # where the control/TCP server listens
    port: int = 0
    advertise_host: str = ""  # the address peers dial; default: the listening address
    backends: tuple[str, ...] = BACKEND_NAMES
    lazy_backends: tuple[str, ...] = ()
    default_ttl_s: float = 30.0  # readable/writable ops are released after this unless claimed
    io_timeout_s: float = 10.0  # default bound of one transfer
    max_ops: int = 65536
    # authenticates every control connection both ways (handshake.py); None = no check
    cluster_secret: str | None = field(default=None, repr=False)
    # TLS on every control connection (and the tcp backend's bytes, which follow it): the same
    # files as the request plane's (`tandem.runtime.tls`); None = plaintext
    tls: TlsFiles | None = None

    def __post_init__(self) -> None:
        unknown = [b for b in (*self.backends, *self.lazy_backends) if b not in BACKEND_NAMES]
        if unknown:
            raise ValueError(
                f"unknown transfer backend {unknown[0]!r}; expected one of: "
                f"{', '.join(BACKEND_NAMES)}"
            )
        if not self.backends:
            raise ValueError("backends=() must name at least one of: " + ", ".join(BACKEND_NAMES))
        if all(b in self.lazy_backends for b in self.backends):
            raise ValueError(
                f"lazy_backends={self.lazy_backends} leaves nothing to start with; keep one of "
                f"backends={self.backends} eager (tcp always works)"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} outside [0, 65535]")
        check_range("default_ttl_s", self.default_ttl_s, low=0, high=86400, low_open=True)
        check_range("io_timeout_s", self.io_timeout_s, low=0, high=86400, low_open=True)
        check_range("max_ops", self.max_ops, low=1)


def backends_from_spec(spec: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(backends, lazy_backends) of a `--*-transfer-backends` value: 'auto' is every backend,
    with nixl and mooncake started only for a peer on another host; a list (fastest first)
    starts every backend it names at once. Unknown names: `TransferAgentConfig` says which."""
    spec = spec.strip()
    if spec == "auto":
        return BACKEND_NAMES, LAZY_BACKENDS
    names = tuple(b.strip() for b in spec.split(",") if b.strip())
    if not names:
        raise ValueError(f"transfer backends {spec!r}: expected 'auto' or a comma-separated "
                         f"list of {', '.join(BACKEND_NAMES)}")  # fmt: skip
    return names, ()
