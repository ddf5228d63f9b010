from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from tandem.errors import InvalidRequest
from tandem.planner.global_router.config import GlobalRouterConfig, GlobalRouterFile, load_config
from tandem.planner.global_router.decision import Targets, decide, targets_from


def _config(**extra: Any) -> GlobalRouterConfig:
    raw = {
        "pools": [{"name": "fast", "namespace": "fast", "url": "http://f"},
                  {"name": "mid", "namespace": "mid", "url": "http://m"},
                  {"name": "cheap", "namespace": "cheap", "url": "http://c"}],
        "aggregated": {"ttft_ms": [200, 1000, 5000], "itl_ms": [20, 100],
                       "pools": [["fast", "fast"], ["fast", "mid"], ["mid", "cheap"]]},
        "priority": [{"min": 8, "max": 10, "pool": "fast"}],
        **extra,
    }  # fmt: skip
    return GlobalRouterConfig(msgspec.convert(raw, GlobalRouterFile))


def test_grid_buckets_by_upper_bound_and_defaults_to_the_middle() -> None:
    cfg = _config()
    assert decide(cfg, Targets(ttft_ms=150, itl_ms=15), 100, 10).pool == "fast"
    assert decide(cfg, Targets(ttft_ms=900, itl_ms=50), 100, 10).pool == "mid"
    assert decide(cfg, Targets(ttft_ms=99_999, itl_ms=99_999), 100, 10).pool == "cheap"
    # no targets: the middle of each axis (1000 ms, 20 ms) → row 1, column 0
    assert decide(cfg, Targets(), 100, 10).pool == "fast"
    assert decide(cfg, Targets(ttft_ms=3000), 100, 10).pool == "mid"


def test_priority_overrides_the_grid() -> None:
    cfg = _config()
    d = decide(cfg, Targets(ttft_ms=99_999, itl_ms=99_999, priority=9), 100, 10)
    assert d.pool == "fast" and "priority 9" in d.reason
    assert decide(cfg, Targets(ttft_ms=99_999, itl_ms=99_999, priority=3), 100, 10).pool == "cheap"


def test_retry_order_is_faster_pools_nearest_first() -> None:
    assert _config().faster_than("cheap") == ["mid", "fast"]
    assert _config().faster_than("fast") == []


def test_prefill_first_pairs_from_two_grids() -> None:
    raw = {
        # one namespace: each pair's frontend runs its prefill and decode pools (components)
        "pools": [{"name": "pf", "namespace": "pd"}, {"name": "ps", "namespace": "pd"},
                  {"name": "df", "namespace": "pd"}, {"name": "ds", "namespace": "pd"}],
        "prefill": {"isl": [1000, 8000], "ttft_ms": [300, 3000],
                    "pools": [["pf", "ps"], ["pf", "pf"]]},
        "decode": {"context": [2000, 16000], "itl_ms": [30, 300],
                   "pools": [["df", "ds"], ["df", "df"]]},
        "disaggregated": [{"prefill": p, "decode": d, "url": f"http://{p}{d}"}
                          for p in ("pf", "ps") for d in ("df", "ds")],
    }  # fmt: skip
    cfg = GlobalRouterConfig(msgspec.convert(raw, GlobalRouterFile))
    d = decide(cfg, Targets(ttft_ms=2000, itl_ms=200), isl=500, max_tokens=100)
    assert (d.pool, d.url) == ("ps+ds", "http://psds")
    assert decide(cfg, Targets(ttft_ms=2000, itl_ms=200), isl=5000, max_tokens=100).pool == "pf+df"


def _mixed(cell: str = "disaggregated") -> GlobalRouterConfig:
    raw = {
        "pools": [{"name": "agg", "namespace": "agg", "url": "http://agg"},
                  {"name": "pf", "namespace": "pd"}, {"name": "df", "namespace": "pd"}],
        "aggregated": {"ttft_ms": [300, 2000, 9000], "itl_ms": [50],
                       "pools": [[cell], ["agg"], ["agg"]]},
        "prefill": {"isl": [8000], "ttft_ms": [3000], "pools": [["pf"]]},
        "decode": {"context": [16000], "itl_ms": [300], "pools": [["df"]]},
        "disaggregated": [{"prefill": "pf", "decode": "df", "url": "http://pd"}],
    }  # fmt: skip
    return GlobalRouterConfig(msgspec.convert(raw, GlobalRouterFile))


def test_an_aggregated_cell_hands_over_to_the_prefill_first_pair() -> None:
    cfg = _mixed()
    d = decide(cfg, Targets(ttft_ms=200), isl=100, max_tokens=10)
    assert (d.pool, d.url, d.retry_from) == ("pf+df", "http://pd", "pf")
    assert cfg.faster_than(d.retry_from) == ["agg"]  # a dead pair walks on to `agg`
    assert decide(cfg, Targets(), isl=100, max_tokens=10).pool == "agg"  # middle: 2000 ms
    assert decide(cfg, Targets(ttft_ms=1000), isl=100, max_tokens=10).pool == "agg"
    with pytest.raises(ValueError, match="unreachable: no 'aggregated' grid cell"):
        _mixed(cell="agg")  # pair grids nobody reaches are an error, not silently ignored
    with pytest.raises(ValueError, match="unknown pool 'disaggregated'"):
        _config(aggregated={"ttft_ms": [1], "itl_ms": [1], "pools": [["disaggregated"]]})


def test_a_pool_namespace_is_checked_not_ignored() -> None:
    raw = msgspec.to_builtins(_mixed().raw)
    raw["pools"][2]["namespace"] = "elsewhere"  # the pair's decode pool in another namespace
    with pytest.raises(ValueError, match="prefill namespace 'pd' != decode namespace 'elsewhere'"):
        GlobalRouterConfig(msgspec.convert(raw, GlobalRouterFile))
    raw["pools"][2]["namespace"] = "a.b"
    with pytest.raises(ValueError, match=r"pool 'df' namespace='a.b': expected the non-empty"):
        GlobalRouterConfig(msgspec.convert(raw, GlobalRouterFile))


def test_config_errors_name_the_offender(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown pool 'nope'"):
        _config(priority=[{"min": 1, "max": 2, "pool": "nope"}])
    path = tmp_path / "g.json"
    path.write_text('{"pools": [], "bogus": 1}')
    with pytest.raises(ValueError, match=f"global router config {path}.*bogus"):
        load_config(path)


def test_request_fields_are_validated_and_removed() -> None:
    body: dict[str, Any] = {"model": "m", "tandem": {"ttft_target_ms": 250}, "priority": 2}
    assert targets_from(body) == Targets(ttft_ms=250, itl_ms=None, priority=2)
    assert body == {"model": "m"}
    with pytest.raises(InvalidRequest, match=r"tandem.itl_target_ms=-1; expected a number > 0"):
        targets_from({"tandem": {"itl_target_ms": -1}})
    with pytest.raises(InvalidRequest, match="unknown 'tandem' field"):
        targets_from({"tandem": {"ttft": 1}})
