"""LoRA adapters through the frontend (issue 32), in one process (memory discovery and events,
TCP request plane, mocker workers with adapter slots): load and unload in vLLM's shapes,
/v1/models, `model=<adapter>` on every generate endpoint, every bad input's status, the admin
key, a restarted frontend, `--lora` at start, on-demand loads and residency events."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from tests.support.frontend_stack import CHAT, FrontendStack
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker
from tandem.frontend.lora_config import LoraApiConfig, LoraSpec
from tandem.protocols import lora as wire
from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.protocols.lora import LoraCard

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class RecordingMocker(MockerEngine):
    """The mocker, noting each request's `lora_name` as the engine receives it."""

    def __init__(self, config: MockerConfig) -> None:
        super().__init__(config)
        self.lora_names: list[str | None] = []

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest, **kwargs: Any
    ) -> AsyncGenerator[EngineOutput, None]:
        self.lora_names.append(request.lora_name)
        async for out in super().generate(request, **kwargs):
            yield out


def mocker(*, max_loras: int = 4, speedup_ratio: float = 0.0) -> RecordingMocker:
    return RecordingMocker(
        MockerConfig(
            num_blocks=256,
            block_size=16,
            speedup_ratio=speedup_ratio,
            tokenizer=f"gguf:{smollm2_gguf()}",
            model_name=MODEL,
            max_loras=max_loras,
            lora_load_ms=5.0,
        )
    )


def adapter_dir(root: Path, name: str, rank: int = 8) -> Path:
    """A PEFT-layout directory (the mocker reads only the config's rank)."""
    path = root / name
    path.mkdir(parents=True)
    config = {"r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
              "base_model_name_or_path": MODEL, "peft_type": "LORA"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **extra}  # fmt: skip


async def started(
    stack: AsyncExitStack, *, workers: int = 1, max_loras: int = 4, **config: Any
) -> tuple[FrontendStack, list[Worker]]:
    fs = FrontendStack(stack)
    added = [await fs.add_worker(mocker(max_loras=max_loras)) for _ in range(workers)]
    await fs.start_frontend(chat(MODEL), **config)
    return fs, added


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


def engine_of(worker: Worker) -> RecordingMocker:
    assert isinstance(worker.engine, RecordingMocker)
    return worker.engine


async def test_load_list_generate_unload(stack: AsyncExitStack, tmp_path: Path) -> None:
    sql = adapter_dir(tmp_path, "sql").resolve()
    fs, (worker,) = await started(stack, lora=LoraApiConfig(lora_dir=str(tmp_path)))
    status, body, _ = await fs.post(LOAD, {"lora_name": "sql-lora", "lora_path": "sql"})
    assert (status, body) == (200, "Success: LoRA adapter 'sql-lora' added successfully.")
    assert engine_of(worker).loras() == ["sql-lora"]  # the worker validated and holds it

    _, text = await fs.get("/v1/models")
    models = {m["id"]: m for m in json.loads(text)["data"]}
    assert models["sql-lora"]["parent"] == MODEL
    assert models["sql-lora"]["root"] == str(sql)
    _, text = await fs.get("/v1/models/sql-lora")
    assert json.loads(text)["parent"] == MODEL

    seen = engine_of(worker).lora_names
    seen.clear()
    status, reply, _ = await fs.post(CHAT, chat("sql-lora"))
    assert status == 200 and reply["model"] == "sql-lora"
    status, reply, _ = await fs.post(
        "/v1/completions", {"model": "sql-lora", "prompt": "hi", "max_tokens": 3}
    )
    assert status == 200 and reply["model"] == "sql-lora"
    status, reply, _ = await fs.post(
        "/v1/responses", {"model": "sql-lora", "input": "hi", "max_output_tokens": 3}
    )
    assert status == 200 and reply["model"] == "sql-lora"
    status, reply, _ = await fs.post(CHAT, chat(MODEL))  # the base model stays the base
    assert status == 200
    assert seen == ["sql-lora", "sql-lora", "sql-lora", None]
    _, text = await fs.get("/metrics")  # requests and tokens per adapter, beside the base's
    for family in ("input_tokens_total", "output_tokens_total"):
        counts = {m: float(v) for m, v in re.findall(
            rf'^tandem_frontend_{family}{{model="([^"]+)"}} (\S+)$', text, re.M)}  # fmt: skip
        assert counts["sql-lora"] > 0 and counts[MODEL] > 0, (family, counts)

    status, reply, _ = await fs.post("/v1/embeddings", {"model": "sql-lora", "input": "hi"})
    assert status == 400 and "LoRA adapter" in reply["error"]["message"]

    status, body, _ = await fs.post(UNLOAD, {"lora_name": "sql-lora"})
    assert (status, body) == (200, "Success: LoRA adapter 'sql-lora' removed successfully.")
    assert engine_of(worker).loras() == []
    status, reply, _ = await fs.post(CHAT, chat("sql-lora"))
    assert status == 404 and reply["error"]["type"] == "model_not_found"
    assert "'sql-lora'" in reply["error"]["message"]
    _, text = await fs.get("/v1/models")
    assert [m["id"] for m in json.loads(text)["data"]] == [MODEL]
    status, reply, _ = await fs.post(UNLOAD, {"lora_name": "sql-lora"})
    assert status == 404 and "'sql-lora' cannot be found" in reply["error"]["message"]


