"""LoRA adapters on the real SmolLM2 (native engine) through the frontend (issue 32): every bad
adapter the issue names is a 400 naming the problem, judged by the worker's PEFT reader before
the catalog takes it, and nothing is lost; a good adapter answers `model=<adapter>` with other
tokens than the base model, and the base model's answer does not change."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from tests.support.frontend_stack import CHAT, FrontendStack
from tests.support.lora_adapters import write_adapter

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.frontend.lora_config import LoraApiConfig

pytestmark = [pytest.mark.native, pytest.mark.timeout(180)]
MODEL = "smollm2"
LOAD = "/v1/load_lora_adapter"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    write_adapter(root, "good", seed=1)
    write_adapter(root, "other-base", hidden=1024, layers=2)  # another model's shapes
    write_adapter(root, "wrong-rank", rank=4, config_rank=8)
    write_adapter(root, "unknown-module", modules=("q_proj", "foo_proj"))
    corrupt = write_adapter(root, "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not a header")
    return root


@pytest.fixture
async def stack(adapters: Path) -> AsyncIterator[FrontendStack]:
    async with AsyncExitStack() as exit_stack:
        fs = FrontendStack(exit_stack)
        config = NativeConfig(num_blocks=64, max_num_batched_tokens=64, max_model_len=256,
                              num_threads=1, max_loras=2)  # fmt: skip
        await fs.add_worker(NativeEngine(config))
        await fs.start_frontend(chat(MODEL), lora=LoraApiConfig(lora_dir=str(adapters)))
        yield fs


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Name a color."}],
            "max_tokens": 8, "temperature": 0}  # fmt: skip


async def test_bad_adapters_are_400s_naming_the_problem(stack: FrontendStack) -> None:
    fs = stack
    base = (await fs.post(CHAT, chat(MODEL)))[1]["choices"][0]["message"]["content"]
    for name, problem in (
        ("other-base", "another base model"),
        ("wrong-rank", "r does not match the weights"),
        ("unknown-module", "foo_proj"),
        ("corrupt", "is corrupt"),
    ):
        status, reply, _ = await fs.post(LOAD, {"lora_name": name, "lora_path": name})
        assert status == 400 and problem in reply["error"]["message"], (name, reply)
        status, reply, _ = await fs.post(CHAT, chat(name))
        assert status == 404 and reply["error"]["code"] == "model_not_found"

    assert (await fs.post(LOAD, {"lora_name": "good", "lora_path": "good"}))[0] == 200
    status, reply, _ = await fs.post(CHAT, chat("good"))
    assert status == 200 and reply["model"] == "good"
    assert reply["choices"][0]["message"]["content"] != base  # the adapter applies
    again = (await fs.post(CHAT, chat(MODEL)))[1]["choices"][0]["message"]["content"]
    assert again == base  # and the base model is untouched
    _, text = await fs.get("/v1/models")
    assert [m["id"] for m in json.loads(text)["data"]] == [MODEL, "good"]
