from __future__ import annotations

import argparse
import asyncio

import pytest
from tests.support.instances import backend_instance

from tandem.errors import InvalidRequest, NoWorkersAvailable, Overloaded
from tandem.protocols.discovery import Instance
from tandem.protocols.engine import PreprocessedRequest, RoutingHints, StopConditions
from tandem.protocols.kv_events import LoadMetrics, encode
from tandem.router.args import add_router_args, router_config_from_args
from tandem.router.config import RouterConfig
from tandem.router.registry import make_router
from tandem.router.source import StaticInstanceSet
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.flag_parser import parse_args

pytestmark = pytest.mark.timeout(10)


def inst(i: int) -> Instance:
    return backend_instance(i)


def req(rid: str = "r", pinned: str | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="m",
        token_ids=[1, 2, 3],
        stop=StopConditions(max_tokens=4),
        routing=RoutingHints(worker_id=pinned) if pinned else None,
    )


def test_unknown_policy_names_choices() -> None:
    with pytest.raises(
        ValueError, match=r"unknown router policy 'kv2'; expected one of: .*round_robin"
    ):
        make_router("kv2", RouterConfig(), instances=StaticInstanceSet())


def test_config_validation_names_field() -> None:
    with pytest.raises(ValueError, match="temperature=-1"):
        RouterConfig(temperature=-1)


async def test_round_robin_cycles_and_honours_exclude() -> None:
    r = make_router(
        "round_robin", RouterConfig(), instances=StaticInstanceSet([inst(0), inst(1), inst(2)])
    )
    await r.start()
    picks = [(await r.route(req(str(i)))).instance_id for i in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]
    for _ in range(5):
        assert (await r.route(req("x"), exclude=frozenset({"w1"}))).instance_id != "w1"
    await r.close()


async def test_pinning_and_errors() -> None:
    insts = StaticInstanceSet([inst(0), inst(1)])
    r = make_router("random", RouterConfig(seed=1), instances=insts)
    assert (await r.route(req(pinned="w1"))).instance_id == "w1"
    with pytest.raises(InvalidRequest, match="'w9' is unknown or not live") as err:
        await r.route(req(pinned="w9"))
    assert "w0" not in str(err.value) and "w1" not in str(err.value)  # the fleet is not shown
    with pytest.raises(InvalidRequest) as err:
        await r.route(req(pinned="x" * 10_000))
    assert len(str(err.value)) < 300  # nor a megabyte echoed back
    with pytest.raises(NoWorkersAvailable):
        await r.route(req(), exclude=frozenset({"w0", "w1"}))
    insts.remove("w0")
    insts.remove("w1")
    with pytest.raises(NoWorkersAvailable):
        await r.route(req())


async def test_least_loaded_uses_inflight_and_load_metrics() -> None:
    bus = MemoryEventBus()
    r = make_router(
        "least_loaded",
        RouterConfig(seed=0),
        instances=StaticInstanceSet([inst(0), inst(1)]),
        events=bus,
    )
    await r.start()
    await bus.publish(
        "tandem.backend.load_metrics",
        encode(
            LoadMetrics(
                worker_id="w0",
                num_active_blocks=10,
                num_total_blocks=100,
                num_waiting=5,
                num_running=2,
            )
        ),
    )
    for _ in range(50):  # let the follower task drain the subscription
        await asyncio.sleep(0)
        if r.worker_loads()["w0"].get("waiting") == 5:
            break
    assert r.worker_loads()["w0"]["waiting"] == 5
    d1 = await r.route(req("a"))
    assert d1.instance_id == "w1"  # w0 has 5 waiting
    d2 = await r.route(req("b"))
    assert d2.instance_id == "w0"  # w1 now has one in flight
    r.on_finish("a")
    r.on_finish("a")  # idempotent
    assert r.worker_loads()["w1"]["inflight"] == 0
    await r.close()


def test_args_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_KV_OVERLAP_WEIGHT", "2.5")
    p = argparse.ArgumentParser()
    add_router_args(p)
    ns = parse_args(
        p,
        [
            "--router",
            "least_loaded",
            "--router-temperature",
            "0.3",
            "--no-kv-events",
            "--router-queue",
            "4",
        ],
    )
    cfg = router_config_from_args(ns)
    assert ns.router == "least_loaded"
    assert (cfg.overlap_weight, cfg.temperature, cfg.use_kv_events, cfg.queue_size) == (
        2.5,
        0.3,
        False,
        4,
    )
    assert router_config_from_args(parse_args(p, [])).overlap_weight == 2.5


def test_active_and_approx_ttls_have_their_own_flags() -> None:
    p = argparse.ArgumentParser()
    add_router_args(p)
    cfg = router_config_from_args(parse_args(p, ["--router-active-ttl-s", "30"]))
    assert (cfg.active_ttl_s, cfg.approx_ttl_s) == (30.0, 120.0)
    cfg = router_config_from_args(parse_args(p, ["--router-approx-ttl-s", "5"]))
    assert (cfg.active_ttl_s, cfg.approx_ttl_s) == (600.0, 5.0)
    cfg = router_config_from_args(parse_args(p, ["--router-ttl-s", "7"]))  # the old name
    assert (cfg.active_ttl_s, cfg.approx_ttl_s) == (600.0, 7.0)


async def test_busy_queue_is_bounded() -> None:
    from tandem.router.policy_router import AllBusy, RoundRobinRouter

    class Busy(RoundRobinRouter):
        busy = True

        def _choose(self, request, candidates):  # type: ignore[no-untyped-def]
            if self.busy:
                raise AllBusy
            return super()._choose(request, candidates)

    insts = StaticInstanceSet([inst(0)])
    r = Busy(RouterConfig(queue_size=1, queue_timeout_s=5), instances=insts)
    await r.start()
    waiting = asyncio.create_task(r.route(req("q")))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="queue is full"):
        await r.route(req("q2"))
    r.busy = False
    insts.add(inst(1))  # a change wakes the queue
    assert (await asyncio.wait_for(waiting, 2)).instance_id in ("w0", "w1")
    r0 = Busy(RouterConfig(), instances=StaticInstanceSet([inst(0)]))
    with pytest.raises(Overloaded) as exc:
        await r0.route(req())
    assert exc.value.retry_after_s == 1.0