async def test_bad_inputs_lose_nothing(stack: AsyncExitStack, tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    adapter_dir(root, "good")
    adapter_dir(outside, "elsewhere")
    (root / "escape").symlink_to(outside / "elsewhere")
    bad = adapter_dir(root, "rank0", rank=0)
    (root / "noconfig").mkdir()
    (root / "corrupt").mkdir()
    (root / "corrupt" / "adapter_config.json").write_text("{not json")
    fs, (worker,) = await started(stack, lora=LoraApiConfig(lora_dir=str(root)))
    assert (await fs.post(LOAD, {"lora_name": "good", "lora_path": "good"}))[0] == 200

    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"lora_name": "x", "lora_path": str(outside / "elsewhere")}, 403, "outside --lora-dir"),
        ({"lora_name": "x", "lora_path": "../outside/elsewhere"}, 403, "outside --lora-dir"),
        ({"lora_name": "x", "lora_path": "escape"}, 403, "outside --lora-dir"),
        ({"lora_name": "x", "lora_path": "missing"}, 400, "is not a directory"),
        ({"lora_name": "x", "lora_path": "noconfig"}, 400, "no adapter_config.json"),
        ({"lora_name": "x", "lora_path": "corrupt"}, 400, "not readable JSON"),
        ({"lora_name": "x", "lora_path": "rank0"}, 400, "r=0"),
        ({"lora_name": MODEL, "lora_path": "good"}, 400, "conflicts with a served base model"),
        ({"lora_name": "good", "lora_path": "rank0"}, 400, "has already been loaded"),
        ({"lora_name": "has space", "lora_path": "good"}, 400, "printable ASCII"),
        ({"lora_name": "", "lora_path": "good"}, 400, "must be provided"),
        ({"lora_name": "x", "lora_path": "good", "load_inplace": True}, 400, "load_inplace"),
        ({"lora_name": "x", "lora_path": "good", "base_model_name": "nope"}, 400, "not served"),
        ({"lora_path": "good"}, 400, "lora_name"),
    ]
    for body, want_status, want_text in cases:
        status, reply, _ = await fs.post(LOAD, body)
        assert status == want_status, (body, reply)
        assert want_text in reply["error"]["message"], (body, reply)
    assert str(bad.name) not in json.dumps(await fs.get("/v1/models"))
    # nothing was lost: the good adapter still serves, nothing else was cataloged or loaded
    assert engine_of(worker).loras() == ["good"]
    _, text = await fs.get("/v1/models")
    assert [m["id"] for m in json.loads(text)["data"]] == [MODEL, "good"]
    assert (await fs.post(CHAT, chat("good")))[0] == 200
    status, reply, _ = await fs.post(CHAT, chat("nosuch"))
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    assert "'nosuch'" in reply["error"]["message"]


