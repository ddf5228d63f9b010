"""Issue 31 scoring: in-flight prefills count as cached-to-be, measured prefill speed weighs
a worker's prefill blocks, ties keep a shared prefix where it already is."""

from __future__ import annotations

import dataclasses
import random
import statistics

import msgspec
import pytest
from tests.support.instances import backend_instance

from tandem.engines.mocker.perf_model import decode_ms, prefill_ms
from tandem.protocols.discovery import Instance, ModelCard
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.protocols.scaling import StepSample
from tandem.router.active_sequences import ActiveSequences
from tandem.router.config import RouterConfig
from tandem.router.cost import candidate_cost, choose
from tandem.router.kv_router import KvRouter
from tandem.router.registry import make_router
from tandem.router.source import StaticInstanceSet
from tandem.router.step_speed import PrefillSpeed

pytestmark = pytest.mark.timeout(10)
B = 4


def inst(i: int) -> Instance:
    card = ModelCard(name="m", context_length=4096, block_size=B, num_total_blocks=1000)
    return backend_instance(i, card)


def req(rid: str, tokens: list[int]) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=tokens, stop=StopConditions(max_tokens=4)
    )


def kv(n: int) -> KvRouter:
    r = make_router(
        "kv", RouterConfig(seed=0), instances=StaticInstanceSet([inst(i) for i in range(n)])
    )
    assert isinstance(r, KvRouter)
    return r


def test_prefix_depth_is_the_leading_run_in_flight_on_the_worker() -> None:
    active = ActiveSequences(ttl_s=60, clock=lambda: 0.0)
    active.add("a", "w0", [1, 2, 3, 4], 16)
    assert active.prefix_depth("w0", [1, 2, 3, 9, 4]) == 3
    assert active.prefix_depth("w1", [1, 2]) == 0
    active.free("a")
    assert active.prefix_depth("w0", [1, 2]) == 0


async def test_a_request_behind_its_prefix_in_flight_stays_with_it() -> None:
    """Before any KV event, a request extending a prompt still being prefilled costs the same
    on that worker (waiting for the prefill there) as on an idle one (computing it again): the
    in-flight blocks count as cached-to-be, and the tie keeps the prefix in one cache."""
    r = kv(4)
    prefix = list(range(400))  # 100 blocks
    first = await r.route(req("a", prefix))
    d = await r.route(req("b", [*prefix, 9001, 9002, 9003, 9004]))
    assert (d.instance_id, d.overlap_blocks) == (first.instance_id, 100)
    r.active.check_integrity()


async def test_unrelated_requests_still_spread() -> None:
    r = kv(4)
    picks = {(await r.route(req(str(i), [1000 * (i + 1) + t for t in range(32)]))).instance_id
             for i in range(4)}  # fmt: skip
    assert picks == {"w0", "w1", "w2", "w3"}


def test_slowness_multiplies_prefill_blocks_only() -> None:
    common = dict(num_tokens=64, block_size=B, overlap_blocks=4.0, active_prefill_tokens=16,
                  active_blocks=10, num_new_blocks=12, overlap_weight=4.0)  # fmt: skip
    fast = candidate_cost(worker_id="f", **common)  # type: ignore[arg-type]
    slow = candidate_cost(worker_id="s", prefill_slowness=4.0, **common)  # type: ignore[arg-type]
    assert fast.prefill_blocks == slow.prefill_blocks == (16 + 48) / B
    assert fast.cost == 4.0 * 16 + 22 and slow.cost == 4.0 * 4.0 * 16 + 22


def test_ties_prefer_the_candidate_already_holding_more_of_the_prompt() -> None:
    common = dict(num_tokens=64, block_size=B, active_prefill_tokens=0, active_blocks=0,
                  num_new_blocks=0, overlap_weight=1.0)  # fmt: skip
    holder = candidate_cost(worker_id="h", overlap_blocks=8.0, **common)  # type: ignore[arg-type]
    other = candidate_cost(worker_id="o", overlap_blocks=0.0, **common)  # type: ignore[arg-type]
    other = dataclasses.replace(other, cost=holder.cost)  # a tie
    for seed in range(8):
        assert choose([other, holder], 0.0, random.Random(seed)).worker_id == "h"


