"""`VllmWorkerConfig`: the vLLM engine's flags (passed to `AsyncEngineArgs` unchanged) plus
what the tandem adapter adds around them."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from tandem.config_check import check_range


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmWorkerConfig:
    """engine_args: keyword arguments of vLLM's `AsyncEngineArgs` (its CLI flags, parsed).
    model: a HF dir, a .gguf (converted once, `tandem convert`) or None for SmolLM2.
    metrics_port: vLLM's Prometheus metrics on http://metrics_host:port/metrics; 0 = a free
    port, None = not served. kv_events: publish vLLM's KV events for `--router kv`."""

    model: str | None = None
    served_model_name: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    kv_events: bool = True
    kv_event_buffer_steps: int = 10_000
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 0
    shutdown_timeout_s: float = 10.0
    # disaggregation through vLLM's NixlConnector (kv_buffer_device cpu): "prefill" computes
    # the prompt's KV and returns vLLM's kv_transfer_params; "decode" pulls it with them
    disagg_mode: str = "none"
    # cores for vLLM's OMP compute threads (VLLM_CPU_OMP_THREADS_BIND); None = vLLM's choice
    cpus: str | None = None
    # peer KV fetch (issue 31, `peer_fetch.py`): export cached prefixes to peers and pull the
    # ones a router's hint names (NixlConnector as kv_both); a pull not done within
    # kv_fetch_timeout_s is aborted and the prompt computed; kv_lease_s: how long an export
    # keeps its blocks for the pull (vLLM's kv_lease_duration, whole seconds)
    kv_fetch: bool = False
    kv_fetch_timeout_s: float = 2.0
    kv_lease_s: int = 30

    def __post_init__(self) -> None:
        if self.disagg_mode not in ("none", "prefill", "decode"):
            raise ValueError(
                f"disagg_mode={self.disagg_mode!r}; expected one of: none, prefill, decode"
            )
        if self.kv_fetch and self.disagg_mode != "none":
            raise ValueError(
                f"kv_fetch with disagg_mode={self.disagg_mode!r}; a vLLM worker takes peer "
                "fetch only when aggregated (disagg_mode none): its NixlConnector has one role"
            )
        check_range("kv_fetch_timeout_s", self.kv_fetch_timeout_s, low=0.01, high=600)
        check_range("kv_lease_s", self.kv_lease_s, low=6, high=3600)
        if self.cpus is not None and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", self.cpus):
            raise ValueError(
                f"cpus={self.cpus!r}; expected core ids and ranges such as '0', '2-3' or '0,2'"
            )
        if self.metrics_port is not None:
            check_range("metrics_port", self.metrics_port, low=0, high=65535)
        check_range("kv_event_buffer_steps", self.kv_event_buffer_steps, low=1, high=10_000_000)
        check_range("shutdown_timeout_s", self.shutdown_timeout_s, low=0, high=600, low_open=True)


def cpu_shares(num_workers: int, cpus: list[int] | None = None) -> list[str]:
    """Disjoint core sets for `num_workers` vLLM workers on one host (`--vllm-cpus` values):
    vLLM binds one OMP thread per core, and two workers' threads on the same cores wait on
    each other at every parallel region (a decode step went from ~30 ms to seconds on 2
    cores). More workers than cores: one core each, round robin."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if num_workers <= 0 or not cpus:
        return []
    if num_workers >= len(cpus):
        return [str(cpus[i % len(cpus)]) for i in range(num_workers)]
    size, extra = divmod(len(cpus), num_workers)
    shares, start = [], 0
    for i in range(num_workers):
        end = start + size + (i < extra)
        shares.append(",".join(str(c) for c in cpus[start:end]))
        start = end
    return shares