async def test_runtime_loading_needs_lora_dir(stack: AsyncExitStack, tmp_path: Path) -> None:
    adapter_dir(tmp_path, "a")
    fs, _ = await started(stack)
    status, reply, _ = await fs.post(LOAD, {"lora_name": "a", "lora_path": str(tmp_path / "a")})
    assert status == 403 and "--lora-dir" in reply["error"]["message"]


async def test_admin_key(stack: AsyncExitStack, tmp_path: Path) -> None:
    adapter_dir(tmp_path, "a")
    lora = LoraApiConfig(lora_dir=str(tmp_path))
    fs, _ = await started(stack, api_keys=("user-key-123",), admin_api_keys=("admin-key-456",),
                          lora=lora)  # fmt: skip
    status, reply, _ = await fs.post(LOAD, {"lora_name": "a", "lora_path": "a"})
    assert status == 401 and "incorrect API key" in reply["error"]["message"]
    fs.headers = {"authorization": "Bearer admin-key-456"}
    assert (await fs.post(LOAD, {"lora_name": "a", "lora_path": "a"}))[0] == 200
    fs.headers = {"authorization": "Bearer user-key-123"}
    assert (await fs.post(CHAT, chat("a")))[0] == 200  # a user key may use it
    assert (await fs.post(UNLOAD, {"lora_name": "a"}))[0] == 401

    only_users = FrontendStack(stack)
    only_users.discovery, only_users.events = fs.discovery, fs.events
    await only_users.start_frontend(chat(MODEL), api_keys=("user-key-123",), lora=lora)
    status, reply, _ = await only_users.post(UNLOAD, {"lora_name": "a"})
    assert status == 403 and "--admin-api-key" in reply["error"]["message"]


async def test_restarted_frontend_still_serves(stack: AsyncExitStack, tmp_path: Path) -> None:
    adapter_dir(tmp_path, "a")
    lora = LoraApiConfig(lora_dir=str(tmp_path))
    fs, _ = await started(stack, lora=lora)
    async with AsyncExitStack() as first:  # the first frontend, stopped at the block's end
        one = FrontendStack(first)
        one.discovery, one.events = fs.discovery, fs.events
        await one.start_frontend(chat(MODEL), lora=lora)
        assert (await one.post(LOAD, {"lora_name": "a", "lora_path": "a"}))[0] == 200
    again = FrontendStack(stack)
    again.discovery, again.events = fs.discovery, fs.events
    await again.start_frontend(chat("a"))  # serves the adapter as soon as it is ready
    _, text = await again.get("/v1/models")
    assert "a" in [m["id"] for m in json.loads(text)["data"]]


async def test_lora_flag_at_start(stack: AsyncExitStack, tmp_path: Path) -> None:
    """`--lora` adapters load once a worker is up, from any directory (the operator's)."""
    path = adapter_dir(tmp_path, "startup")
    fs = FrontendStack(stack)
    spec = LoraSpec(name="startup", path=str(path))
    fs_task = asyncio.create_task(
        fs.start_frontend(chat("startup"), lora=LoraApiConfig(adapters=(spec,)))
    )
    await asyncio.sleep(0.2)  # the frontend is up before any worker
    worker = await fs.add_worker(mocker())
    await asyncio.wait_for(fs_task, 30)
    assert engine_of(worker).loras() == ["startup"]