def _steps(ms_per_token: float, fixed_ms: float, sizes: list[int]) -> list[StepSample]:
    return [StepSample(fixed_ms + ms_per_token * t, t, 0, 1, 0) for t in sizes]


def test_prefill_speed_is_the_fitted_slope_not_the_ratio() -> None:
    """A worker whose prompts hit its cache prefills in small steps; the fixed part of a
    step must not make it look slower than an equal worker prefilling big steps."""
    speed = PrefillSpeed()
    speed.observe("big", _steps(0.015, 20.0, [8192, 4096, 6000, 2048] * 4))
    speed.observe("small", _steps(0.015, 20.0, [64, 128, 512, 256] * 4))
    speed.observe("slow", _steps(0.060, 80.0, [8192, 4096, 6000, 2048] * 4))
    s = speed.slowness(["big", "small", "slow", "unknown"])
    assert s["big"] == pytest.approx(1.0) and s["unknown"] == 1.0
    assert s["small"] == pytest.approx(1.0, abs=0.01)
    assert s["slow"] == pytest.approx(4.0, rel=0.01)
    speed.forget("slow")
    assert speed.ms_per_token("slow") is None


def _theil_sen(points: list[tuple[float, int]]) -> tuple[float, float]:
    """The fit by its definition, pair by pair (PrefillSpeed computes it over arrays)."""
    spread = 0.25 * sum(t for _, t in points) / len(points)
    slopes = [(mj - mi) / (tj - ti) for k, (mi, ti) in enumerate(points)
              for mj, tj in points[k + 1 :] if abs(tj - ti) >= spread]  # fmt: skip
    if len(slopes) >= len(points) and (slope := statistics.median(slopes)) > 0:
        intercept = statistics.median(ms - slope * t for ms, t in points)
        return slope, statistics.median(abs(ms - intercept - slope * t) / ms for ms, t in points)
    ratio = statistics.median(ms / t for ms, t in points)
    return ratio, statistics.median(abs(ms / t - ratio) / (ms / t) for ms, t in points)


def test_the_prefill_speed_fit_is_theil_sen_over_every_pair_of_the_window() -> None:
    """Windows of every size up to the full one, of mixed and of equal step sizes (then too
    few pairs differ and the median ratio stands in), fit as the pair-by-pair definition."""
    rng = random.Random(5)
    for n in range(3, 80):
        speed = PrefillSpeed()
        sizes = [512] * n if n % 4 == 0 else [rng.choice([64, 300, 2048, 8192]) for _ in range(n)]
        steps = [StepSample(16.5 + 0.015 * t * rng.uniform(0.8, 1.3), t, 0, 1, 0) for t in sizes]
        speed.observe("w", steps)
        window = [(s.wall_ms, s.num_prefill_tokens) for s in steps[-64:]]
        slope, error = _theil_sen(window)
        fit = speed._estimate["w"]
        assert fit is not None
        assert fit.ms == pytest.approx(slope, rel=1e-12)
        assert fit.error == pytest.approx(error, rel=1e-12, abs=1e-15)


def test_decode_rows_in_a_workers_steps_do_not_make_it_look_slow() -> None:
    """Two equal workers; one's steps also carry 30 ms of decode rows (more of its KV pool in
    use): the time per prompt token is the same, so is the slowness."""
    speed = PrefillSpeed()
    sizes = [8192, 4096, 6000, 2048, 512, 1024] * 4
    speed.observe("idle", _steps(0.015, 16.5, sizes))
    speed.observe("decoding", _steps(0.015, 46.5, sizes))
    s = speed.slowness(["idle", "decoding"])
    assert s["decoding"] == pytest.approx(1.0, abs=0.01)


