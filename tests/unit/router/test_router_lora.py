"""LoRA placement (router/lora.py): holders first, rendezvous placement on a miss that two
routers agree on, the slot limit, replicas for a hot adapter and their ageing out."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tandem.protocols.discovery import Instance
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.protocols.lora import LoraEvent, encode, lora_events_subject
from tandem.router.config import RouterConfig
from tandem.router.lora import LoraCounters, LoraPlacement, LoraPlacementConfig, rendezvous
from tandem.router.registry import make_router
from tandem.router.source import StaticInstanceSet
from tandem.runtime.events.memory import MemoryEventBus

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def worker(i: int, max_loras: int = 2, loras: tuple[str, ...] = ()) -> Instance:
    return Instance(
        instance_id=f"w{i}",
        namespace="tandem",
        component="backend",
        endpoint="generate",
        address=f"127.0.0.1:{9000 + i}",
        metadata={"lora_state_endpoint": "lora_state", "max_loras": max_loras,
                  "loras": list(loras)},
    )  # fmt: skip


def placement(workers: list[Instance], clock: Clock | None = None, **cfg: object) -> LoraPlacement:
    p = LoraPlacement(LoraPlacementConfig(**cfg), clock or Clock(), LoraCounters())  # type: ignore[arg-type]
    for w in workers:
        p.apply_instance(w)
    return p


def loaded(worker_id: str, name: str, resident: list[str], max_loras: int = 2) -> LoraEvent:
    return LoraEvent(kind="loaded", name=name, worker_id=worker_id, resident=resident,
                     max_loras=max_loras, load_s=0.1)  # fmt: skip


def test_a_request_goes_to_the_worker_holding_its_adapter() -> None:
    ws = [worker(0), worker(1, loras=("sql",)), worker(2)]
    p = placement(ws)
    plan = p.plan("sql", ws)
    assert plan.reason == "holder" and [i.instance_id for i in plan.allowed] == ["w1"]
    # an event moves it: the worker that loaded it is the holder now
    p.apply_event(LoraEvent(kind="evicted", name="sql", worker_id="w1", resident=[]))
    p.apply_event(loaded("w2", "sql", ["sql"]))
    assert [i.instance_id for i in p.plan("sql", ws).allowed] == ["w2"]
    assert p.counters.loads["sql"] == 1 and p.counters.evictions["sql"] == 1
    assert p.counters.resident == {"w0": 0, "w1": 0, "w2": 1}


def test_a_miss_is_placed_by_rendezvous_hashing_and_two_routers_agree() -> None:
    ws = [worker(i, max_loras=4) for i in range(8)]
    for name in ("a", "b", "c", "d", "e"):
        one, two = placement(ws), placement(list(reversed(ws)))
        plan_one, plan_two = one.plan(name, ws), two.plan(name, list(reversed(ws)))
        assert plan_one.reason == "placed"
        best = max(ws, key=lambda w: rendezvous(name, w.instance_id))
        assert plan_one.allowed == plan_two.allowed == [best]
    # once routed there it is held (pending the worker's event): the next request follows
    p = placement(ws)
    plan = p.plan("a", ws)
    p.routed("r1", plan.allowed[0].instance_id, plan, 10)
    assert p.plan("a", ws).reason == "holder"


def test_placement_respects_the_slot_limit() -> None:
    # the adapter's rendezvous favourite has its one slot full: the next worker with a free one
    ws = [worker(i, max_loras=1) for i in range(3)]
    name = "x"
    ranked = sorted(ws, key=lambda w: rendezvous(name, w.instance_id), reverse=True)
    full = ranked[0].instance_id
    p = placement(ws)
    p.apply_event(loaded(full, "other", ["other"], max_loras=1))
    p.routed("busy", full, p.plan("other", ws), 1)  # a request runs with it there
    assert p.plan(name, ws).allowed == [ranked[1]]
    # every slot full and busy everywhere: the favourite still (its LRU makes room later)
    for w in ranked[1:]:
        p.apply_event(loaded(w.instance_id, "o" + w.instance_id, ["o" + w.instance_id], 1))
        p.routed("busy" + w.instance_id, w.instance_id, p.plan("o" + w.instance_id, ws), 1)
    assert p.plan(name, ws).allowed == [ranked[0]]
    # an idle adapter on the third-ranked worker: evictable, so that one is chosen
    p.finished("busy" + ranked[2].instance_id)
    assert p.plan(name, ws).allowed == [ranked[2]]


def test_workers_without_lora_are_left_out() -> None:
    plain = Instance(instance_id="p", namespace="tandem", component="backend",
                     endpoint="generate", address="127.0.0.1:1")  # fmt: skip
    ws = [plain, worker(1)]
    p = placement(ws)
    assert p.plan("a", ws).allowed == [ws[1]]
    only_plain = placement([plain])
    plan = only_plain.plan("a", [plain])
    assert plan.reason == "no_lora_workers" and plan.allowed == [plain]


def test_a_hot_adapter_gets_replicas_and_they_age_out() -> None:
    clock = Clock()
    ws = [worker(i, max_loras=4) for i in range(4)]
    p = placement(ws, clock, replica_load=0.5, max_replicas=3, rate_half_life_s=10.0)
    n = 0

    def send(name: str) -> str:
        nonlocal n
        n += 1
        plan = p.plan(name, ws)
        chosen = plan.allowed[n % len(plan.allowed)].instance_id
        p.routed(f"r{n}", chosen, plan, 8)
        p.finished(f"r{n}")
        return chosen

    # "hot" takes 60 % of the requests: 0.6 x 4 workers / 0.5 -> 4.8 replicas, capped at 3
    for i in range(100):
        send("hot" if i % 5 < 3 else f"cold{i % 5}")
        clock.now += 0.05
    hot_workers = {send("hot") for _ in range(12)}
    assert len(hot_workers) == 3 and p.wanted_replicas("hot", 4) == 3
    assert p.counters.placements[("hot", "replica")] == 2
    # it cools: the others' traffic takes over, its surplus holders get nothing more
    for i in range(400):
        send(f"cold{i % 4}")
        clock.now += 0.05
    assert p.wanted_replicas("hot", 4) == 1
    assert len(p.plan("hot", ws).allowed) == 1


def test_pending_placement_expires_without_the_workers_event() -> None:
    clock = Clock()
    ws = [worker(0), worker(1)]
    p = placement(ws, clock, pending_s=5.0)
    plan = p.plan("a", ws)
    target = plan.allowed[0].instance_id
    p.routed("r", target, plan, 1)
    assert p.holds(target, "a")
    clock.now = 6.0
    assert not p.holds(target, "a")  # the load failed or was never made: place it again
    assert p.plan("a", ws).reason == "placed"


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="lora_max_replicas"):
        LoraPlacementConfig(max_replicas=0)
    with pytest.raises(ValueError, match="lora_replica_load"):
        LoraPlacementConfig(replica_load=0.0)


# ---------------------------------------------------------------- through the routers
def card_worker(i: int, max_loras: int = 2, loras: tuple[str, ...] = ()) -> Instance:
    from tandem.protocols.discovery import ModelCard

    w = worker(i, max_loras, loras)
    w.model = ModelCard(name="m", context_length=4096, block_size=4, num_total_blocks=1000)
    return w


def lora_req(rid: str, lora: str | None, tokens: int = 32) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="m",
        token_ids=list(range(tokens)),
        stop=StopConditions(max_tokens=4),
        lora_name=lora,
    )


async def test_kv_router_routes_to_the_holder_from_events_and_explains_why() -> None:
    bus = MemoryEventBus()
    ws = StaticInstanceSet([card_worker(i) for i in range(4)])
    router = make_router("kv", RouterConfig(seed=0), instances=ws, events=bus)
    await router.start()
    try:
        event = LoraEvent(kind="loaded", name="sql", worker_id="w2", resident=["sql"],
                          max_loras=2, load_s=0.25)  # fmt: skip
        await bus.publish(lora_events_subject("tandem", "backend"), encode(event))
        for _ in range(50):
            if router.explain(lora_req("x", "sql")).get("lora", {}).get("holders"):
                break
            await asyncio.sleep(0.01)
        for i in range(6):  # KV-aware among holders: one holder, every request goes there
            d = await router.route(lora_req(f"r{i}", "sql"))
            assert d.instance_id == "w2" and d.details["lora"]["reason"] == "holder"
        base = router.explain(lora_req("b", None))  # the base model: every worker
        assert len(base["candidates"]) == 4 and "lora" not in base
        ex = router.explain(lora_req("y", "sql"))
        assert ex["lora"]["holders"] == ["w2"] and ex["lora"]["residency"]["w2"]["resident"] == [
            "sql"
        ]
        assert [c["worker_id"] for c in ex["candidates"]] == ["w2"]
        text = router.metrics.render()  # type: ignore[union-attr]
        assert 'tandem_router_lora_requests_total{adapter="sql"} 6' in text
        assert 'tandem_router_lora_loads_total{adapter="sql"} 1' in text
        assert 'tandem_router_lora_resident_adapters{worker_id="w2"} 1' in text
    finally:
        await router.close()


async def test_two_routers_place_a_miss_on_the_same_worker_and_follow_it() -> None:
    routers = []
    for seed in (1, 2):
        ws = StaticInstanceSet([card_worker(i, max_loras=4) for i in range(8)])
        r = make_router("kv", RouterConfig(seed=seed), instances=ws)
        await r.start()
        routers.append(r)
    for name in ("fr", "de", "legal", "med"):
        chosen = {(await r.route(lora_req(f"{name}-{j}", name))).instance_id
                  for j, r in enumerate(routers)}  # fmt: skip
        assert len(chosen) == 1, f"{name}: {chosen}"
        # the next request of the same router follows (pending until the worker's event)
        again = await routers[0].route(lora_req(f"{name}-again", name))
        assert again.instance_id in chosen and again.details["lora"]["reason"] == "holder"
    off = make_router(
        "kv",
        RouterConfig(seed=0, lora=LoraPlacementConfig(enabled=False)),
        instances=StaticInstanceSet([card_worker(i) for i in range(4)]),
    )
    await off.start()
    assert "lora" not in (await off.route(lora_req("z", "fr"))).details
    for r in (*routers, off):
        await r.close()


def test_a_cold_adapter_is_unloaded_when_idle_and_a_hot_one_never() -> None:
    # 2 workers x 2 slots = 4 slots; 8 adapters asked for: "hot" far more than the others
    clock = Clock()
    ws = [worker(0, max_loras=2), worker(1, max_loras=2)]
    p = placement(ws, clock)
    for i in range(60):
        name = "hot" if i % 2 else f"c{i % 7}"
        plan = p.plan(name, ws)
        p.routed(f"r{i}", plan.allowed[0].instance_id, plan, 8)
        p.finished(f"r{i}")
        clock.now += 0.1
    assert not p.is_cold("hot") and p.is_cold("new")
    target = p.plan("new", ws).allowed[0].instance_id
    p.apply_event(loaded(target, "new", ["new"]))
    plan = p.plan("new", ws)
    p.routed("last", target, plan, 8)
    assert p.finished("last") == (target, "new")  # idle and cold: ask the worker to unload it
    p.apply_event(loaded(target, "hot", ["hot"]))
    plan = p.plan("hot", ws)
    p.routed("h", target, plan, 8)
    assert p.finished("h") is None  # hot stays
    few = placement(ws, clock)  # fewer adapters than slots: nothing is ever cold
    assert not few.is_cold("anything")


async def test_the_kv_router_asks_the_worker_to_unload_a_cold_adapter() -> None:
    calls: list[tuple[str, str, bytes]] = []

    class Client:
        async def stream(self, address: str, path: str, payload: bytes, **kw: object) -> Any:
            calls.append((address, path, payload))
            yield b""

    ws = StaticInstanceSet([card_worker(i, max_loras=1) for i in range(2)])
    router = make_router("kv", RouterConfig(seed=0), instances=ws, client=Client())  # type: ignore[arg-type]
    await router.start()
    lora = router.lora  # type: ignore[attr-defined]
    for i in range(40):  # a, b hot; 10 others once each: 12 adapters for 2 slots
        name = ("a", "b")[i % 2] if i < 30 else f"x{i}"
        d = await router.route(lora_req(f"r{i}", name))
        lora.apply_event(loaded(d.instance_id, name, [name], max_loras=1))
        router.on_finish(f"r{i}")
        await asyncio.sleep(0)
    assert calls and all(path == "tandem.backend.unload_lora" for _, path, _ in calls)
    unloaded = {unload_name(payload) for _, _, payload in calls}
    assert unloaded and not unloaded & {"a", "b"}
    await router.close()


def unload_name(payload: bytes) -> str:
    import msgspec

    from tandem.protocols.lora import LoraUnloadRequest

    return msgspec.msgpack.decode(payload, type=LoraUnloadRequest).name