async def test_on_demand_load_and_events(stack: AsyncExitStack, tmp_path: Path) -> None:
    """A worker that does not hold a cataloged adapter loads it when a request names it, and
    announces it (with its whole resident set); its metadata says it serves LoRA."""
    adapter_dir(tmp_path, "a")
    fs, workers = await started(stack, workers=2, lora=LoraApiConfig(lora_dir=str(tmp_path)))
    rt = await fs.runtime()
    sub = await rt.events.subscribe(wire.lora_events_subject(rt.namespace, "backend"))
    assert (await fs.post(LOAD, {"lora_name": "a", "lora_path": "a"}))[0] == 200
    holder = next(w for w in workers if engine_of(w).loras())
    other = next(w for w in workers if w is not holder)
    assert other.instance is not None and other.instance.metadata["max_loras"] == 4
    assert other.instance.metadata["lora_state_endpoint"] == "lora_state"
    fs.headers = {"x-worker-instance-id": other.instance_id}
    assert (await fs.post(CHAT, chat("a")))[0] == 200
    assert engine_of(other).loras() == ["a"] and engine_of(other).lora_names[-1] == "a"
    scraped = other.metrics.render().decode()  # its /metrics: what it loaded and serves
    for family, value in (("loads_total", 1), ("requests_total", 1), ("resident", 1),
                          ("slots", 4), ("load_seconds_count", 1)):  # fmt: skip
        assert re.search(rf"^tandem_worker_lora_{family}{{.*}} {value}$", scraped, re.M), family

    events = []
    async with asyncio.timeout(10):
        async for _, payload in sub:
            events.append(msgspec_decode(payload))
            if len(events) == 2:
                break
    await sub.close()
    assert [(e.kind, e.name, e.worker_id, e.resident, e.max_loras) for e in events] == [
        ("loaded", "a", holder.instance_id, ["a"], 4),
        ("loaded", "a", other.instance_id, ["a"], 4),
    ]


def msgspec_decode(payload: bytes) -> wire.LoraEvent:
    import msgspec

    return msgspec.msgpack.decode(payload, type=wire.LoraEvent)


async def test_engine_without_lora_refuses(stack: AsyncExitStack, tmp_path: Path) -> None:
    """Never a silent base-model answer: a worker whose engine serves no adapters refuses."""
    adapter_dir(tmp_path, "a")
    fs, _ = await started(stack, max_loras=0, lora=LoraApiConfig(lora_dir=str(tmp_path)))
    status, reply, _ = await fs.post(LOAD, {"lora_name": "a", "lora_path": "a"})
    assert status == 400 and "serves no LoRA adapters" in reply["error"]["message"]
    assert "vllm with vLLM's --enable-lora" in reply["error"]["message"]  # the engines that do
    rt = await fs.runtime()  # cataloged elsewhere (another pool's frontend): the worker refuses
    await rt.loras.put(LoraCard(name="a", base_model=MODEL, path=str(tmp_path / "a")))
    async with asyncio.timeout(10):
        while (reply := await fs.post(CHAT, chat("a")))[0] == 404:  # noqa: ASYNC110 - HTTP
            await asyncio.sleep(0.1)  # until the frontend's next catalog read
    assert reply[0] == 400 and "serves no LoRA adapters" in reply[1]["error"]["message"]


async def test_unload_lets_running_requests_finish(stack: AsyncExitStack, tmp_path: Path) -> None:
    path = adapter_dir(tmp_path, "a")
    fs = FrontendStack(stack)
    await fs.add_worker(mocker(speedup_ratio=1.0))
    await fs.start_frontend(chat(MODEL), lora=LoraApiConfig(lora_dir=str(tmp_path)))
    assert (await fs.post(LOAD, {"lora_name": "a", "lora_path": "a"}))[0] == 200
    long = chat("a", max_tokens=200, ignore_eos=True, stream=True)
    running = asyncio.create_task(fs.post(CHAT, long))
    await asyncio.sleep(0.3)
    assert not running.done()
    assert (await fs.post(UNLOAD, {"lora_name": "a"}))[0] == 200
    status, text, _ = await running
    assert status == 200 and text.rstrip().endswith("data: [DONE]")
    assert '"finish_reason":"length"' in text.replace(" ", "")
    assert (path / "adapter_config.json").exists()  # an unload deletes no files


