"""`GlobalRouterConfig`: pools and the grids that map latency targets to them (a JSON file).

    {"host": "127.0.0.1", "port": 8100, "tokenizer": "gguf:/path/model.gguf",
     "pools": [{"name": "fast", "namespace": "fast", "url": "http://127.0.0.1:8001"},
               {"name": "cheap", "namespace": "cheap", "url": "http://127.0.0.1:8002"}],
     "aggregated": {"ttft_ms": [300, 2000], "itl_ms": [30, 200],
                    "pools": [["fast", "fast"], ["fast", "cheap"]]},
     "prefill": {"isl": [1024, 8192], "ttft_ms": [300, 2000], "pools": [[...], [...]]},
     "decode": {"context": [2048, 16384], "itl_ms": [30, 200], "pools": [[...], [...]]},
     "disaggregated": [{"prefill": "p-fast", "decode": "d-fast", "url": "http://..."}],
     "priority": [{"min": 8, "max": 10, "pool": "fast"}]}

Pools are listed fastest first; a pool is a namespace with its own workers and local router,
reached through its frontend `url`. `namespace` is the one that frontend serves: the router
checks it against the frontend's `/health` before sending there (a url that points at another
pool is refused), and the two pools of a disaggregated pair share one (their pair's frontend
serves both). A grid's axes are bucket upper bounds (a value above the
last bound falls in the last bucket); `pools[i][j]` serves row bucket i, column bucket j.
Aggregated: (TTFT target, ITL target). Prefill-first disaggregated: the prefill pool from
(ISL, TTFT target), the decode pool from (context length, ITL target), and the pair's
frontend (one that runs the prefill-first flow over those two pools) from `disaggregated`.
A request without targets gets each grid's middle target (the middle bound of its axis).
With both kinds configured, an aggregated cell holding "disaggregated" hands its requests
to the prefill and decode grids (with the request's or the aggregated grid's targets); the
other cells name aggregated pools.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import msgspec

DISAGGREGATED = "disaggregated"  # an aggregated grid cell: use the prefill + decode grids


class PoolSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    namespace: str
    url: str = ""  # its frontend; pools used only through a disaggregated pair may omit it


class Grid(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Row axis × column axis → pool name. Field names say which axes (see the module doc)."""

    rows: list[float]
    cols: list[float]
    pools: list[list[str]]

    def lookup(self, row: float, col: float) -> str:
        i = min(bisect.bisect_left(self.rows, row), len(self.rows) - 1)
        j = min(bisect.bisect_left(self.cols, col), len(self.cols) - 1)
        return self.pools[i][j]

    def middle(self, axis: list[float]) -> float:
        return axis[(len(axis) - 1) // 2]


class DisaggPair(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prefill: str
    decode: str
    url: str


class PriorityRule(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    min: int
    max: int
    pool: str


class _AggregatedGrid(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    ttft_ms: list[float]
    itl_ms: list[float]
    pools: list[list[str]]


class _PrefillGrid(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    isl: list[float]
    ttft_ms: list[float]
    pools: list[list[str]]


class _DecodeGrid(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    context: list[float]
    itl_ms: list[float]
    pools: list[list[str]]


class GlobalRouterFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8100
    tokenizer: str | None = None  # counts ISL; None: the default model's (SmolLM2 GGUF)
    pools: list[PoolSpec]
    aggregated: _AggregatedGrid | None = None
    prefill: _PrefillGrid | None = None
    decode: _DecodeGrid | None = None
    disaggregated: list[DisaggPair] = msgspec.field(default_factory=list)
    priority: list[PriorityRule] = msgspec.field(default_factory=list)
    retry_faster: bool = True  # before the first byte, a failed pool hands over to a faster one


class GlobalRouterConfig:
    """The validated file. Raises ValueError naming the field and the offending value."""

    def __init__(self, raw: GlobalRouterFile) -> None:
        self.raw = raw
        self.pools = {p.name: p for p in raw.pools}
        if len(self.pools) != len(raw.pools):
            raise ValueError(f"pool names repeat: {[p.name for p in raw.pools]}")
        self.order = [p.name for p in raw.pools]  # fastest first
        self.aggregated = self.prefill = self.decode = None
        if raw.aggregated is not None:
            g = raw.aggregated
            self.aggregated = self._grid("aggregated", g.ttft_ms, g.itl_ms, g.pools)
        if raw.prefill is not None:
            self.prefill = self._grid("prefill", raw.prefill.isl, raw.prefill.ttft_ms,
                                      raw.prefill.pools)  # fmt: skip
        if raw.decode is not None:
            self.decode = self._grid("decode", raw.decode.context, raw.decode.itl_ms,
                                     raw.decode.pools)  # fmt: skip
        if (self.prefill is None) != (self.decode is None):
            raise ValueError("'prefill' and 'decode' grids go together (prefill-first flow)")
        if self.aggregated is None and self.prefill is None:
            raise ValueError("expected an 'aggregated' grid or 'prefill' + 'decode' grids")
        if (
            self.aggregated is not None
            and self.prefill is not None
            and not any(n == DISAGGREGATED for row in self.aggregated.pools for n in row)
        ):
            raise ValueError(f"'prefill' + 'decode' grids are unreachable: no 'aggregated' "
                             f"grid cell is '{DISAGGREGATED}'")  # fmt: skip
        for pool in raw.pools:
            if not pool.namespace or "." in pool.namespace:
                raise ValueError(f"pool '{pool.name}' namespace={pool.namespace!r}: expected the "
                                 "non-empty namespace (no '.') its frontend serves")  # fmt: skip
        self.pairs = {(p.prefill, p.decode): p.url for p in raw.disaggregated}
        for pn, dn in self.pairs:
            self._known("disaggregated", pn, dn)
            p_ns, d_ns = self.pools[pn].namespace, self.pools[dn].namespace
            if p_ns != d_ns:  # a frontend runs the prefill-first flow within its one namespace
                raise ValueError(f"disaggregated pair '{pn}' + '{dn}': prefill namespace "
                                 f"'{p_ns}' != decode namespace '{d_ns}'; one frontend serves "
                                 "both pools of a pair, so they share its namespace")  # fmt: skip
        if self.prefill is not None and self.decode is not None:
            for pn in {n for row in self.prefill.pools for n in row}:
                for dn in {n for row in self.decode.pools for n in row}:
                    if (pn, dn) not in self.pairs:
                        raise ValueError(f"no 'disaggregated' entry for prefill pool '{pn}' "
                                         f"with decode pool '{dn}'")  # fmt: skip
        for rule in raw.priority:
            self._known("priority", rule.pool)
            if rule.min > rule.max:
                raise ValueError(f"priority rule min={rule.min} > max={rule.max}")
            if self.aggregated is not None and not self.pools[rule.pool].url:
                raise ValueError(f"priority pool '{rule.pool}' has no url")

    def _known(self, where: str, *names: str) -> None:
        for name in names:
            if name not in self.pools:
                raise ValueError(f"{where}: unknown pool '{name}'; expected one of: "
                                 f"{', '.join(self.order)}")  # fmt: skip

    def _grid(self, name: str, rows: list[float], cols: list[float],
              pools: list[list[str]]) -> Grid:  # fmt: skip
        for axis_name, axis in (("rows", rows), ("cols", cols)):
            if not axis or sorted(axis) != axis:
                raise ValueError(f"{name} grid {axis_name}={axis}: expected increasing bounds")
        if len(pools) != len(rows) or any(len(r) != len(cols) for r in pools):
            raise ValueError(f"{name} grid pools must be {len(rows)} rows × {len(cols)} columns")
        for row in pools:
            if name == "aggregated" and self.raw.prefill is not None:
                row = [n for n in row if n != DISAGGREGATED]
            self._known(f"{name} grid", *row)
        return Grid(rows=rows, cols=cols, pools=pools)

    def faster_than(self, name: str) -> list[str]:
        """Pools with a url listed before `name`, nearest first (the retry order)."""
        i = self.order.index(name)
        return [n for n in reversed(self.order[:i]) if self.pools[n].url]


def load_config(path: str | Path) -> GlobalRouterConfig:
    try:
        raw = msgspec.json.decode(Path(path).read_bytes(), type=GlobalRouterFile)
        return GlobalRouterConfig(raw)
    except (OSError, msgspec.MsgspecError, ValueError) as exc:
        raise ValueError(f"global router config {path}: {exc}") from exc
