"""Per-tenant requests/min and tokens/min limits (issue 33), shared by the frontends of a host.

Each limit is a token bucket of `limit` units refilled at `limit`/60 per second, kept in one
SQLite file (WAL; each check is one short `BEGIN IMMEDIATE` transaction), so every frontend
process on a host that opens the same file draws from the same buckets. A request takes 1
from its tenant's request bucket and its prompt tokens from its token bucket at admission
(refused, nothing taken, when either lacks them: 429 + Retry-After + OpenAI's
`x-ratelimit-*` headers); its generated tokens are taken when it ends and may leave the
token bucket in debt, which delays the tenant's next request.

Across hosts the file is not shared: each host enforces its own buckets, so a tenant served
by H hosts gets up to H times its limits. Give each host `limit / H`, or send a tenant's
traffic to one host (see the README's "Tenants").
"""

from __future__ import annotations

import math
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import RateLimited

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS bucket (tenant TEXT NOT NULL, kind TEXT NOT NULL, "
    "level REAL NOT NULL, at REAL NOT NULL, PRIMARY KEY (tenant, kind))"
)


@dataclass(frozen=True, slots=True)
class BucketState:
    """One bucket after a check: its limit per minute, what is left, and seconds until full."""

    limit: int
    remaining: float
    reset_s: float


def default_db_path(tenants_file: Path | None) -> Path:
    """Where frontends of one host that read the same tenants file keep their buckets."""
    import hashlib

    tag = hashlib.sha1(str(tenants_file.resolve() if tenants_file else "-").encode()).hexdigest()
    return Path(tempfile.gettempdir()) / f"tandem-limits-{tag[:12]}.sqlite"


class RateLimiter:
    """Token buckets in a SQLite file; safe across processes (SQLite's lock) and threads."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock  # wall clock: processes share it
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=5.0, isolation_level=None,
                                   check_same_thread=False)  # fmt: skip
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=OFF")  # counters, not records: a crash loses a refill
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def take(
        self, tenant: str, costs: dict[str, tuple[int, float]], *, allow_debt: bool = False
    ) -> dict[str, BucketState]:
        """Take `cost` from each bucket `kind` of limit `limit` (costs: kind -> (limit, cost)),
        all or none. Raises RateLimited (with headers) when a bucket lacks its cost, unless
        `allow_debt`. Returns each bucket's state after."""
        now = self._clock()
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                levels = {kind: self._level(cur, tenant, kind, limit, now)
                          for kind, (limit, _) in costs.items()}  # fmt: skip
                short = [k for k, (_, cost) in costs.items() if cost > levels[k] + 1e-9]
                if short and not allow_debt:
                    cur.execute("ROLLBACK")
                    states = {k: _state(costs[k][0], levels[k]) for k in costs}
                    raise self._refused(tenant, short, costs, levels, states)
                for kind, (_, cost) in costs.items():
                    levels[kind] -= cost
                    cur.execute(
                        "INSERT INTO bucket VALUES (?, ?, ?, ?) ON CONFLICT(tenant, kind) "
                        "DO UPDATE SET level = excluded.level, at = excluded.at",
                        (tenant, kind, levels[kind], now),
                    )
                cur.execute("COMMIT")
            except sqlite3.Error:
                cur.execute("ROLLBACK")
                raise
        return {k: _state(costs[k][0], levels[k]) for k in costs}

    @staticmethod
    def _level(cur: sqlite3.Cursor, tenant: str, kind: str, limit: int, now: float) -> float:
        row = cur.execute(
            "SELECT level, at FROM bucket WHERE tenant = ? AND kind = ?", (tenant, kind)
        ).fetchone()
        if row is None:
            return float(limit)
        level, at = float(row[0]), float(row[1])
        return min(float(limit), level + max(now - at, 0.0) * limit / 60.0)

    @staticmethod
    def _refused(
        tenant: str,
        short: list[str],
        costs: dict[str, tuple[int, float]],
        levels: dict[str, float],
        states: dict[str, BucketState],
    ) -> RateLimited:
        waits = {k: (costs[k][1] - levels[k]) * 60.0 / costs[k][0] for k in short}
        kind = max(waits, key=lambda k: waits[k])
        limit, cost = costs[kind]
        hint = (
            f"; one request of {int(cost)} tokens exceeds the limit itself"
            if cost > limit
            else f"; retry after {math.ceil(waits[kind])} s"
        )
        exc = RateLimited(
            f"tenant {tenant!r} reached its limit of {limit} {kind}/min "
            f"({max(levels[kind], 0):.0f} left, {cost:.0f} asked){hint}",
            retry_after_s=max(waits[kind], 1.0),
        )
        exc.headers = ratelimit_headers(states)
        return exc


def _state(limit: int, level: float) -> BucketState:
    return BucketState(limit, level, max(limit - level, 0.0) * 60.0 / limit)


def ratelimit_headers(states: dict[str, BucketState]) -> list[tuple[str, str]]:
    """OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` response headers."""
    out: list[tuple[str, str]] = []
    for kind, state in sorted(states.items()):
        out.append((f"x-ratelimit-limit-{kind}", str(state.limit)))
        out.append((f"x-ratelimit-remaining-{kind}", str(max(int(state.remaining), 0))))
        out.append((f"x-ratelimit-reset-{kind}", f"{state.reset_s:.3f}s"))
    return out
