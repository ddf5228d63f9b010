"""Load mode (DESIGN.md §11): per-worker predictions from the pool's step-time regression.

For worker w with `q` waiting requests, uncached prompt length `isl` and `d` decode KV tokens:

    TTFT(w) = Σ over the chunks of (q + 1)·isl prompt tokens of step_ms(chunk, d)
              (queue wait included: the new request's prompt runs after the waiting ones)
    ITL(w)  = (c0 + c2·d) / (1 − c1·r / 1000), r = w's prompt tokens per second
              (decode steps of c0 + c2·d ms share each second with c1·r ms of prefill;
              the mean step, hence the mean ITL, stretches by that share; ∞ when r saturates)

Both predictions model the engine's steps only; what the SLO counts is measured at the
frontend (transport, the frontend's own work, uneven routing, a loaded host). A
`Calibration` (the measured mean over the predicted fleet mean, smoothed by the planner, never
below 1) multiplies the survivors' predictions in the scale-down test, so a model that runs
optimistic on a live fleet does not drain a worker the measured latency still needs (scale-up
needs no such factor: it already answers to the measured means).

Queue wait: a request that finds every worker over the router's busy thresholds waits in the
router's queue, which no worker's `num_waiting` shows. The frontends measure that wait per
dispatch (`PoolTraffic.mean_queue_wait_ms`); it is added to every worker's predicted TTFT
(it comes before any of them), and to the survivors' as q·n/(n−1) (the same queue drained by
fewer workers).

Scale up by one when every worker's TTFT (queue wait included) or every worker's ITL is over
its target (or the frontends measured a mean TTFT/ITL over target in the last interval). Scale
down by one when the frontends' measured means are under target × margin and the n−1
survivors, each taking 1/(n−1) of the pool's total waiting, prefill and decode load, stay under
target × margin and the pool's active KV blocks fit in theirs × kv_fit_fraction.

An idle worker (nothing running, waiting or decoding) is what a new worker would be, so when
the least loaded worker is idle a prediction over target is not a reason to add one (the
model's cost of one request alone is over target: another worker would not lower it); and a
pool with no load on any worker and no traffic scales down to its floor whatever the model
predicts for one request alone, since the survivors then predict what the fleet does now.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.planner.config import PlannerConfig
from tandem.planner.observation import PoolObservation, WorkerView
from tandem.planner.regression import StepCoefficients

DEFAULT_ISL = 512.0  # until a frontend has reported a finished request


@dataclass(frozen=True, slots=True)
class Calibration:
    """Measured over predicted latency (≥ 1): what the engine model leaves out."""

    ttft: float = 1.0
    itl: float = 1.0


@dataclass(frozen=True, slots=True)
class Verdict:
    delta: int  # +1, −1 or 0
    reason: str


def predict_ttft_ms(
    model: StepCoefficients, *, num_waiting: float, isl: float, decode_kv: float, chunk: int
) -> float:
    pending = (num_waiting + 1.0) * isl
    num_full, rest = divmod(pending, float(chunk))
    total = num_full * model.step_ms(chunk, decode_kv)
    if rest > 0:
        total += model.step_ms(rest, decode_kv)
    return total


def predict_itl_ms(
    model: StepCoefficients, *, prefill_tokens_per_s: float, decode_kv: float
) -> float:
    busy_ms = model.ms_per_prefill_token * prefill_tokens_per_s
    if busy_ms >= 1000.0:
        return float("inf")
    decode_ms = model.base_ms + model.ms_per_decode_kv_token * decode_kv
    return decode_ms * 1000.0 / (1000.0 - busy_ms)


def _effective_isl(pool: PoolObservation) -> float:
    t = pool.traffic
    if t is None or not t.num_finished:
        return DEFAULT_ISL
    return max(t.mean_isl * (1.0 - t.cached_fraction), 1.0)


def _worker_ttft(model: StepCoefficients, w: WorkerView, isl: float, growth: float) -> float:
    return predict_ttft_ms(
        model,
        num_waiting=w.num_waiting * growth,
        isl=isl,
        decode_kv=w.decode_kv_tokens,
        chunk=w.max_num_batched_tokens,
    )


def fleet_means(
    pool: PoolObservation, model: StepCoefficients
) -> tuple[float | None, float | None]:
    """The predicted TTFT and ITL of the pool as it is, averaged over its busy workers
    (the frontends' measured means cover requests, and requests run on busy workers);
    None where no worker is busy."""
    busy = [w for w in pool.ready if w.num_inflight > 0 or w.decode_kv_tokens > 0]
    if not busy:
        return None, None
    isl = _effective_isl(pool)
    queued = queue_wait_ms(pool)  # measured: part of what the frontends' TTFT counts
    ttfts = [_worker_ttft(model, w, isl, 1.0) + queued for w in busy]
    itls = [
        predict_itl_ms(
            model, prefill_tokens_per_s=w.prefill_tokens_per_s, decode_kv=w.decode_kv_tokens
        )
        for w in busy
    ]
    return sum(ttfts) / len(ttfts), sum(itls) / len(itls)


def decide(
    pool: PoolObservation,
    model: StepCoefficients,
    cfg: PlannerConfig,
    kind: str = "aggregated",
    growth: float = 1.0,
    calibration: Calibration = Calibration(),
) -> Verdict:
    """`kind` picks the targets that apply: a prefill pool answers for TTFT only, a decode
    pool for ITL only, an aggregated pool for both. `growth` (≥ 1: the forecast rate of the
    next interval over the current one) scales each worker's queue and prompt rate in the
    scale-up test, so a ramp is met before it crosses the target rather than after.
    `calibration` multiplies the survivors' predictions in the scale-down test (scale-up
    already answers to the measured means directly)."""
    workers = pool.ready
    if not workers:
        return Verdict(0, "no ready workers")
    isl = _effective_isl(pool)
    queued = queue_wait_ms(pool) if kind != "decode" else 0.0
    ttfts = [
        _worker_ttft(model, w, isl, growth) + queued if kind != "decode" else 0.0 for w in workers
    ]
    itls = [
        predict_itl_ms(
            model,
            prefill_tokens_per_s=w.prefill_tokens_per_s * growth,
            decode_kv=w.decode_kv_tokens * growth,
        )
        if kind != "prefill"
        else 0.0
        for w in workers
    ]
    t = pool.traffic if kind == "aggregated" else None
    if any(_idle(w) for w in workers) and not queued:
        ttfts = itls = [0.0]  # a new worker would be as idle as that one: no gain to predict
    if min(ttfts) > cfg.ttft_target_ms:
        return Verdict(
            +1,
            f"every worker's predicted TTFT > target (min {min(ttfts):.0f} ms, of it "
            f"{queued:.0f} ms measured queue wait before dispatch)",
        )
    if min(itls) > cfg.itl_target_ms:
        return Verdict(+1, f"every worker's predicted ITL > target (min {min(itls):.1f} ms)")
    if t is not None and t.mean_ttft_ms is not None and t.mean_ttft_ms > cfg.ttft_target_ms:
        return Verdict(+1, f"measured mean TTFT {t.mean_ttft_ms:.0f} ms > target")
    if t is not None and t.mean_itl_ms is not None and t.mean_itl_ms > cfg.itl_target_ms:
        return Verdict(+1, f"measured mean ITL {t.mean_itl_ms:.1f} ms > target")
    hot = cfg.scale_down_margin
    if t is not None and t.mean_ttft_ms is not None and t.mean_ttft_ms > cfg.ttft_target_ms * hot:
        return Verdict(0, f"measured mean TTFT {t.mean_ttft_ms:.0f} ms is over target × margin")
    if t is not None and t.mean_itl_ms is not None and t.mean_itl_ms > cfg.itl_target_ms * hot:
        return Verdict(0, f"measured mean ITL {t.mean_itl_ms:.1f} ms is over target × margin")
    return _scale_down_verdict(workers, model, cfg, isl, kind, calibration, queued)


def _idle(w: WorkerView) -> bool:
    busy = w.num_inflight or w.num_running or w.num_waiting or w.num_active_blocks
    return not (busy or w.decode_kv_tokens or w.prefill_tokens_per_s)


def queue_wait_ms(pool: PoolObservation) -> float:
    """The frontends' measured mean wait before dispatch (0 without traffic)."""
    t = pool.traffic
    return t.mean_queue_wait_ms or 0.0 if t is not None else 0.0


