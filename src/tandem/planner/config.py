"""`PlannerConfig` and `PoolConfig`: the planner's knobs, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config_check import check_range

MODES = ("load", "throughput")
POOL_KINDS = ("aggregated", "prefill", "decode")


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolConfig:
    """One pool of workers: the component its workers register as, its role and bounds."""

    component: str = "backend"
    kind: str = "aggregated"
    min_workers: int = 1
    max_workers: int = 8

    def __post_init__(self) -> None:
        if not self.component or "." in self.component:
            raise ValueError(f"component={self.component!r} must be non-empty without '.'")
        if self.kind not in POOL_KINDS:
            raise ValueError(
                f"unknown pool kind '{self.kind}'; expected one of: {', '.join(POOL_KINDS)}"
            )
        check_range("min_workers", self.min_workers, low=0, high=1 << 16)
        check_range("max_workers", self.max_workers, low=max(self.min_workers, 1), high=1 << 16)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """Targets in ms, times in s. `scale_down_margin`: survivors must stay under target × this.
    `max_total_workers`: the budget over all pools (0 = sum of the pools' max)."""

    mode: str = "load"
    pools: tuple[PoolConfig, ...] = field(default_factory=lambda: (PoolConfig(),))
    ttft_target_ms: float = 500.0
    itl_target_ms: float = 50.0
    interval_s: float = 2.0
    scale_down_margin: float = 0.7
    kv_fit_fraction: float = 0.9  # survivors' KV use after a scale-down stays under this
    cooldown_up_s: float = 5.0
    cooldown_down_s: float = 15.0
    # a scale-down needs every verdict of this long to say so (one quiet interval is noise)
    scale_down_stable_s: float = 5.0
    ready_timeout_s: float = 60.0  # a new worker not ready by then is given up on
    drain_timeout_s: float = 120.0  # a draining worker still listed by then is counted stuck
    max_total_workers: int = 0
    predictor: str = "holt"
    profile_path: str | None = None  # throughput mode: `tandem profile` JSON
    stats_window_s: float = 10.0  # step samples and request stats older than this are dropped

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"unknown planner mode '{self.mode}'; expected one of: load, throughput"
            )
        if not self.pools:
            raise ValueError("pools=() is empty; expected at least one pool")
        names = [p.component for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pools name a component twice: {names}")
        if self.mode == "throughput" and self.profile_path is None:
            raise ValueError("mode 'throughput' needs profile_path (a `tandem profile` JSON)")
        check_range("ttft_target_ms", self.ttft_target_ms, low=0.001, high=1e7)
        check_range("itl_target_ms", self.itl_target_ms, low=0.001, high=1e7)
        check_range("interval_s", self.interval_s, low=0.01, high=3600)
        check_range("scale_down_margin", self.scale_down_margin, low=0.05, high=1.0)
        check_range("kv_fit_fraction", self.kv_fit_fraction, low=0.05, high=1.0)
        check_range("cooldown_up_s", self.cooldown_up_s, low=0, high=86400)
        check_range("cooldown_down_s", self.cooldown_down_s, low=0, high=86400)
        check_range("scale_down_stable_s", self.scale_down_stable_s, low=0, high=86400)
        check_range("ready_timeout_s", self.ready_timeout_s, low=0.1, high=86400)
        check_range("drain_timeout_s", self.drain_timeout_s, low=0.1, high=86400)
        check_range("max_total_workers", self.max_total_workers, low=0, high=1 << 20)
        check_range("stats_window_s", self.stats_window_s, low=0.1, high=86400)

    @property
    def budget(self) -> int:
        return self.max_total_workers or sum(p.max_workers for p in self.pools)