def readme_example() -> tuple[dict[str, Any], str]:
    """The README's LoRA example: the load request's JSON body and the OpenAI SDK code."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("### LoRA adapters", 1)[1]
    body = json.loads(section.split("-d '", 1)[1].split("'", 1)[0])
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    return body, code


async def test_readme_example(stack: AsyncExitStack, tmp_path: Path) -> None:
    """The README's load request and its OpenAI SDK code, as written, against a live stack."""
    body, code = readme_example()
    adapter_dir(tmp_path, body["lora_path"])
    fs, (worker,) = await started(stack, lora=LoraApiConfig(lora_dir=str(tmp_path)))
    assert (await fs.post(LOAD, body))[0] == 200
    printed: list[tuple[Any, ...]] = []
    code = code.replace("http://127.0.0.1:8000", fs.base)
    env = {"print": lambda *args: printed.append(args)}
    await asyncio.to_thread(exec, code, env)  # the SDK is synchronous here
    assert printed[0] == ([MODEL, body["lora_name"]],)
    assert printed[1][0] == body["lora_name"]
    assert engine_of(worker).lora_names[-1] == body["lora_name"]


async def test_adapter_blocks_stay_the_adapters_in_router_engine_and_tiers(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    """The adapter is part of every block's identity wherever KV lives: the router's index
    (route/explain overlap), the engine's prefix cache (usage's cached tokens) and the KV tiers
    (blocks offloaded to the mocker's host tier still credit the adapter that computed them and
    onboard for it, never for the base model or another adapter)."""
    from tandem.kvbm.base import KvbmConfig
    from tandem.router.config import RouterConfig

    adapter_dir(tmp_path, "a1")
    adapter_dir(tmp_path, "a2")
    fs = FrontendStack(stack)
    engine = RecordingMocker(
        MockerConfig(num_blocks=16, block_size=16, speedup_ratio=0,
                     tokenizer=f"gguf:{smollm2_gguf()}", model_name=MODEL, max_loras=4,
                     lora_load_ms=1.0, kvbm=KvbmConfig(host_blocks=256, log_interval_s=0))
    )  # fmt: skip
    await fs.add_worker(engine)
    prompt = list(range(300, 364))  # 4 full blocks of 16

    def body(model: str, tokens: list[int] = prompt) -> dict[str, Any]:
        return {"model": model, "prompt": tokens, "max_tokens": 1}

    ready = body(MODEL, list(range(2000, 2008)))
    await fs.start_frontend(ready, ready_path="/v1/completions", router_policy="kv",
                            router=RouterConfig(seed=1), admin_api_keys=("sk-admin",),
                            lora=LoraApiConfig(lora_dir=str(tmp_path)))  # fmt: skip
    fs.headers = {"authorization": "Bearer sk-admin"}
    for name in ("a1", "a2"):
        assert (await fs.post(LOAD, {"lora_name": name, "lora_path": name}))[0] == 200

    async def overlap(model: str) -> float:
        status, reply, _ = await fs.post("/v1/route/explain", body(model))
        assert status == 200, reply
        return float(max(c["overlap_blocks"] for c in reply["candidates"]))

    async def cached(model: str) -> int:
        status, reply, _ = await fs.post("/v1/completions", body(model))
        assert status == 200, reply
        return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def until(pred: Any) -> None:
        async with asyncio.timeout(30):
            while not await pred():  # noqa: ASYNC110 - observed over HTTP
                await asyncio.sleep(0.02)

    assert await cached("a1") == 0  # computed under a1
    await until(lambda: _eq(overlap("a1"), 4))
    assert await overlap(MODEL) == 0 and await overlap("a2") == 0  # the router's index
    assert await cached("a2") == 0  # the engine's prefix cache (a2 now computed it too)
    assert await cached("a1") > 0
    for i in range(6):  # churn the 16-block device pool: the prompt's blocks go to the host tier
        other = list(range(1000 + 64 * i, 1064 + 64 * i))
        assert (await fs.post("/v1/completions", body(MODEL, other)))[0] == 200

    async def offloaded() -> bool:
        return 0 < await overlap("a1") < 4  # host-tier blocks earn partial credit only

    await until(offloaded)
    assert await overlap(MODEL) == 0  # the base model never computed it: no tier credit
    assert await cached(MODEL) == 0  # nor does it onboard a1's (or a2's) offloaded blocks
    assert await cached("a1") > 0  # a1 gets its own back from the host tier
    assert engine.lora_names[-2:] == [None, "a1"]


async def _eq(value: Any, expected: float) -> bool:
    return bool(await value == expected)
