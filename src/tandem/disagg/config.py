"""Configs of disaggregated serving: the worker side and the frontend (routing) side."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config_check import check_range
from tandem.transfer.base import BACKEND_NAMES, LAZY_BACKENDS

DISAGG_MODES = ("none", "prefill", "decode")
FLOWS = ("prefill-first", "decode-first")
FAILURE_POLICIES = ("local", "fail")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} '{value}'; expected one of: {', '.join(allowed)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggWorkerConfig:
    """A worker's role and its transfer bounds.

    ``pin_ttl_s``: a prefill's pinned blocks are released after this unless a decode claims
    them. ``transfer_timeout_s``: the most a decode waits for its KV (a pull, or a prefill's
    push into its rendezvous) before ``on_transfer_failure`` applies: ``local`` prefills on
    the decode worker, ``fail`` ends the request with a TransferError. ``lazy_backends``:
    which of ``backends`` start only when a peer on another host needs them."""

    mode: str = "none"
    backends: tuple[str, ...] = BACKEND_NAMES
    # started only for a peer on another host (TransferAgentConfig.lazy_backends)
    lazy_backends: tuple[str, ...] = LAZY_BACKENDS
    pin_ttl_s: float = 30.0
    transfer_timeout_s: float = 10.0
    on_transfer_failure: str = "local"
    # where the KV transfer agent listens and what peers dial (`tandem worker` sets it to the
    # worker's request-plane --host unless --transfer-host says otherwise)
    transfer_host: str = "127.0.0.1"
    transfer_port: int = 0  # 0: any free port
    # peer KV fetch (issue 31): export cached blocks to peers and pull the prefix a router's
    # KvFetchHint names; a fetch not done within kv_fetch_timeout_s is recomputed instead
    kv_fetch: bool = False
    kv_fetch_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        _one_of("disagg mode", self.mode, DISAGG_MODES)
        check_range("kv_fetch_timeout_s", self.kv_fetch_timeout_s, low=0.01, high=600)
        _one_of("transfer failure policy", self.on_transfer_failure, FAILURE_POLICIES)
        for backend in self.backends:
            _one_of("transfer backend", backend, BACKEND_NAMES)
        if not self.backends:
            raise ValueError("backends=() must name at least one of: " + ", ".join(BACKEND_NAMES))
        if all(b in self.lazy_backends for b in self.backends):
            raise ValueError(
                f"backends={self.backends} are all lazy (lazy_backends={self.lazy_backends}); "
                "keep one eager, e.g. tcp, or pass lazy_backends=()"
            )
        check_range("pin_ttl_s", self.pin_ttl_s, low=0.01, high=86400)
        check_range("transfer_timeout_s", self.transfer_timeout_s, low=0.01, high=3600)
        check_range("transfer_port", self.transfer_port, low=0, high=65535)

    @property
    def enabled(self) -> bool:
        """The worker needs a transfer agent: a disaggregated role or peer KV fetch."""
        return self.mode != "none" or self.kv_fetch


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggRouteConfig:
    """How the frontend splits requests over prefill and decode pools.

    A prompt is prefilled remotely only when the decode worker would have to compute at
    least ``min_prefill_tokens`` uncached tokens making up at least ``min_uncached_ratio``
    of the prompt; otherwise the decode worker serves it whole (conditional
    disaggregation). It also stays there when the prefill pool is busy: every prefill
    worker has ``max_prefill_queue`` prefill legs queued or running (0: no such limit), or
    the prefill router finds them all over its busy thresholds (``--busy-*``). With no
    prefill worker, ``decode_fallback`` serves aggregated on the decode pool; without it
    the request fails with 503."""

    enabled: bool = False
    flow: str = "prefill-first"
    min_prefill_tokens: int = 0
    min_uncached_ratio: float = 0.0
    decode_fallback: bool = False
    prefill_component: str = "prefill"
    prefill_timeout_s: float = 600.0  # the prefill leg of one request
    max_prefill_queue: int = 0  # prefill legs per prefill worker counting as busy; 0 = off

    def __post_init__(self) -> None:
        _one_of("disagg flow", self.flow, FLOWS)
        check_range("min_prefill_tokens", self.min_prefill_tokens, low=0, high=1 << 30)
        check_range("min_uncached_ratio", self.min_uncached_ratio, low=0.0, high=1.0)
        check_range("prefill_timeout_s", self.prefill_timeout_s, low=0.01, high=86400)
        check_range("max_prefill_queue", self.max_prefill_queue, low=0, high=1 << 20)
        if not self.prefill_component or "." in self.prefill_component:
            raise ValueError(f"prefill_component={self.prefill_component!r} must be non-empty")