def _scale_down_verdict(
    workers: list[WorkerView],
    model: StepCoefficients,
    cfg: PlannerConfig,
    isl: float,
    kind: str,
    calibration: Calibration,
    queued: float = 0.0,
) -> Verdict:
    n = len(workers)
    if n < 2:
        return Verdict(0, "one worker")
    if all(_idle(w) for w in workers) and not queued:
        return Verdict(-1, f"no load on any of {n} workers")
    survivors = n - 1
    waiting = sum(w.num_waiting for w in workers) / survivors
    decode_kv = sum(w.decode_kv_tokens for w in workers) / survivors
    prefill_rate = sum(w.prefill_tokens_per_s for w in workers) / survivors
    chunk = min(w.max_num_batched_tokens for w in workers)
    ttft = predict_ttft_ms(model, num_waiting=waiting, isl=isl, decode_kv=decode_kv, chunk=chunk)
    ttft = (ttft + queued * n / survivors) * calibration.ttft
    itl = predict_itl_ms(model, prefill_tokens_per_s=prefill_rate, decode_kv=decode_kv)
    itl *= calibration.itl
    if kind == "decode":
        ttft = 0.0
    elif kind == "prefill":
        itl = 0.0
    blocks = sum(w.num_active_blocks for w in workers)
    capacity = sorted(w.num_total_blocks for w in workers)[1:]  # the largest n−1 survive
    if ttft > cfg.ttft_target_ms * cfg.scale_down_margin:
        return Verdict(0, f"survivors' TTFT {ttft:.0f} ms would exceed target × margin")
    if itl > cfg.itl_target_ms * cfg.scale_down_margin:
        return Verdict(0, f"survivors' ITL {itl:.1f} ms would exceed target × margin")
    if blocks > sum(capacity) * cfg.kv_fit_fraction:
        return Verdict(0, f"{blocks} active KV blocks would not fit in {sum(capacity)}")
    return Verdict(-1, f"{survivors} survivors: TTFT {ttft:.0f} ms, ITL {itl:.1f} ms")