def test_equal_workers_within_their_noise_are_not_told_apart() -> None:
    """Three equal workers whose steps jitter by up to ±15 % (decode rows, the host): their
    point slopes differ by a few per cent, within their fits' errors, so none reads
    slower; a worker twice as slow under the same jitter still reads about 2."""
    rng = random.Random(7)
    sizes = [8192, 4096, 6000, 2048, 512, 1024, 3000, 7000] * 8

    def jittered(ms_per_token: float) -> list[StepSample]:
        steps = _steps(ms_per_token, 20.0, sizes)
        return [msgspec.structs.replace(s, wall_ms=s.wall_ms * rng.uniform(0.85, 1.15))
                for s in steps]  # fmt: skip

    speed = PrefillSpeed()
    for w in ("a", "b", "c"):
        speed.observe(w, jittered(0.015))
    speed.observe("slow", jittered(0.030))
    points = [speed.ms_per_token(w) or 0.0 for w in ("a", "b", "c")]
    assert max(points) / min(points) > 1.005  # the point estimates alone would differ
    s = speed.slowness(["a", "b", "c", "slow"])
    assert s["a"] == s["b"] == s["c"] == 1.0
    assert s["slow"] == pytest.approx(2.0, rel=0.1)


def test_equal_mocker_workers_read_equal_whatever_chunks_they_prefilled() -> None:
    """The mocker's step time is quadratic in the prompt tokens plus its decode time when
    the step carries decode rows: a straight line fitted to big chunks is steeper than one
    fitted to small chunks. Equal workers still read 1; one at half speed reads about 2."""
    rng = random.Random(3)

    def steps(sizes: list[int], speed: float) -> list[StepSample]:
        out = []
        for t in sizes:
            ms = prefill_ms(t) + (decode_ms(rng.uniform(0.05, 0.6)) if rng.random() < 0.7 else 0)
            out.append(StepSample(ms / speed, t, 0, 1, 0))
        return out

    speed = PrefillSpeed()
    speed.observe("big", steps([rng.randrange(2048, 8193) for _ in range(64)], 1.0))
    speed.observe("small", steps([rng.randrange(256, 3000) for _ in range(64)], 1.0))
    speed.observe("mixed", steps([rng.randrange(256, 8193) for _ in range(64)], 1.0))
    speed.observe("half", steps([rng.randrange(256, 8193) for _ in range(64)], 0.5))
    s = speed.slowness(["big", "small", "mixed", "half"])
    assert s["big"] == s["small"] == s["mixed"] == 1.0, s
    assert s["half"] == pytest.approx(2.0, rel=0.25), s


def test_a_few_steps_the_host_stole_time_from_do_not_make_a_worker_slow() -> None:
    """Three steps of sixteen took 4-6x their time (a shared host's CPU was elsewhere): the
    worker stays as fast as its equal peer; a worker slow in every step still reads slow."""
    speed = PrefillSpeed()
    sizes = [8192, 4096, 6000, 2048] * 4
    speed.observe("steady", _steps(0.015, 20.0, sizes))
    noisy = _steps(0.015, 20.0, sizes)
    for i, factor in ((1, 5.0), (6, 4.0), (11, 6.0)):
        noisy[i] = msgspec.structs.replace(noisy[i], wall_ms=noisy[i].wall_ms * factor)
    speed.observe("noisy", noisy)
    speed.observe("slow", _steps(0.030, 40.0, sizes))
    s = speed.slowness(["steady", "noisy", "slow"])
    assert s["noisy"] == pytest.approx(1.0, abs=0.05)
    assert s["slow"] == pytest.approx(2.0, rel=0.05)


async def test_router_sends_prefill_to_the_measured_faster_worker() -> None:
    r = kv(2)
    r.speed.observe("w0", _steps(0.060, 80.0, [8192, 2048, 4096, 1024] * 4))
    r.speed.observe("w1", _steps(0.015, 20.0, [8192, 2048, 4096, 1024] * 4))
    d = await r.route(req("a", list(range(400))))
    assert d.instance_id == "w1"
    rows = {c["worker_id"]: c for c in r.explain(req("b", list(range(500, 900))))["candidates"]}
    assert rows["w0"]["prefill_slowness"] == pytest.approx(4.0, rel=0.01)
    loads = r.worker_loads()  # /metrics and /dashboard show the measured speed
    assert loads["w0"]["prefill_ms_per_token"] == pytest.approx(
        4 * loads["w1"]["prefill_ms_per_token"]
    )
